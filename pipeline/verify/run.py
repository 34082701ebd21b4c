"""`arslice verify` over a run directory: every stage's checks, and one fingerprint everywhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.layout import (
    MODEL_CONFIG_NAME,
    MODEL_WEIGHTS_NAME,
    Folders,
    RunLayout,
    is_complete,
    meta_path,
    require_dir,
)
from pipeline.config import Command, say
from pipeline.verify.checks import Checks, VerifyConfig


def _complete_dirs(found: Folders, checks: Checks, what: str) -> list[Path]:
    """The complete folders of `found`; each incomplete one is a note."""
    for d in found.incomplete:
        checks.note(f"{d}: incomplete {what} (no meta.json), not checked")
    return found.complete


def _outputs(
    found: Folders, heading: str, what: str, checks: Checks, fingerprints: dict
) -> Iterator[tuple[Path, dict]]:
    """Each complete folder of `found` with its meta.json, under `heading` (said when there is
    one), its fingerprint recorded as `what FOLDER`; each incomplete one is a note."""
    from ar_slicing.machinery.io import read_json

    folders = _complete_dirs(found, checks, what)
    if folders:
        say(heading)
    for d in folders:
        meta = read_json(meta_path(d))
        fingerprints[f"{what} {d}"] = meta.get("fingerprint")
        yield d, meta


def verify_run(cfg: VerifyConfig) -> dict:
    run = Path(cfg.run)
    require_dir(run, "run directory")
    checks = Checks()
    say(f"verify {run}")
    RunVerifier(RunLayout(run), checks, cfg.scan_tokens).verify()
    say(
        f"verify: {checks.passed} check(s) passed, {len(checks.failures)} failed"
        + (f", {len(checks.notes)} note(s)" if checks.notes else "")
    )
    if checks.failures:
        raise ArSliceError(
            f"{run}: {len(checks.failures)} check(s) failed:\n  " + "\n  ".join(checks.failures)
        )
    return {"passed": checks.passed, "failed": 0, "notes": checks.notes}


class RunVerifier:
    """The checks of one run's outputs, stage by stage in pipeline order (each reads what the
    one before found: the validation store's meta.json, the tags' window table), and last that
    every output recorded the same tokenizer fingerprint."""

    def __init__(self, layout: RunLayout, checks: Checks, scan_tokens: bool):
        self.layout, self.checks, self.scan_tokens = layout, checks, scan_tokens
        self.fingerprints: dict[str, str | None] = {}
        self.val_meta: dict | None = None
        self.counts_ok = False
        self.tags_meta: dict | None = None
        self.windows = None

    def verify(self) -> None:
        self.tokenizer()
        self.stores()
        self.counts()
        self.tags()
        self.models()
        self.losses()
        self.probes()
        self.one_fingerprint()

    def tokenizer(self) -> None:
        tokenizer = self.layout.tokenizer
        if tokenizer.is_file():  # the run's own tokenizer, when the run trained one
            from ar_slicing.data.tokenizer import fingerprint, load_tokenizer

            self.fingerprints[f"tokenizer {tokenizer}"] = fingerprint(load_tokenizer(tokenizer))

    def stores(self) -> None:
        from pipeline.verify.stores import verify_store

        say("token stores")
        store_metas: dict[str, dict] = {}
        for d in _complete_dirs(self.layout.stores(), self.checks, "token store"):
            meta = verify_store(d, self.checks, self.scan_tokens)
            store_metas[d.name] = meta
            self.fingerprints[f"token store {d}"] = meta.get("tokenizer", {}).get("fingerprint")
        self.val_meta = store_metas.get(self.layout.store("val").name)

    def counts(self) -> None:
        from pipeline.verify.stores import verify_counts

        counts_dir = self.layout.counts
        self.counts_ok = is_complete(counts_dir)
        if self.counts_ok:
            say("counts")
            meta = verify_counts(counts_dir, self.checks)
            self.fingerprints[f"counts {counts_dir}"] = meta.get("fingerprint")
        elif counts_dir.exists():
            self.checks.note(f"{counts_dir}: incomplete (no meta.json), not checked")

    def tags(self) -> None:
        from pipeline.verify.tags import verify_tags

        tags_dir, val_dir = self.layout.tags, self.layout.store("val")
        if is_complete(tags_dir):
            say("tags")
            self.tags_meta, self.windows = verify_tags(
                tags_dir,
                self.val_meta,
                val_dir if self.val_meta is not None else None,
                self.layout.counts if self.counts_ok else None,
                self.checks,
                self.scan_tokens,
            )
            self.fingerprints[f"tags {tags_dir}"] = self.tags_meta.get("fingerprint")
            if self.val_meta is None:
                self.checks.note(
                    f"{val_dir}: no complete validation store; tags checked on their own"
                )
        elif tags_dir.exists():
            self.checks.note(f"{tags_dir}: incomplete (no meta.json), not checked")

    def models(self) -> None:
        folders = self.layout.trained_models()
        for d, _meta in _outputs(folders, "models", "model", self.checks, self.fingerprints):
            self.checks.check(
                (d / MODEL_WEIGHTS_NAME).is_file() and (d / MODEL_CONFIG_NAME).is_file(),
                f"{d}: {MODEL_CONFIG_NAME} and {MODEL_WEIGHTS_NAME} present",
            )

    def losses(self) -> None:
        from pipeline.verify.tags import verify_losses

        checks, tags_meta = self.checks, self.tags_meta
        folders = self.layout.loss_folders()
        for d, meta in _outputs(folders, "losses", "losses", checks, self.fingerprints):
            model_fp = meta.get("model_tokenizer_fingerprint")
            if model_fp and model_fp != meta.get("fingerprint"):
                what = f"{d}: the model's own tokenizer {model_fp[:12]}… is not the tags' one"
                if meta.get("skip_tokenizer_check"):
                    checks.note(what + " (evaluated with --skip-tokenizer-check)")
                else:
                    checks.fail(what)
            if self.windows is None or tags_meta is None:
                checks.fail(f"{d}: losses but no valid tags to check them against")
                continue
            window = int(tags_meta["window"])
            if int(meta.get("window", window)) != window:
                checks.fail(f"{d}: window {meta.get('window')} but the tags use {window}")
                continue
            verify_losses(d, self.windows, window, checks)

    def probes(self) -> None:
        # (a probe records no tokenizer fingerprint of its own: it read the losses', checked)
        from ar_slicing.machinery.io import read_json
        from pipeline.verify.probes import verify_probes, verify_same_sequences

        folders = _complete_dirs(self.layout.probe_folders(), self.checks, "probes")
        probe_metas = {d: read_json(meta_path(d)) for d in folders}
        if probe_metas:
            say("probes")
        for d, meta in probe_metas.items():
            verify_probes(d, meta, self.layout, self.checks)
        verify_same_sequences(probe_metas, self.checks)

    def one_fingerprint(self) -> None:
        say("tokenizer")
        fingerprints = self.fingerprints
        distinct = set(fingerprints.values())
        if len(distinct) <= 1:
            self.checks.check(
                None not in distinct,
                f"one tokenizer fingerprint across {len(fingerprints)} artefact(s)",
                "no fingerprint recorded",
            )
        else:
            listing = "; ".join(f"{what}: {str(fp)[:12]}…" for what, fp in fingerprints.items())
            self.checks.fail(f"tokenizer fingerprints differ: {listing}")


COMMAND = Command(
    VerifyConfig,
    verify_run,
    inputs=lambda cfg: [("--run", cfg.run, "dir")],
    summary="check a run's invariants",
    examples="""\
  arslice verify --run runs/demo
  arslice verify --run runs/pile --no-scan-tokens   # sizes, tables and losses; no token scan""",
)

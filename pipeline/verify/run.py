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
    from ar_slicing.machinery.io import read_json
    from pipeline.verify.probes import verify_probes, verify_same_sequences
    from pipeline.verify.stores import verify_counts, verify_store
    from pipeline.verify.tags import verify_losses, verify_tags

    run = Path(cfg.run)
    require_dir(run, "run directory")
    layout = RunLayout(run)
    checks = Checks()
    fingerprints: dict[str, str | None] = {}

    say(f"verify {run}")
    if layout.tokenizer.is_file():  # the run's own tokenizer, when the run trained one
        from ar_slicing.data.tokenizer import fingerprint, load_tokenizer

        fingerprints[f"tokenizer {layout.tokenizer}"] = fingerprint(
            load_tokenizer(layout.tokenizer)
        )
    say("token stores")
    store_metas: dict[str, dict] = {}
    for d in _complete_dirs(layout.stores(), checks, "token store"):
        meta = verify_store(d, checks, cfg.scan_tokens)
        store_metas[d.name] = meta
        fingerprints[f"token store {d}"] = meta.get("tokenizer", {}).get("fingerprint")
    val_dir = layout.store("val")
    val_meta = store_metas.get(val_dir.name)

    counts_dir = layout.counts
    counts_ok = is_complete(counts_dir)
    if counts_ok:
        say("counts")
        meta = verify_counts(counts_dir, checks)
        fingerprints[f"counts {counts_dir}"] = meta.get("fingerprint")
    elif counts_dir.exists():
        checks.note(f"{counts_dir}: incomplete (no meta.json), not checked")

    tags_dir = layout.tags
    windows = None
    tags_meta = None
    if is_complete(tags_dir):
        say("tags")
        tags_meta, windows = verify_tags(
            tags_dir,
            val_meta,
            val_dir if val_meta is not None else None,
            counts_dir if counts_ok else None,
            checks,
            cfg.scan_tokens,
        )
        fingerprints[f"tags {tags_dir}"] = tags_meta.get("fingerprint")
        if val_meta is None:
            checks.note(f"{val_dir}: no complete validation store; tags checked on their own")
    elif tags_dir.exists():
        checks.note(f"{tags_dir}: incomplete (no meta.json), not checked")

    for d, _meta in _outputs(layout.trained_models(), "models", "model", checks, fingerprints):
        checks.check(
            (d / MODEL_WEIGHTS_NAME).is_file() and (d / MODEL_CONFIG_NAME).is_file(),
            f"{d}: {MODEL_CONFIG_NAME} and {MODEL_WEIGHTS_NAME} present",
        )

    for d, meta in _outputs(layout.loss_folders(), "losses", "losses", checks, fingerprints):
        model_fp = meta.get("model_tokenizer_fingerprint")
        if model_fp and model_fp != meta.get("fingerprint"):
            what = f"{d}: the model's own tokenizer {model_fp[:12]}… is not the tags' one"
            if meta.get("skip_tokenizer_check"):
                checks.note(what + " (evaluated with --skip-tokenizer-check)")
            else:
                checks.fail(what)
        if windows is None or tags_meta is None:
            checks.fail(f"{d}: losses but no valid tags to check them against")
            continue
        if int(meta.get("window", tags_meta["window"])) != int(tags_meta["window"]):
            checks.fail(f"{d}: window {meta.get('window')} but the tags use {tags_meta['window']}")
            continue
        verify_losses(d, windows, int(tags_meta["window"]), checks)

    # (a probe records no tokenizer fingerprint of its own: it read the losses', checked above)
    probe_metas = {
        d: read_json(meta_path(d)) for d in _complete_dirs(layout.probe_folders(), checks, "probes")
    }
    if probe_metas:
        say("probes")
    for d, meta in probe_metas.items():
        verify_probes(d, meta, layout, checks)
    verify_same_sequences(probe_metas, checks)

    say("tokenizer")
    distinct = {fp for fp in fingerprints.values()}
    if len(distinct) <= 1:
        checks.check(
            None not in distinct,
            f"one tokenizer fingerprint across {len(fingerprints)} artefact(s)",
            "no fingerprint recorded",
        )
    else:
        listing = "; ".join(f"{what}: {str(fp)[:12]}…" for what, fp in fingerprints.items())
        checks.fail(f"tokenizer fingerprints differ: {listing}")

    say(
        f"verify: {checks.passed} check(s) passed, {len(checks.failures)} failed"
        + (f", {len(checks.notes)} note(s)" if checks.notes else "")
    )
    if checks.failures:
        raise ArSliceError(
            f"{run}: {len(checks.failures)} check(s) failed:\n  " + "\n  ".join(checks.failures)
        )
    return {"passed": checks.passed, "failed": 0, "notes": checks.notes}


COMMAND = Command(
    VerifyConfig,
    verify_run,
    inputs=lambda cfg: [("--run", cfg.run, "dir")],
    summary="check a run's invariants",
    examples="""\
  arslice verify --run runs/demo
  arslice verify --run runs/pile --no-scan-tokens   # sizes, tables and losses; no token scan""",
)

"""`arslice probe`: the probes of one model (docs/design.md, "Probes of a checkpoint").

Reads the model, the tags and the model's losses (the eval stage's output); writes into `--out`:
  induction.parquet           the induction probe's table (`ar_slicing.analysis.probes.induction_schema`)
  induction_score.parquet     one row: the induction score and its bootstrap interval
  induction_curve.parquet     the loss curve by position of the repeated random tokens
  recall.parquet              the zero-shot key-value recall table (`recall_schema`)
  recall_by_k.parquet         accuracy and NLL at the queries per k, with the baselines
  recall_by_distance.parquet  the same per (k, distance from pair to query)
  position.parquet            the loss by window position per slice, on the run's windows
  icl.parquet                 the in-context learning score per slice
  meta.json                   settings, the digests of the sequences read, counts (last)

Every model of one vocabulary reads the same sequences (the seed and the sizes decide them; the
drawable ids come from the validation store's tokenizer, which the eval stage checked the model
against, capped at the model's head). A sequence is read after a prefix token only where the
model's losses were (rolling windows: the eval's prefix token). The three probes (induction,
recall, position) are the parts of the stage's ledger: a run killed after one of them resumes at
the next.

In a pipeline config, `[probe]` holds the sizes; the models are the eval stage's (`[eval.models]`
and the trained models, with every checkpoint `[eval] checkpoints` evaluates), each probed into
`probes/<name>/` from `losses/<name>/`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

from ar_slicing.analysis.probes import ProbeSizes
from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import build_meta, read_json, write_parquet_atomic
from ar_slicing.machinery.layout import (
    LOSS_PART_GLOB,
    PROBE_FILES,
    TAG_PART_GLOB,
    require_complete,
)
from pipeline.config import Command, ReadsModel
from pipeline.stage import Finished, Part, run_parts
from pipeline.wiring import LOSSES, MODELS, PROBES, TAGS, Fanned, Run, Table, Wiring

_DEFAULT = ProbeSizes()
# the keys of an eval table a probe of the same model takes (how the model is loaded and run)
EVAL_KEYS = ("model", "device", "dtype", "model_config", "trust_remote_code")


@dataclass(frozen=True)
class ProbeConfig(ReadsModel):
    model: str = field(metadata={"help": "model spec, as `arslice eval --model` takes it"})
    tags: str = field(metadata={"help": "tag directory written by `arslice tag`"})
    losses: str = field(
        metadata={"help": "the model's losses directory (`arslice eval --out`) on those tags"}
    )
    out: str = field(metadata={"help": "output directory for the probes' Parquet files"})
    name: str | None = field(default=None, metadata={"help": "model name (default: from spec)"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    dtype: str = field(
        default="auto", metadata={"help": "fp32, bf16, fp16 or auto (as `arslice eval`)"}
    )
    batch_size: str = field(
        default="auto", metadata={"help": "sequences per forward pass, or auto"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the sequences and the bootstrap"})
    induction_length: int = field(
        default=_DEFAULT.induction_length,
        metadata={"help": "n: distinct random ids per induction sequence (read twice)"},
    )
    induction_sequences: int = field(
        default=_DEFAULT.induction_sequences, metadata={"help": "induction sequences"}
    )
    recall_pairs: list[int] = field(
        default_factory=lambda: list(_DEFAULT.recall_pairs),
        metadata={"help": "k values: key-value pairs per recall sequence"},
    )
    recall_queries: int = field(
        default=_DEFAULT.recall_queries,
        metadata={"help": "queries per k (in ceil(queries / k) sequences)"},
    )
    bootstrap: int = field(
        default=1000, metadata={"help": "bootstrap resamples of the intervals (0: none)"}
    )
    model_config: str | None = field(
        default=None, metadata={"help": "model config file (as `arslice eval`)"}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "run the model's own code (as `arslice eval`)"}
    )
    overwrite: bool = field(default=False, metadata={"help": "redo a complete output directory"})

    @property
    def sizes(self) -> ProbeSizes:
        return ProbeSizes(
            induction_length=self.induction_length,
            induction_sequences=self.induction_sequences,
            recall_pairs=tuple(self.recall_pairs),
            recall_queries=self.recall_queries,
        )


def validate_probe(cfg: ProbeConfig) -> None:
    from pipeline.eval.forward import resolve_batch_size

    _ = cfg.spec  # (parsed once: a string that is no model spec is refused here, naming it)
    for flag, value, least in (
        ("--induction-length", cfg.induction_length, 2),
        ("--induction-sequences", cfg.induction_sequences, 1),
        ("--recall-queries", cfg.recall_queries, 1),
        ("--bootstrap", cfg.bootstrap, 0),
        ("--seed", cfg.seed, 0),
    ):
        if value < least:
            raise ArSliceError(f"{flag} {value}: must be at least {least}")
    if not cfg.recall_pairs or min(cfg.recall_pairs) < 1:
        raise ArSliceError(f"--recall-pairs {cfg.recall_pairs}: give one or more k >= 1")
    if len(set(cfg.recall_pairs)) != len(cfg.recall_pairs):
        raise ArSliceError(f"--recall-pairs {cfg.recall_pairs}: each k once")
    resolve_batch_size(cfg.batch_size, "cpu", 1)


def probe_settings(cfg: ProbeConfig) -> dict:
    """What decides the probes' bytes besides the inputs (the batch size does not)."""
    from models.precision import resolve_device, resolve_dtype

    device = resolve_device(cfg.device)
    return {
        "seed": cfg.seed,
        "induction_length": cfg.induction_length,
        "induction_sequences": cfg.induction_sequences,
        "recall_pairs": list(cfg.recall_pairs),
        "recall_queries": cfg.recall_queries,
        "bootstrap": cfg.bootstrap,
        "device": device,
        "dtype": resolve_dtype(cfg.dtype, device),
    }


def probe_inputs(cfg: ProbeConfig) -> list[tuple[str, ...]]:
    model = cfg.spec.path
    return [
        ("--tags", cfg.tags, "dir"),
        ("--losses", cfg.losses, "dir"),
        *([("--model", str(model))] if model is not None else []),
        *([("--model-config", cfg.model_config)] if cfg.model_config else []),
    ]


# ---- what the probes read ----------------------------------------------------------------------


def check_losses_of_tags(losses: Path, meta: dict, tags) -> None:
    """The losses were made on the windows of these tags (their length and number), and with
    the store's tokens."""
    made = (meta.get("window"), meta.get("windows_total"))
    if made != (tags.window, tags.n_windows):
        raise BadInput(
            f"losses {losses}: made on {made[1]} windows of {made[0]} tokens, but tags "
            f"{tags.dir} hold {tags.n_windows} of {tags.window}; give the losses `arslice eval` "
            "wrote on these tags"
        )
    if meta.get("fingerprint") not in (None, tags.store.fingerprint):
        raise BadInput(
            f"losses {losses}: made from a token store of another tokenizer than the tags' "
            f"({tags.store.path}); give the losses `arslice eval` wrote on these tags"
        )


def probe_prefix(losses_meta: dict) -> int | None:
    """The token read before each probe sequence: none with fixed windows (the model read its
    windows without one), the eval's prefix token with rolling ones."""
    if losses_meta.get("windowing", "fixed") != "rolling":
        return None
    prefix = losses_meta.get("prefix_token")
    return None if prefix is None else int(prefix)


def drawable_vocabulary(store, head_rows: int):
    """The probes' ids: the store's tokenizer less its special tokens, capped at the model's
    head; a store without its tokenizer (a raw import): its ids less its EOS."""
    from ar_slicing.analysis.probes import probe_vocabulary, tokenizer_probe_vocabulary
    from ar_slicing.machinery.layout import TOKENIZER_NAME

    if (Path(store.path) / TOKENIZER_NAME).is_file():
        return tokenizer_probe_vocabulary(store.load_tokenizer(), head_rows=head_rows)
    return probe_vocabulary(store.vocab_size, [store.eos_id], head_rows=head_rows)


def token_losses(tags: Path, losses: Path):
    """The tags' `window_id, pos, is_ar_hit` joined with the model's `nll` (a polars frame): the
    windows the model scored (a checkpoint's subset, or every one)."""
    import polars as pl

    tag_parts = sorted(tags.glob(TAG_PART_GLOB))
    loss_parts = sorted(losses.glob(LOSS_PART_GLOB))
    if not loss_parts:
        raise BadInput(f"losses {losses}: no {LOSS_PART_GLOB} files; rerun `arslice eval`")
    keys = ["window_id", "pos"]
    tagged = pl.scan_parquet(tag_parts).select(*keys, "is_ar_hit")
    scored = pl.scan_parquet(loss_parts).select(*keys, "nll")
    return tagged.join(scored, on=keys, how="inner").sort(keys).collect()


# ---- the stage ---------------------------------------------------------------------------------


def run_probe(cfg: ProbeConfig) -> dict:
    """Probe `cfg.model`; write the probes' files and meta.json to `cfg.out`."""
    from ar_slicing.machinery.plan import StagePlan, identity
    from pipeline.eval.inputs import open_tags
    from pipeline.stage import run_stage

    t0 = time.time()
    validate_probe(cfg)
    spec = cfg.spec
    out = Path(cfg.out)
    name = cfg.name or spec.default_name
    tags = open_tags(cfg.tags)
    losses = Path(cfg.losses)
    losses_meta = read_json(
        require_complete(losses, "losses", "run `arslice eval` for this model first")
    )
    check_losses_of_tags(losses, losses_meta, tags)
    plan = StagePlan(
        "probe",
        settings=probe_settings(cfg),
        inputs={
            "model": spec.identity(),
            "tags": identity(tags.dir),
            "losses": identity(losses),
        },
    )
    return run_stage(
        f"probe {name}",
        out,
        plan,
        lambda stage, model: _probe(stage, cfg, name, tags, losses, losses_meta, model, t0),
        overwrite=cfg.overwrite,
        # the model loaded and checked before OUT is made: a bad one leaves nothing behind
        prepare=lambda: _load(cfg, name, tags, plan.settings, probe_prefix(losses_meta)),
        skipped=lambda meta: {"out": str(out), "name": meta.get("name"), "skipped": True},
    )


def _probe(
    stage, cfg: ProbeConfig, name: str, tags, losses: Path, losses_meta: dict, model, t0
) -> Finished:
    from ar_slicing.analysis.probes import (
        icl_positions,
        icl_score,
        induction_curve,
        induction_score,
        induction_table,
        loss_by_position,
        recall_by_distance,
        recall_by_k,
        recall_table,
    )

    out = stage.out
    prefix = probe_prefix(losses_meta)
    loaded, vocab, seqs = model
    score = functools.cache(lambda: _scorer(loaded, cfg, stage.plan["settings"]))

    def induction(files) -> dict:
        table = induction_table(seqs.induction, *score()(seqs.induction.tokens))
        summary = induction_score(table, cfg.bootstrap, cfg.seed)
        write_parquet_atomic(files[0], table)
        write_parquet_atomic(files[1], _one_row(summary))
        write_parquet_atomic(files[2], induction_curve(table))
        # (no interval without resamples: null, not NaN, in the ledger and meta.json)
        plain = {k: None if v != v else v for k, v in summary.items()}
        return {"rows": table.num_rows, **plain}

    def recall(files) -> dict:
        table = recall_table([(part, *score()(part.tokens)) for part in seqs.recall])
        by_k = recall_by_k(table, vocab.head_rows, cfg.bootstrap, cfg.seed)
        write_parquet_atomic(files[0], table)
        write_parquet_atomic(files[1], by_k)
        write_parquet_atomic(files[2], recall_by_distance(table))
        return {
            "rows": table.num_rows,
            "k": by_k["k"].to_list(),
            "accuracy": by_k["accuracy"].to_list(),
        }

    def position(files) -> dict:
        per_token = token_losses(tags.dir, losses)
        if per_token.is_empty():
            raise BadInput(
                f"losses {losses}: no row matches a tag row of {tags.dir}; rerun `arslice eval`"
            )
        icl = icl_score(per_token, tags.window, cfg.bootstrap, cfg.seed)
        write_parquet_atomic(files[0], loss_by_position(per_token))
        write_parquet_atomic(files[1], icl)
        early, late = icl_positions(tags.window)
        return {"tokens": per_token.height, "early": early, "late": late}

    parts = [
        Part(part, tuple(out / f for f in PROBE_FILES[part]), do)
        for part, do in (("induction", induction), ("recall", recall), ("position", position))
    ]
    facts = run_parts(stage, parts, lambda part: part.task(part.files))
    meta = _meta(cfg, name, tags, losses, losses_meta, prefix, facts, loaded, vocab, seqs, t0)
    ind, recall = facts["induction"], facts["recall"]
    interval = (
        f" [{ind['score_lo']:.3f}, {ind['score_hi']:.3f}]" if ind["score_lo"] is not None else ""
    )
    line = (
        f"probe {name}: induction score {ind['score']:.3f} nats{interval}, recall accuracy by k "
        + ", ".join(f"{k}: {a:.2f}" for k, a in zip(recall["k"], recall["accuracy"]))
        + f" -> {out} ({meta['wall_time_s']:.1f} s)"
    )
    return Finished(meta, [line], {"out": str(out), "name": name, "induction_score": ind["score"]})


def _one_row(summary: dict):
    import polars as pl

    return pl.DataFrame([summary])


def _load(cfg: ProbeConfig, name: str, tags, settings: dict, prefix: int | None):
    """The model, its drawable ids and the sequences it reads (checked before any is run)."""
    from ar_slicing.analysis.probes import probe_sequences
    from models import load_model

    loaded = load_model(
        cfg.spec,
        device=settings["device"],
        model_config=cfg.model_config,
        trust_remote_code=cfg.trust_remote_code,
    )
    vocab = drawable_vocabulary(tags.store, loaded.vocab_size)
    seqs = probe_sequences(vocab, cfg.sizes, cfg.seed, prefix)
    longest = cfg.sizes.longest_input(prefix is not None)
    if loaded.max_positions is not None and longest > loaded.max_positions:
        raise BadInput(
            f"probe {name}: the longest probe sequence reads {longest} tokens, but {cfg.model} "
            f"accepts at most {loaded.max_positions}; lower induction_length or the largest k"
        )
    return loaded, vocab, seqs


def _scorer(loaded, cfg: ProbeConfig, settings: dict):
    import functools

    from pipeline.eval.forward import score_rows

    return functools.partial(
        score_rows,
        loaded,
        device=settings["device"],
        dtype=settings["dtype"],
        batch_size=cfg.batch_size,
    )


def _meta(cfg, name, tags, losses, losses_meta, prefix, facts, loaded, vocab, seqs, t0) -> dict:
    along = {k: losses_meta.get(k) for k in ("checkpoint_of", "step", "tokens_seen")}
    ind = facts["induction"]
    return build_meta(
        "probe",
        config=cfg,
        inputs={
            "model": cfg.model,
            "tags": str(tags.dir.resolve()),
            "losses": str(losses.resolve()),
        },
        counts={
            "induction_rows": ind["rows"],
            "recall_rows": facts["recall"]["rows"],
            "position_tokens": facts["position"]["tokens"],
            "tokens_read": cfg.sizes.tokens_read(prefix is not None),
        },
        wall_time_s=time.time() - t0,
        name=name,
        spec=cfg.model,
        **{k: v for k, v in along.items() if v is not None},
        prefix_token=prefix,
        window=tags.window,
        icl_positions=[facts["position"]["early"], facts["position"]["late"]],
        head_rows=vocab.head_rows,
        drawable_ids=int(vocab.ids.size),
        vocabulary_digest=vocab.digest,
        sequences_digest=seqs.digest,
        induction_score={k: ind[k] for k in ("score", "score_lo", "score_hi", "second_accuracy")},
        recall_accuracy=dict(zip(map(str, facts["recall"]["k"]), facts["recall"]["accuracy"])),
        files=[f for names in PROBE_FILES.values() for f in names],
    )


# ---- the stage in a pipeline config ------------------------------------------------------------


def probed_models(f: Fanned) -> list[Table]:
    """One table per model the eval stage evaluates (its checkpoints included), in its order:
    the model's spec and loader keys from the eval table, then `[probe]`'s own keys."""
    from pipeline.eval.checkpoints import CHECKPOINT_KEYS
    from pipeline.eval.wiring import evaluated_models

    table = f.config.get("eval", {})
    values = {k: v for k, v in table.items() if k not in CHECKPOINT_KEYS}
    if f.values.get("models") is not None:
        raise BadInput(
            f"{f.path} [{f.table}]: the probed models are the eval stage's; name a model in "
            "[eval.models.<name>], not [probe.models]"
        )
    evaluated = evaluated_models(Fanned(f.config, f.path, f.layout, "eval", values))
    tables = []
    for t in evaluated:
        own = {k: t.values[k] for k in EVAL_KEYS if k in t.values}
        tables.append(Table(t.name, {**own, **f.values}, f"[{f.table}] {t.name}"))
    return tables


def eval_hub_names(cfg: ProbeConfig, where: str) -> list[tuple[str, str, str]]:
    """The model a probe would fetch from the hub: the eval's own answer (imported here, so that
    `arslice --help` does not load the eval stage)."""
    from pipeline.eval.wiring import eval_hub_names as of_eval

    return of_eval(cfg, where)


def sizes_for_window(window: int) -> dict:
    """The probes' default sizes in a run of windows of `window` tokens: the library's
    (`ProbeSizes`: n = 64, k up to 32, for the demo's 256), each body at most half a window
    (n <= L/4, k <= L/8), so every model that reads the run's windows reads the probes.

    >>> sizes_for_window(256)["induction_length"], sizes_for_window(32)
    (64, {'induction_length': 8, 'recall_pairs': [1, 2, 4]})
    """
    pairs = [k for k in _DEFAULT.recall_pairs if 8 * k <= window] or [1]
    return {
        "induction_length": max(2, min(_DEFAULT.induction_length, window // 4)),
        "recall_pairs": pairs,
    }


def defaults(run: Run, table: Table) -> dict:
    from pipeline.tag import TagConfig

    window = run.config.get("tag", {}).get(
        "window", TagConfig.__dataclass_fields__["window"].default
    )
    return {
        "tags": run.layout.tags,
        "losses": run.layout.losses(table.name),
        "out": run.layout.probes(table.name),
        "name": table.name,
        **(sizes_for_window(window) if isinstance(window, int) and window > 0 else {}),
    }


def probes_entry(name: str, out: Path, meta: dict) -> dict:
    """A probed model (or checkpoint: its model and step) in `probes/meta.json`."""
    entry = {"dir": str(out), "spec": meta.get("spec")}
    entry.update({k: meta[k] for k in ("checkpoint_of", "step", "tokens_seen") if k in meta})
    return entry


COMMAND = Command(
    ProbeConfig,
    run_probe,
    validate=validate_probe,
    plan_settings=probe_settings,
    inputs=probe_inputs,
    summary="induction score, zero-shot recall and loss by position of one model",
    description=(
        "The probes of docs/design.md's 'Probes of a checkpoint': the induction score on "
        "repeated random tokens, zero-shot key-value recall by k and distance, and the loss by "
        "window position per slice with the in-context learning score, from the model's losses."
    ),
    examples="""\
  arslice probe --model native:runs/demo/models/transformer_pp --tags runs/demo/tags --losses runs/demo/losses/transformer_pp --out runs/demo/probes/transformer_pp
  arslice probe --model hf:EleutherAI/pythia-160m --tags runs/pile/tags --losses runs/pile/losses/pythia-160m --out runs/pile/probes/pythia-160m --recall-pairs 1 4 16 64  # needs the hub""",
    hub_names=eval_hub_names,
    pipeline=Wiring(
        table="probe",
        reads=(TAGS, MODELS, LOSSES),
        writes=PROBES,
        fan_out=probed_models,
        defaults=defaults,
        entry=probes_entry,
    ),
)

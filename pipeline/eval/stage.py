"""`arslice eval` as a stage: plan, resume, run the chunks (locally or on Ray), write meta.json.

A checkpoint along a model's training (`--checkpoint-of NAME`) is evaluated as any model, into
a losses folder of its own; its plan also records its step and the tokens it had seen, and the
window subset it was scored on (`--window-subset N`, evenly strided:
`ar_slicing.algorithms.windows.window_subset`), so another subset is a changed setting."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import build_meta
from ar_slicing.machinery.plan.stage_parts import Part, StageParts
from models.kernels import paths_taken
from models.precision import resolve_device, resolve_dtype, resolve_on_cluster, weights_dtype
from pipeline.config import Command, say
from pipeline.eval.checkpoints import CHECKPOINT_KEYS
from pipeline.eval.checks import check_model_fits
from pipeline.eval.config import EvalConfig
from pipeline.eval.forward import resolve_batch_size
from pipeline.eval.inputs import (
    TagsInput,
    chunk_bounds,
    open_tags,
    window_runs,
)
from pipeline.eval.output import ChunkEvaluator, chunk_path
from pipeline.eval.wiring import defaults, eval_hub_names, evaluated_models, losses_entry
from pipeline.stage import Finished
from pipeline.wiring import LOSSES, MODELS, TAGS, Wiring

log = logging.getLogger(__name__)


def validate_eval(cfg: EvalConfig) -> None:
    _ = cfg.spec  # (parsed once: a string that is no model spec is refused here, naming it)
    if cfg.chunk_windows < 1:
        raise ArSliceError(f"--chunk-windows {cfg.chunk_windows}: must be at least 1")
    if cfg.max_windows is not None and cfg.max_windows < 1:
        raise ArSliceError(f"--max-windows {cfg.max_windows}: must be at least 1")
    if cfg.prefix_token is not None and cfg.windowing != "rolling":
        raise ArSliceError("--prefix-token applies to --windowing rolling only")
    if cfg.harness_bos and cfg.windowing != "rolling":
        raise ArSliceError("--harness-bos applies to --windowing rolling only")
    if cfg.ray_actors < 0:
        raise ArSliceError(f"--ray-actors {cfg.ray_actors}: must be 0 (one per GPU) or more")
    resolve_batch_size(cfg.batch_size, "cpu", 1)  # refuses what is neither a number nor auto
    validate_checkpoint(cfg)


def validate_checkpoint(cfg: EvalConfig) -> None:
    """--step, --tokens-seen and --window-subset describe a checkpoint (--checkpoint-of)."""
    if cfg.checkpoint_of is None:
        given = [
            f"--{k.replace('_', '-')}"
            for k in ("step", "tokens_seen", "window_subset")
            if getattr(cfg, k) is not None
        ]
        if given:
            raise ArSliceError(
                f"{' and '.join(given)} describe a training checkpoint: add --checkpoint-of "
                "MODEL (a model of Table 1 is scored on every window)"
            )
        return
    if not cfg.checkpoint_of or "/" in cfg.checkpoint_of:
        raise ArSliceError(
            f"--checkpoint-of {cfg.checkpoint_of!r}: the name of a model of the run (its "
            "losses folder), such as attention or pythia-160m"
        )
    for flag, value, least in (
        ("--step", cfg.step, 0),
        ("--tokens-seen", cfg.tokens_seen, 0),
        ("--window-subset", cfg.window_subset, 1),
    ):
        if value is not None and value < least:
            raise ArSliceError(f"{flag} {value}: must be at least {least}")


def checkpoint_point(cfg: EvalConfig) -> dict | None:
    """Where the checkpoint `cfg` evaluates stands along training, `{"of", "step",
    "tokens_seen"}`: what the config gives, else what a native checkpoint's meta.json records;
    None without --checkpoint-of, or while a value is still unknown (a checkpoint not trained
    yet)."""
    if cfg.checkpoint_of is None:
        return None
    step, tokens = cfg.step, cfg.tokens_seen
    if step is None or tokens is None:
        recorded = native_training_point(cfg.model) or {}
        step = recorded.get("step") if step is None else step
        tokens = recorded.get("tokens_seen") if tokens is None else tokens
    if step is None or tokens is None:
        return None
    return {"of": cfg.checkpoint_of, "step": int(step), "tokens_seen": int(tokens)}


def native_training_point(spec: str) -> dict | None:
    """{"step", "tokens_seen"} a `native:` model (a trained model or a checkpoint it kept)
    records, else None."""
    from models.checkpoints.native import training_point
    from models.checkpoints.registry import ModelSpec

    parsed = ModelSpec.parse(spec)
    return training_point(parsed.path) if parsed.prefix == "native" else None


def eval_inputs(cfg: EvalConfig) -> list[tuple[str, str]]:
    """What the evaluation reads: the tags, the store (when given), the checkpoint when it is a
    local one, and its model config."""
    model = cfg.spec.path
    return [
        ("--tags", cfg.tags, "dir"),
        *([("--tokens", cfg.tokens, "dir")] if cfg.tokens else []),
        *([("--model", str(model))] if model is not None else []),
        *([("--model-config", cfg.model_config)] if cfg.model_config else []),
    ]


def eval_settings(cfg: EvalConfig, device: str | None = None, dtype: str | None = None) -> dict:
    """What decides the loss files' bytes besides the inputs. Without `device`/`dtype` they are
    resolved here as a local run would (a Ray run resolves them on the cluster: None here)."""
    if device is None and cfg.executor == "local":
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
    settings = {
        "spec": cfg.model,
        "windowing": cfg.windowing,
        "fast_path": cfg.fast_path,
        "chunk_windows": cfg.chunk_windows,
        "device": device,
        "dtype": dtype,
    }
    if cfg.model_config is not None:  # it decides what a zoology:/safari:/based: model computes
        settings["model_config"] = model_config_identity(cfg.model_config)
    if cfg.windowing == "rolling":  # None: the harness's rule over the model's tokenizer
        settings["prefix_token"] = cfg.prefix_token
    if cfg.kernels != "auto":  # (likewise: recorded only when a path is insisted on)
        settings["kernels"] = cfg.kernels
    if cfg.harness_bos:  # recorded only when set, so earlier rolling plans stay the same
        settings["harness_bos"] = True
    if cfg.trust_remote_code:  # (likewise) the model's own code computed the losses
        settings["trust_remote_code"] = True
    if cfg.checkpoint_of is not None:  # (likewise: a model's plan stays as it was)
        # None while a checkpoint still to be trained says nothing: not compared before a run
        settings["checkpoint"] = checkpoint_point(cfg)
    if cfg.window_subset is not None:
        settings["window_subset"] = cfg.window_subset
    return settings


def rolling_prefix(cfg: EvalConfig, loaded, store) -> tuple[int, str]:
    """The token before each document in rolling windows and where it came from: lm-eval's
    prefix_token_id over the model's tokenizer (its BOS, else its EOS; the store's EOS when the
    model's tokenizer declares neither), or --prefix-token."""
    from ar_slicing.algorithms.rolling import prefix_token
    from ar_slicing.data.tokenizer import special_token_ids

    declared = special_token_ids(loaded.tokenizer_source) if loaded.tokenizer_source else {}
    eos = declared.get("eos_token_id")
    token, what = prefix_token(
        cfg.prefix_token, declared.get("bos_token_id"), store.eos_id if eos is None else eos
    )
    if what == "--prefix-token":
        return token, what
    if what == "EOS" and eos is None:
        return token, "the store's EOS: the model's tokenizer declares no BOS"
    return token, f"the model tokenizer's {what}"


def harness_lead(cfg: EvalConfig, loaded) -> tuple[tuple[int, ...], str | None]:
    """The tokens read between the prefix and each document with --harness-bos (what the model
    tokenizer's `encode` puts before a text, as lm-eval's tok_encode keeps them), and a line
    saying so; () without --harness-bos."""
    from ar_slicing.data.tokenizer import special_token_ids

    if not cfg.harness_bos:
        return (), None
    declared = special_token_ids(loaded.tokenizer_source) if loaded.tokenizer_source else {}
    if "encode_prefix" not in declared:
        raise ArSliceError(
            f"--harness-bos: no transformers tokenizer found with {cfg.model} (looked in "
            f"{loaded.tokenizer_source}), so what its encode adds is unknown; without one, use "
            "--windowing rolling alone (or --prefix-token)"
        )
    lead, suffix = declared["encode_prefix"], declared["encode_suffix"]
    if lead is None or suffix:
        raise ArSliceError(
            f"--harness-bos: the tokenizer of {cfg.model} ({loaded.tokenizer_source}) "
            + ("appends " + str(suffix) if suffix else "encodes a text differently")
            + " with its special tokens; only tokens added before the text (BOS) are implemented"
        )
    if not lead:
        return (), "--harness-bos: the model's tokenizer adds no BOS, so the harness reads none"
    return tuple(int(t) for t in lead), f"--harness-bos: then {lead}, as the tokenizer adds it"


def model_config_identity(path: str) -> dict:
    """What the plan records of a --model-config file: its path and its bytes' sha256."""
    import hashlib

    p = Path(path)
    if not p.is_file():
        raise ArSliceError(f"--model-config {path}: no such file")
    return {"path": str(p.resolve()), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}


def describe_settings(settings: dict) -> str:
    """One line a person reads: the loader's scalar settings and where they came from."""
    values = ", ".join(
        f"{k}={v}" for k, v in settings.items() if k != "config" and not isinstance(v, dict)
    )
    source = settings.get("config")
    return f"model settings {values}" + (f" (from {source})" if source else "")


@dataclass(frozen=True)
class EvalRun:
    """What an evaluation resolved before it writes anything: the model loaded and checked
    against the windows, where and how it runs, and the rolling windows' prefix."""

    cfg: EvalConfig
    name: str
    tags: TagsInput
    windows: Any  # (n,) int64: the ids of the windows evaluated, increasing
    selected: int  # the windows of the selection (all, or --window-subset's)
    loaded: Any  # models.LoadedModel (with Ray: loaded here for the checks and meta.json)
    executor: Any  # None: this process; else the Ray executor whose actors load their own
    device: str
    dtype: str
    batch_size: int
    prefix: int | None  # the token read before each document (rolling windows)
    prefix_source: str | None
    lead: tuple[int, ...]  # read after the prefix (--harness-bos)
    t0: float

    @property
    def n_windows(self) -> int:
        """The windows evaluated: the selection's, or its first --max-windows."""
        return len(self.windows)

    @property
    def partial(self) -> bool:
        """Cut short by --max-windows (a window subset alone is not partial)."""
        return self.n_windows < self.selected

    @property
    def point(self) -> dict | None:
        """Where the model stands along training: a checkpoint's point, or the final model's
        step and tokens when this project trained it (None otherwise)."""
        point = checkpoint_point(self.cfg)
        if point is not None:
            return point
        return native_training_point(self.cfg.model)

    def evaluator(self) -> ChunkEvaluator:
        """The chunk evaluator of a local run (holding this process's model and tags)."""
        return ChunkEvaluator(
            self.cfg, self.device, self.dtype, self.batch_size,
            loaded=self.loaded, tags=self.tags, prefix=self.prefix, lead=self.lead,
        )  # fmt: skip

    def actor_evaluator(self):
        """What each Ray actor builds its own evaluator from (it loads its own model and tags)."""
        return functools.partial(
            ChunkEvaluator, self.cfg, self.device, self.dtype, self.batch_size,
            prefix=self.prefix, lead=self.lead,
        )  # fmt: skip


def _device_and_dtype(cfg: EvalConfig):
    """(executor, device, dtype): this process's, or, with Ray, the actors' (CUDA when the
    cluster has GPUs; `auto` dtype resolved on one of them; CPU actors get this machine's
    choice, as a local run)."""
    if cfg.executor == "local":
        device = resolve_device(cfg.device)
        return None, device, resolve_dtype(cfg.dtype, device)
    from ar_slicing.machinery.executor import get_executor

    executor = get_executor(cfg.executor, address=cfg.ray_address)
    device = cfg.device if cfg.device != "auto" else "cuda" if executor.cluster_gpus else "cpu"
    return executor, device, resolve_on_cluster(executor, cfg.dtype, device)


def _resolve(cfg, name, tags, windows, selected, executor, device, dtype, t0) -> EvalRun:
    """Load the model (on this process's device, or the CPU when Ray actors run it) and check
    it against the windows: before OUT is made, so a bad spec or a model that does not fit
    leaves nothing behind."""
    from models import load_model

    loaded = load_model(
        cfg.spec,
        device=device if executor is None else "cpu",
        fast_path=cfg.fast_path,
        model_config=cfg.model_config,
        trust_remote_code=cfg.trust_remote_code,
    )
    if loaded.settings:
        say(f"eval {name}: {describe_settings(loaded.settings)}")
    prefix = prefix_source = None
    lead, lead_source = harness_lead(cfg, loaded)
    if cfg.windowing == "rolling":
        prefix, prefix_source = rolling_prefix(cfg, loaded, tags.store)
        say(f"eval {name}: each document read after token {prefix} ({prefix_source})")
    if lead_source:
        say(f"eval {name}: {lead_source}")
    check_model_fits(loaded, tags, int(windows[-1]) + 1 if len(windows) else 0, cfg, prefix)
    batch_size = resolve_batch_size(cfg.batch_size, device, tags.window)
    return EvalRun(
        cfg, name, tags, windows, selected, loaded, executor, device, dtype, batch_size,
        prefix, prefix_source, lead, t0,
    )  # fmt: skip


def run_eval(cfg: EvalConfig) -> dict:
    """Evaluate `cfg.model` on the windows of `cfg.tags`; write losses and meta.json to `cfg.out`."""
    from ar_slicing.algorithms.windows import window_subset
    from ar_slicing.machinery.plan import StagePlan, identity
    from pipeline.stage import run_stage

    t0 = time.time()
    validate_eval(cfg)
    spec = cfg.spec
    out = Path(cfg.out)
    name = cfg.name or spec.default_name
    if cfg.checkpoint_of is not None and checkpoint_point(cfg) is None:
        raise ArSliceError(
            f"eval {name}: checkpoint {cfg.model} records no training step and tokens seen; "
            "give --step and --tokens-seen"
        )
    tags = open_tags(cfg.tags, cfg.tokens)
    selection = window_subset(tags.n_windows, cfg.window_subset)
    windows = selection[: cfg.max_windows]  # (the first --max-windows of them: a partial run)
    n_windows = len(windows)
    executor, device, dtype = _device_and_dtype(cfg)
    plan = StagePlan(
        "eval",
        settings=eval_settings(cfg, device, dtype),
        inputs={
            # the windows are all a loss depends on: re-tagging with another threshold keeps them
            "tokens": identity(tags.store.path),
            "windows": {"window": tags.window, "n_windows": tags.n_windows},
            "model": spec.identity(),
        },
    )
    return run_stage(
        f"eval {name}",
        out,
        plan,
        _evaluate,
        overwrite=cfg.overwrite,
        prepare=lambda: _resolve(
            cfg, name, tags, windows, len(selection), executor, device, dtype, t0
        ),
        # a partial (--max-windows) result, now asked for more windows: its chunks kept
        reopen_if=lambda meta: (
            bool(meta.get("partial")) and n_windows > int(meta.get("windows_evaluated", 0))
        ),
        detail=lambda meta: f"{meta.get('tokens')} tokens",
        skipped=lambda meta: {
            "out": str(out),
            "name": meta.get("name"),
            "tokens": meta.get("tokens"),
            "skipped": True,
        },
    )


def _evaluate(stage, run: EvalRun) -> Finished:
    """Compute the chunks the ledger does not hold, recording each; what meta.json records."""
    out, tags = stage.out, run.tags
    # chunk c holds the evaluated windows run.windows[i0:i1], as runs of consecutive windows
    chunks = chunk_bounds(run.n_windows, run.cfg.chunk_windows)
    runs = [window_runs(run.windows[i0:i1]) for i0, i1 in chunks]
    subset = run.cfg.window_subset is not None
    chunk_rows = [sum(int(tags.n_targets[w0:w1].sum()) for w0, w1 in r) for r in runs]
    parts = StageParts(
        stage,
        [
            Part(chunk_part(i0, i1, subset), (chunk_path(out, c),), (c, runs[c]))
            for c, (i0, i1) in enumerate(chunks)
        ],
    )
    todo = [part.task[0] for part in parts.todo]
    if len(chunks) > len(todo):
        log.info(
            "resuming %s: %d of %d chunks already done", out, len(chunks) - len(todo), len(chunks)
        )
    windows_done = run.n_windows - sum(chunks[c][1] - chunks[c][0] for c in todo)
    totals = _run_chunks(parts, run, chunks, sum(chunk_rows[c] for c in todo), windows_done)
    meta = _eval_meta(stage, run, chunks, todo, totals)
    rate = f"{totals['tokens_per_s']:,.0f} tokens/s" if todo else "all chunks reused"
    line = (
        f"eval {run.name}: {meta['tokens']:,} losses over {run.n_windows:,} windows"
        f"{' (partial)' if run.partial else ''} -> {out} ({rate}, {meta['wall_time_s']:.1f} s)"
    )
    result = {"out": str(out), "name": run.name, "tokens": meta["tokens"]}
    return Finished(meta, [line], {**result, "tokens_per_s": totals["tokens_per_s"]})


def chunk_part(i0: int, i1: int, subset: bool = False) -> str:
    """The ledger's name of the chunk of the evaluated windows i0..i1-1: windows i0..i1-1
    themselves, or the i0-th to (i1-1)-th of a window subset (the last chunk of a partial run and
    the same chunk of a longer one share a file, not a part)."""
    return f"{'subset ' if subset else ''}windows {i0}-{i1}"


def _run_chunks(parts: StageParts, run: EvalRun, chunks, rows: int, windows_done: int) -> dict:
    """Evaluate the chunks left (`parts.todo`, each task (chunk, its runs of windows)) here or
    on the Ray actors, recording each chunk in the ledger as its file arrives; returns the totals
    meta.json records."""
    from tqdm import tqdm

    tasks = [part.task for part in parts.todo]
    scored = read = backoffs = 0
    batch_size, t_compute, warmup_s = run.batch_size, 0.0, 0.0
    kernels: dict = {}  # {fused op: the paths it took}, over every evaluator
    bar = tqdm(total=rows, unit="tok", unit_scale=True, desc=f"eval {run.name}", dynamic_ncols=True)
    t_loop = time.time()
    if run.executor is None:
        evaluator = run.evaluator()
        warmup_s = evaluator.warmup_s
        results = evaluator.run_all(tasks, bar.update)
    else:
        results = run.executor.map_actors(
            run.actor_evaluator(),
            tasks,
            n_actors=run.cfg.ray_actors or None,
            num_gpus=1 if run.device == "cuda" else 0,  # one GPU per actor; none on CPUs
        )
    try:
        for part, result in parts.record_each(
            parts.of_tasks(results), lambda r: {"rows": r["rows"]}
        ):
            c = part.task[0]
            if run.executor is not None:
                bar.update(result["rows"])
            read += result["read"]
            t_compute += result["seconds"]
            batch_size = min(batch_size, result["batch_size"])
            backoffs = max(backoffs, result["backoffs"])  # each evaluator counts its own
            scored += result["rows"]
            for op, paths in result["kernels"].items():
                kernels.setdefault(op, set()).update(paths)
            windows_done += chunks[c][1] - chunks[c][0]
            bar.set_postfix_str(f"windows {windows_done}/{run.n_windows}")
    finally:
        bar.close()
    if run.executor is not None:  # actors work side by side: the rate is the whole loop's
        t_compute = time.time() - t_loop if tasks else 0.0
    return {
        "read": read,
        "backoffs": backoffs,
        "batch_size": batch_size,
        "tokens_per_s": scored / t_compute if t_compute > 0 else 0.0,
        "kernels": kernels,
        "warmup_s": warmup_s,
    }


def _eval_meta(stage, run: EvalRun, chunks, todo, totals: dict) -> dict:
    cfg, tags, loaded = run.cfg, run.tags, run.loaded
    total_rows = int(tags.n_targets[run.windows].sum())
    # a checkpoint's place along training (a trained final model's too), and its window subset:
    # recorded only when there are some, so other models' meta.json stay as they were
    along = {
        "checkpoint_of": cfg.checkpoint_of,
        "window_subset": cfg.window_subset,
        **(run.point or {}),
    }
    along.pop("of", None)
    skipped = {"windows_beyond_max_windows": run.selected - run.n_windows}
    if cfg.window_subset is not None:
        skipped["windows_outside_the_subset"] = tags.n_windows - run.selected
    return build_meta(
        "eval",
        config=cfg,
        inputs={
            "tags": str(tags.dir.resolve()),
            "tags_meta": {
                k: tags.meta.get(k) for k in ("git_hash", "created_at", "window", "threshold")
            },
            "tokens": str(Path(tags.store.path).resolve()),
            "model": cfg.model,
        },
        counts={
            "windows": run.n_windows,
            "rows": total_rows,
            "chunks": len(chunks),
            "chunks_computed": len(todo),
            "chunks_reused": len(chunks) - len(todo),
            "input_tokens_read": totals["read"],
            "oom_backoffs": totals["backoffs"],
        },
        skipped=skipped,
        wall_time_s=time.time() - run.t0,
        throughput={"tokens_per_s": totals["tokens_per_s"]},
        name=run.name,
        spec=cfg.model,
        hub_commit=loaded.hub_commit,
        architecture=loaded.architecture,
        n_params=int(loaded.n_params),
        dtype=run.dtype,
        device=run.device,
        batch_size=totals["batch_size"],
        batch_size_requested=str(cfg.batch_size),
        tokens=total_rows,
        tokens_store=str(Path(tags.store.path).resolve()),
        tokens_per_s=totals["tokens_per_s"],
        fingerprint=tags.store.fingerprint,
        model_tokenizer_fingerprint=getattr(loaded, "tokenizer_fingerprint", None),
        model_config=stage.plan["settings"].get("model_config"),
        loader_settings=loaded.settings,
        # the path each fused op of the recurrences took (models/kernels), and the dtype the
        # linear layers' weights were held in (models.precision.weights_dtype)
        kernels=paths_taken(totals["kernels"]),
        kernels_requested=cfg.kernels,
        weights_dtype=weights_dtype(run.device, run.dtype),
        warmup_s=totals["warmup_s"],
        skip_tokenizer_check=cfg.skip_tokenizer_check,
        windowing=cfg.windowing,
        prefix_token=run.prefix,
        prefix_token_source=run.prefix_source,
        harness_bos=list(run.lead) if cfg.harness_bos else None,
        window=tags.window,
        partial=run.partial,
        windows_evaluated=run.n_windows,
        windows_total=tags.n_windows,
        **{k: v for k, v in along.items() if v is not None},
        files=[chunk_path(stage.out, c).name for c in range(len(chunks))],
    )


COMMAND = Command(
    EvalConfig,
    run_eval,
    validate=validate_eval,
    plan_settings=eval_settings,
    inputs=eval_inputs,
    summary="per-token losses of one model over the tagged windows",
    examples="""\
  arslice eval --model hf:EleutherAI/pythia-160m --tags runs/pile/tags --out runs/pile/losses/pythia-160m  # needs the hub
  arslice eval --model native:runs/demo/models/transformer_pp --tags runs/demo/tags --out runs/demo/losses/transformer_pp
  arslice eval --model hf:RWKV/rwkv-4-169m-pile --tags runs/pile/tags --out runs/pile/losses/rwkv --dtype fp32  # needs the hub
  arslice eval --model hf:./pythia-70m --tags runs/pile/tags --out smoke --max-windows 8 --device cpu
  arslice eval --model hf:EleutherAI/pythia-160m --tags runs/pile/tags --out runs/pile/losses/pythia-rolling --windowing rolling  # needs the hub
  arslice eval --model hf:EleutherAI/pythia-160m@step3000 --tags runs/pile/tags --out runs/pile/losses/pythia-160m-step3000  # needs the hub
  arslice eval --model hf:EleutherAI/pythia-160m@step3000 --checkpoint-of pythia-160m --step 3000 --tokens-seen 6291456000 --window-subset 4096 --tags runs/pile/tags --out runs/pile/losses/pythia-160m@step3000  # needs the hub
  arslice eval --model hf:meta-llama/Llama-2-7b-hf --tags runs/llama/tags --out runs/llama/losses/llama-harness --windowing rolling --harness-bos  # needs the hub
  arslice eval --model safari:hyena-small-150b-tok.ckpt --model-config safari/configs/evals/hyena_small_150b.yaml --tags runs/pile/tags --out runs/pile/losses/hyena  # needs a published checkpoint""",
    hub_names=eval_hub_names,
    pipeline=Wiring(
        table="eval",
        reads=(TAGS, MODELS),
        writes=LOSSES,
        fan_out=evaluated_models,
        defaults=defaults,
        pipeline_keys=CHECKPOINT_KEYS,
        entry=losses_entry,
    ),
)

"""`arslice eval` as a stage: plan, resume, run the chunks (locally or on Ray), write meta.json."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from ar_slicing.io import build_meta
from models.precision import resolve_device, resolve_dtype, resolve_on_cluster
from pipeline.config import Command, say
from pipeline.eval.checks import check_model_fits
from pipeline.eval.config import EvalConfig
from pipeline.eval.forward import resolve_batch_size
from pipeline.eval.inputs import TagsInput, chunk_bounds, model_name_from_spec, open_tags
from pipeline.eval.output import ChunkEvaluator, chunk_path
from pipeline.eval.wiring import defaults, eval_hub_names, evaluated_models, losses_entry
from pipeline.wiring import LOSSES, MODELS, TAGS, Wiring

log = logging.getLogger(__name__)


def validate_eval(cfg: EvalConfig) -> None:
    from models.checkpoints.registry import parse_spec

    parse_spec(cfg.model)
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


def eval_inputs(cfg: EvalConfig) -> list[tuple[str, str]]:
    """What the evaluation reads: the tags, the store (when given), the checkpoint when it is a
    local one, and its model config."""
    from models.checkpoints.registry import spec_path

    model = spec_path(cfg.model)
    return [
        ("--tags", cfg.tags),
        *([("--tokens", cfg.tokens)] if cfg.tokens else []),
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
    if cfg.harness_bos:  # recorded only when set, so earlier rolling plans stay the same
        settings["harness_bos"] = True
    return settings


def rolling_prefix(cfg: EvalConfig, loaded, store) -> tuple[int, str]:
    """The token before each document in rolling windows and where it came from: lm-eval's
    prefix_token_id over the model's tokenizer (its BOS, else its EOS; the store's EOS when the
    model's tokenizer declares neither), or --prefix-token."""
    from ar_slicing.rolling import prefix_token
    from ar_slicing.tokenizer import special_token_ids

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
    from ar_slicing.tokenizer import special_token_ids

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
    n_windows: int  # the windows evaluated (all, or the first --max-windows)
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
    def partial(self) -> bool:
        return self.n_windows < self.tags.n_windows

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
    from ar_slicing.executor import get_executor

    executor = get_executor(cfg.executor, address=cfg.ray_address)
    device = cfg.device if cfg.device != "auto" else "cuda" if executor.cluster_gpus else "cpu"
    return executor, device, resolve_on_cluster(executor, cfg.dtype, device)


def _resolve(cfg, name, tags, n_windows, executor, device, dtype, t0) -> EvalRun:
    """Load the model (on this process's device, or the CPU when Ray actors run it) and check
    it against the windows: before OUT is made, so a bad spec or a model that does not fit
    leaves nothing behind."""
    from models import load_model

    loaded = load_model(
        cfg.model,
        device=device if executor is None else "cpu",
        fast_path=cfg.fast_path,
        model_config=cfg.model_config,
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
    check_model_fits(loaded, tags, n_windows, cfg, prefix)
    batch_size = resolve_batch_size(cfg.batch_size, device, tags.window)
    return EvalRun(
        cfg, name, tags, n_windows, loaded, executor, device, dtype, batch_size,
        prefix, prefix_source, lead, t0,
    )  # fmt: skip


def run_eval(cfg: EvalConfig) -> dict:
    """Evaluate `cfg.model` on the windows of `cfg.tags`; write losses and meta.json to `cfg.out`."""
    from ar_slicing.plan import StagePlan, identity, open_stage
    from models.checkpoints.registry import spec_identity

    t0 = time.time()
    validate_eval(cfg)
    out = Path(cfg.out)
    name = cfg.name or model_name_from_spec(cfg.model)
    tags = open_tags(cfg.tags, cfg.tokens)
    n_windows = tags.n_windows if cfg.max_windows is None else min(cfg.max_windows, tags.n_windows)
    executor, device, dtype = _device_and_dtype(cfg)
    plan = StagePlan(
        "eval",
        settings=eval_settings(cfg, device, dtype),
        inputs={
            # the windows are all a loss depends on: re-tagging with another threshold keeps them
            "tokens": identity(tags.store.path),
            "windows": {"window": tags.window, "n_windows": tags.n_windows},
            "model": spec_identity(cfg.model),
        },
    )
    stage = open_stage(out, plan, overwrite=cfg.overwrite)
    extend = False
    if stage.complete:
        meta = stage.meta
        if not (meta.get("partial") and n_windows > int(meta.get("windows_evaluated", 0))):
            stage.skip()
            say(f"eval {name}: {out} is already complete ({meta.get('tokens')} tokens); skipped")
            return {
                "out": str(out),
                "name": meta.get("name"),
                "tokens": meta.get("tokens"),
                "skipped": True,
            }
        extend = True  # a partial (--max-windows) result, now asked for more windows
    try:
        run = _resolve(cfg, name, tags, n_windows, executor, device, dtype, t0)
    except BaseException:
        stage.release()  # (an existing OUT is locked from the plan check on)
        raise
    with stage.running():
        if extend:
            stage.reopen()  # incomplete again until its meta.json is rewritten, its chunks kept
        return _evaluate(stage, run)


def _evaluate(stage, run: EvalRun) -> dict:
    """Compute the chunks the ledger does not hold, record each, and write meta.json."""
    out, tags = stage.out, run.tags
    chunks = chunk_bounds(run.n_windows, run.cfg.chunk_windows)
    chunk_rows = [int(tags.n_targets[w0:w1].sum()) for w0, w1 in chunks]
    todo = [c for c in range(len(chunks)) if stage.done(chunk_part(*chunks[c])) is None]
    if len(chunks) > len(todo):
        log.info(
            "resuming %s: %d of %d chunks already done", out, len(chunks) - len(todo), len(chunks)
        )
    tasks = [(c, *chunks[c]) for c in todo]
    windows_done = run.n_windows - sum(w1 - w0 for _, w0, w1 in tasks)
    totals = _run_chunks(stage, run, tasks, sum(chunk_rows[c] for c in todo), windows_done)
    meta = stage.finish(_eval_meta(stage, run, chunks, todo, totals))
    rate = f"{totals['tokens_per_s']:,.0f} tokens/s" if todo else "all chunks reused"
    say(
        f"eval {run.name}: {meta['tokens']:,} losses over {run.n_windows:,} windows"
        f"{' (partial)' if run.partial else ''} -> {out} ({rate}, {meta['wall_time_s']:.1f} s)"
    )
    return {
        "out": str(out),
        "name": run.name,
        "tokens": meta["tokens"],
        "tokens_per_s": totals["tokens_per_s"],
    }


def chunk_part(w0: int, w1: int) -> str:
    """The ledger's name of the chunk of windows w0..w1-1 (the last chunk of a partial run and
    the same chunk of a longer one share a file, not a part)."""
    return f"windows {w0}-{w1}"


def _run_chunks(stage, run: EvalRun, tasks, rows: int, windows_done: int) -> dict:
    """Evaluate `tasks` ((chunk, w0, w1)) here or on the Ray actors, recording each chunk in the
    ledger as its file arrives; returns the totals meta.json records."""
    from tqdm import tqdm

    scored = read = backoffs = 0
    batch_size, t_compute = run.batch_size, 0.0
    bar = tqdm(total=rows, unit="tok", unit_scale=True, desc=f"eval {run.name}", dynamic_ncols=True)
    t_loop = time.time()
    if run.executor is None:
        evaluator = run.evaluator()
        results = ((task, evaluator(task, bar.update)) for task in tasks)
    else:
        results = run.executor.map_actors(
            run.actor_evaluator(),
            tasks,
            n_actors=run.cfg.ray_actors or None,
            num_gpus=1 if run.device == "cuda" else 0,  # one GPU per actor; none on CPUs
        )
    try:
        for (c, w0, w1), result in results:
            stage.record(chunk_part(w0, w1), [chunk_path(stage.out, c)], rows=result["rows"])
            if run.executor is not None:
                bar.update(result["rows"])
            read += result["read"]
            t_compute += result["seconds"]
            batch_size = min(batch_size, result["batch_size"])
            backoffs = max(backoffs, result["backoffs"])  # each evaluator counts its own
            scored += result["rows"]
            windows_done += w1 - w0
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
    }


def _eval_meta(stage, run: EvalRun, chunks, todo, totals: dict) -> dict:
    cfg, tags, loaded = run.cfg, run.tags, run.loaded
    total_rows = int(tags.n_targets[: run.n_windows].sum())
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
        skipped={"windows_beyond_max_windows": tags.n_windows - run.n_windows},
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
        skip_tokenizer_check=cfg.skip_tokenizer_check,
        windowing=cfg.windowing,
        prefix_token=run.prefix,
        prefix_token_source=run.prefix_source,
        harness_bos=list(run.lead) if cfg.harness_bos else None,
        window=tags.window,
        partial=run.partial,
        windows_evaluated=run.n_windows,
        windows_total=tags.n_windows,
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
  arslice eval --model native:runs/demo/models/attention --tags runs/demo/tags --out runs/demo/losses/attention
  arslice eval --model hf:RWKV/rwkv-4-169m-pile --tags runs/pile/tags --out runs/pile/losses/rwkv --dtype fp32  # needs the hub
  arslice eval --model hf:./pythia-70m --tags runs/pile/tags --out smoke --max-windows 8 --device cpu
  arslice eval --model hf:EleutherAI/pythia-160m --tags runs/pile/tags --out runs/pile/losses/pythia-rolling --windowing rolling  # needs the hub
  arslice eval --model hf:EleutherAI/pythia-160m@step3000 --tags runs/pile/tags --out runs/pile/losses/pythia-160m-step3000  # needs the hub
  arslice eval --model hf:meta-llama/Llama-2-7b-hf --tags runs/llama/tags --out runs/llama/losses/llama-harness --windowing rolling --harness-bos  # needs the hub
  arslice eval --model safari:hyena-small-150b-tok.ckpt --model-config safari/configs/evals/hyena_small_150b.yaml --tags runs/pile/tags --out runs/pile/losses/hyena  # needs a published checkpoint""",
    hub_names=eval_hub_names,
    pipeline=Wiring(
        table="eval",
        reads=(TAGS, MODELS),
        writes=LOSSES,
        fan_out=evaluated_models,
        defaults=defaults,
        entry=losses_entry,
    ),
)

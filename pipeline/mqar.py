"""`arslice mqar`: Zoology's multi-query associative recall (MQAR) probe, Figure 2 style.

MQAR (Arora et al., 2023, "Zoology", §3.2 Definition 3.1, §4.3; generator of
HazyResearch/zoology `zoology/data/multiquery_ar.py`, written anew here). A sequence of length T
holds `n` key-value pairs, then queries::

    k1 v1 k2 v2 ... kn vn | 0 ... 0 k3 0 ... 0 k1 0 ...
                                    ^ target v3  ^ target v1

Keys are drawn from the lower half of the vocabulary (1 .. V/2-1) and values from the upper half
(V/2 .. V-1), without replacement inside a sequence, so no key occurs twice among the pairs and
keys never look like values. Token 0 (in neither half) fills the gaps. Every key is queried once,
after the pairs: the query slots are the even offsets `2g` of the `(T - 2n) / 2` slots after the
pairs, `g` drawn without replacement with probability proportional to `g^(a-1)` (a = 0.01: most
queries come soon after the pairs, a few far away, as repeats of bigrams are spread in text).
At a query position the model reads the key and must output its value; only those positions
are scored, and accuracy is the fraction of queries whose arg-max prediction (over the whole
vocabulary) is the value.

The sweep: every sequence mixer of `models/` as a two-layer `models.backbone.LanguageModel` without
state mixer (Zoology's Figure 2 models; BaseConv alternates a short and a long convolution; Based
is its short gated convolution, then Taylor linear attention with 16-dim feature maps; Mamba is not
a mixer of the backbone and is not in it), for each model dimension and sequence length (Zoology's
pairing of length and pairs: T / 16 pairs), each at several learning rates, trained with
`pipeline.train`'s recipe (AdamW with decay on matrices, warmup then cosine, gradient clipping;
beta2 0.999 as Zoology's `torch.optim.AdamW` defaults, which its recall circuit needs here) on new
sequences every step (Zoology trains many epochs over 100k sequences; on a CPU budget a small fixed
set is memorised long before the recall mechanism forms, so the stream never repeats) and scored on
held-out sequences; a run stops early when its held-out accuracy reaches `early_stop`, and the
remaining runs of a cell are skipped once one has (the best accuracy over a cell's runs is what
Figure 2 plots).

Learning rates and restarts. `--lrs` are the rates of a model `lr_reference_width` (64) wide; a
model of width d trains at lr * 64 / d (Adam's 1/width rule, as in muP), and each rate is tried from
`restarts` initialisations (run r: torch seed and training stream seed + r; the held-out sequences
stay the same), rate by rate, restart by restart, until a run reaches `early_stop`. Both are
measured needs (two-layer attention with learned positions and no curriculum, length 64, 4 pairs,
vocabulary 128, 4096 tokens a step, one CPU core). With 3e-3 and 1e-3 at every width, d_model 64
solves it (99.5% by step 4200, 2 min) but 32 stays at 27-46% in six runs (one 86.8%) and 128 at
27.5%. A failed run stays at chance (25%: loss ~ln 4, one of the context's four values) or sits at a
partial solution: one key-value slot, the first or the last, recalled exactly and the other three at
chance among the values left, 1/4 + 3/4 * 1/3 = 50% (per-slot accuracy 99 / 35 / 31 / 35%: d_model
128 at 1.5e-3; the last slot for 32 at 6e-3). With the width-scaled rates the second initialisation
solves both (32: 99.4% by step 3200 at 6e-3; 128: 99.0% by step 5800 at 1.5e-3), so attention solves
every width at length 64 (20 min on two cores; docs/mqar-learned-T64.csv, with BaseConv's 33.9 /
29.0 / 91.5%). With the language-model trainer's beta2 0.95 instead of 0.999 the d_model 64 run
stays at 25-27% through 8000 steps.

Positions and a curriculum. At length 128 (8 pairs) attention trained there from the start stays
near chance (12.5%) whatever was tried (6000 or 20000 steps, mixed pair counts, rotary positions,
random fillers, 4 heads, attention dropout, other rates: 13-15%; docs/mqar-probe.md). What moves it is a
curriculum (`curriculum_lens`, 32 and 64 by default): a run first trains at each of those lengths
shorter than its own (length / 16 pairs each) until it reaches `early_stop` there or for `steps`
steps, then up to `steps` more at its own length, each stage after the first scored at its length
before its first step. Whether the circuit carries over depends on attention's positions
(`attention_positions`). Zoology's learned ones tie it to the positions it was learned at: a
d_model 64 model that solved length 64 recalls 48% at 128 at once (the pairs at positions it knows)
and 60% after 4000 more steps. Rotary ones on every channel (the default) do not: a model that
solved 64 recalls 99% at 128 and 256 within 200 steps there. But rotary attention from the start
at 64 seldom forms the circuit (none of 8 runs at d_model 32 in 6000 steps; d_model 128 none of 5,
29% after 20000 steps): both layers attend to the context's values alike and it predicts their
mean, loss ~ln 4. Two pairs at length 32 first take d_model 128 out of that (solved there in 1200
steps, then 99.6% at 64 after 200 more); d_model 32 and 64 stay at 55% (chance with 2 pairs: 50%)
through their stage at 32 and solve 64 in the stage after (3600 and 4000 steps). With these
defaults every attention cell of the grid reaches 99% on its first run (99.2-99.9%; 14 min on two
cores; docs/mqar.csv). The full sweep of every family (45 cells, up to six runs each) is many hours
on two CPU cores and minutes on a GPU (`--device cuda`); `--archs`, `--d-models` and `--seq-lens`
run a part of it, and finished runs are kept, so it can be grown a part at a time.

Outputs (`--out DIR`, e.g. `runs/demo/mqar`): `cells/<arch>-d<D>-T<T>-lr<LR>[-r<R>].json`, one per
finished training run (its best held-out accuracy, the accuracy per key-value slot at that
evaluation, its history, and its `curriculum` stages', one per shorter length it trained at first;
written atomically, each a part of the stage's ledger), then `mqar.csv` and `mqar.md` (the best
accuracy per architecture, dimension and length, with the learning rate and restart of its run, its
steps at its own length and in its curriculum, and how many runs it took), `mqar.png` (accuracy vs
model dimension, one panel per sequence length) and `meta.json`, written last. `mqar_results(DIR)`
reads them back for the report.

The sweep is a stage under the plan (`ar_slicing.machinery.plan`): its settings are the ones a cell's result
depends on (`CELL_SETTINGS`), so a sweep made with others is refused, naming each field with both
values, unless `--overwrite`; the grid (architectures, dimensions, lengths, rates) is the plan's
scope (with the number of restarts), so finished runs are kept when it changes: an interrupted
sweep resumes, and a grid grows a part at a time, training only the cells it does not hold yet.
"""

from __future__ import annotations

import csv
import io
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import (
    atomic_path,
    build_meta,
    is_complete,
    read_json,
    write_bytes_atomic,
    write_json_atomic,
)
from ar_slicing.machinery.layout import (
    MQAR_CELLS_DIR,
    MQAR_CSV_NAME,
    MQAR_FIGURE,
    MQAR_MD_NAME,
    meta_path,
)
from ar_slicing.machinery.plan.stage_parts import Part, StageParts
from pipeline.architectures import MQAR_ARCHITECTURES, MQAR_DEFAULT, described
from pipeline.config import Command
from pipeline.stage import Finished

log = logging.getLogger(__name__)

# --archs' choices and its default sweep (the one docs/ shows): pipeline/architectures.py
ARCHITECTURES = MQAR_DEFAULT
MORE_ARCHITECTURES = [a for a in MQAR_ARCHITECTURES if a not in MQAR_DEFAULT]
IGNORE = -100  # target of every position that is not a query (Zoology's ignore index)
# Settings a cell's result depends on (the sweep's plan): a sweep made with others is refused.
CELL_SETTINGS = (
    "lr_reference_width",
    "vocab_size",
    "n_test",
    "steps",
    "batch_tokens",
    "warmup_steps",
    "beta2",
    "power_a",
    "eval_every",
    "early_stop",
    "seed",
    "attention_positions",
    "curriculum_lens",
)


@dataclass(frozen=True)
class MqarConfig:
    out: str = field(metadata={"help": "output directory, e.g. runs/demo/mqar"})
    archs: list[str] = field(
        default_factory=lambda: list(ARCHITECTURES),
        metadata={
            "help": "sequence mixers to train: " + described(MQAR_ARCHITECTURES),
            "choices": MQAR_ARCHITECTURES,
        },
    )
    d_models: list[int] = field(
        default_factory=lambda: [32, 64, 128], metadata={"help": "model dimensions (Figure 2's x)"}
    )
    seq_lens: list[int] = field(
        default_factory=lambda: [64, 128, 256],
        metadata={"help": "sequence lengths (one panel each); T / 16 key-value pairs each"},
    )
    lrs: list[float] = field(
        default_factory=lambda: [3e-3, 1e-3],
        metadata={"help": "learning rates tried per cell, in order (the best accuracy is kept)"},
    )
    lr_reference_width: int = field(
        default=64,
        metadata={
            "help": "--lrs are the rates of a model this wide; a model of width d trains at "
            "lr * this / d (Adam's 1/width rule, as in muP); 0 trains every width at --lrs"
        },
    )
    restarts: int = field(
        default=3,
        metadata={
            "help": "training runs per learning rate, run r from its own initialisation and "
            "sequences (seed + r); a cell stops at the first run that reaches early_stop"
        },
    )
    vocab_size: int = field(
        default=128,
        metadata={"help": "vocabulary: keys from the lower half, values from the upper half"},
    )
    n_test: int = field(default=512, metadata={"help": "held-out sequences scored for accuracy"})
    steps: int = field(default=6000, metadata={"help": "optimizer steps per training run"})
    batch_tokens: int = field(
        default=4096,
        metadata={"help": "tokens per step (batch_tokens / T sequences; new ones every step)"},
    )
    warmup_steps: int = field(default=20, metadata={"help": "linear warmup steps"})
    beta2: float = field(
        default=0.999,
        metadata={"help": "AdamW beta2 (Zoology trains MQAR with torch's default, 0.999)"},
    )
    power_a: float = field(
        default=0.01, metadata={"help": "query gaps ~ g^(a-1) (Zoology's power_a; 1 = uniform)"}
    )
    eval_every: int = field(
        default=200, metadata={"help": "held-out accuracy every N steps (early stopping)"}
    )
    early_stop: float = field(
        default=0.99, metadata={"help": "stop a run (and skip the cell's further runs) at this"}
    )
    seed: int = field(
        default=0,
        metadata={"help": "seed of the held-out sequences; run r trains from seed + r"},
    )
    attention_positions: str = field(
        default="rotary",
        metadata={
            "help": "attention's positions: rotary (on every channel: a circuit learned at one "
            "length holds at others) or learned (Zoology's absolute position embeddings)",
            "choices": ["rotary", "learned"],
        },
    )
    curriculum_lens: list[int] = field(
        default_factory=lambda: [32, 64],
        metadata={
            "help": "a run at a longer length first trains at each of these shorter ones, in "
            "order (length / 16 pairs each), until it reaches early_stop there or for --steps "
            "steps, then --steps more at its own; 0: no curriculum"
        },
    )
    workers: int = field(default=2, metadata={"help": "training processes running side by side"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads per process"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or auto"})
    overwrite: bool = field(default=False, metadata={"help": "retrain every cell"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})


# ---- the task (pure numpy, tested against Definition 3.1) -----------------------------------------


def num_kv_pairs_for(seq_len: int) -> int:
    """Zoology's Figure 2 pairing: 4 pairs at length 64, 8 at 128, 16 at 256."""
    return max(1, seq_len // 16)


def mqar_examples(
    n: int,
    seq_len: int,
    vocab_size: int,
    num_kv_pairs: int,
    rng: np.random.Generator,
    power_a: float = 0.01,
) -> tuple[np.ndarray, np.ndarray]:
    """`n` MQAR sequences: inputs (n, seq_len) int64 and targets (n, seq_len), IGNORE off queries.

    >>> x, y = mqar_examples(1, 16, 12, 2, np.random.default_rng(0))
    >>> x.shape, int((y != IGNORE).sum())
    ((1, 16), 2)
    """
    half = vocab_size // 2
    context = 2 * num_kv_pairs
    slots = (seq_len - context) // 2
    if seq_len % 2 or num_kv_pairs > half - 1 or num_kv_pairs > slots or num_kv_pairs < 1:
        raise ArSliceError(
            f"MQAR: {num_kv_pairs} key-value pairs do not fit a sequence of {seq_len} tokens "
            f"(even, with room for the pairs and one query each) over a vocabulary of {vocab_size}"
        )
    # distinct keys and values per row: the first `num_kv_pairs` of a random permutation
    keys = 1 + np.argsort(rng.random((n, half - 1)), axis=1)[:, :num_kv_pairs]  # (n, P)
    values = half + np.argsort(rng.random((n, vocab_size - half)), axis=1)[:, :num_kv_pairs]
    # query slots without replacement, P(g) ~ g^(a-1) for g = 1..slots (Gumbel top-k draws
    # exactly that: successive weighted choices without replacement)
    log_p = (power_a - 1.0) * np.log(np.arange(1, slots + 1))
    gumbel = -np.log(-np.log(rng.random((n, slots))))
    gaps = np.argsort(-(log_p + gumbel), axis=1)[:, :num_kv_pairs]  # (n, P) in 0..slots-1
    inputs = np.zeros((n, seq_len), dtype=np.int64)
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    query_pos = context + 2 * gaps  # (n, P)
    rows = np.arange(n)[:, None]
    inputs[rows, query_pos] = keys
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    targets[rows, query_pos] = values
    return inputs, targets


def held_out_sequences(cfg: MqarConfig, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The held-out sequences of one length (the same for every model and rate)."""
    rng = np.random.default_rng([cfg.seed, seq_len, 0])
    pairs = num_kv_pairs_for(seq_len)
    return mqar_examples(cfg.n_test, seq_len, cfg.vocab_size, pairs, rng, cfg.power_a)


def train_batch(
    cfg: MqarConfig, seq_len: int, step: int, restart: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Training batch `step` of run `restart`: new sequences every step, from a seed stream apart
    from the test set's, so a model can only score by recalling from the context, never by
    memorising."""
    rng = np.random.default_rng([cfg.seed + restart, seq_len, 1, step])
    batch = max(1, cfg.batch_tokens // seq_len)
    pairs = num_kv_pairs_for(seq_len)
    return mqar_examples(batch, seq_len, cfg.vocab_size, pairs, rng, cfg.power_a)


# ---- one training run -----------------------------------------------------------------------------


def build_model(
    arch: str, d_model: int, seq_len: int, vocab_size: int, attention_positions: str = "learned"
):
    """Zoology's Figure 2 model: two blocks of the mixer, no state mixer, tied head. Attention
    has one head, with Zoology's learned positions or rotary ones on all its channels."""
    from models.backbone import LanguageModel, ModelConfig

    rotary = arch == "attention" and attention_positions == "rotary"
    attention = {"num_heads": 1, "rotary_emb_dim": d_model if rotary else 0}
    mixer_kwargs = {"attention": attention, "base_conv": {"kernel_size": [3, -1]}}
    mixer, layer_mixers = arch, []
    if arch == "based":  # Based's pair: a short gated convolution, then Taylor linear attention
        mixer = "based_conv"
        taylor = {"feature_dim": 16, "num_heads": max(1, d_model // 32)}
        layer_mixers = [{"layers": [1], "name": "linear_attention", "kwargs": taylor}]
    return LanguageModel(
        ModelConfig(
            vocab_size=vocab_size,
            d_model=d_model,
            n_layers=2,
            sequence_mixer=mixer,
            sequence_mixer_kwargs=mixer_kwargs.get(arch, {}),
            state_mixer="identity",
            l_max=seq_len,
            layer_mixers=layer_mixers,
            max_position_embeddings=0 if rotary else None,  # None: the backbone's default
        )
    )


def query_logits(model, inputs, targets):
    """(logits (Q, V) at the query positions, their targets (Q,)): the head runs only there."""
    hidden, head, _ = model.hidden_and_head(inputs)  # (B, T, D)
    mask = targets != IGNORE
    return hidden[mask] @ head.T, targets[mask]  # (Q, V), (Q,)


def query_slots(inputs, targets, num_kv_pairs: int):
    """The key-value slot (0 .. n-1, its place among the pairs) each query asks for, in the order
    of `targets != IGNORE` (the order `query_logits` scores them in)."""
    mask = targets != IGNORE
    rows = mask.nonzero()[:, 0]
    keys = inputs[:, 0 : 2 * num_kv_pairs : 2]  # (B, n)
    return (keys[rows] == inputs[mask][:, None]).int().argmax(1)


def slot_accuracy(model, x, y, batch_size: int, num_kv_pairs: int) -> tuple[float, list[float]]:
    """Held-out accuracy, and the accuracy per key-value slot (every key is queried once per
    sequence, so the slots' mean is the accuracy). A run at 50% with 4 pairs that recalls one slot
    exactly and the others at chance among the values left shows as [0.99, 0.35, 0.31, 0.35]."""
    import torch

    hits, slots = [], []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            xs, ys = x[i : i + batch_size], y[i : i + batch_size]
            logits, t = query_logits(model, xs, ys)
            hits.append(logits.argmax(-1) == t)
            slots.append(query_slots(xs, ys, num_kv_pairs))
    model.train()
    hit, slot = torch.cat(hits).float(), torch.cat(slots)
    per_slot = [
        float(hit[slot == s].mean()) if (slot == s).any() else 0.0 for s in range(num_kv_pairs)
    ]
    return float(hit.mean()) if hit.numel() else 0.0, per_slot


def curriculum_for(cfg: MqarConfig, seq_len: int) -> list[int]:
    """The lengths a run at `seq_len` first trains at, in order (none: no curriculum)."""
    return [c for c in cfg.curriculum_lens if 0 < c < seq_len]


def train_cell(
    cfg: MqarConfig, arch: str, d_model: int, seq_len: int, lr: float, restart: int = 0
) -> dict:
    """Train one model at one learning rate, from the initialisation and sequences of run
    `restart`; its held-out accuracy (on the same held-out sequences for every run) and how it
    got there. A run longer than a curriculum length first trains at each such length in turn
    (its record's `curriculum`, one stage each), then at its own, each stage scored at its length
    from step 0 on when it follows another."""
    import torch

    from models.precision import resolve_device

    t0 = time.time()
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed + restart)
    model = build_model(arch, d_model, seq_len, cfg.vocab_size, cfg.attention_positions)
    model = model.to(device)
    curriculum = []
    for length in curriculum_for(cfg, seq_len):
        curriculum.append(
            _train_at(cfg, model, arch, length, lr, restart, device, bool(curriculum))
        )
    run = _train_at(cfg, model, arch, seq_len, lr, restart, device, bool(curriculum))
    return {
        "arch": arch,
        "d_model": d_model,
        "seq_len": seq_len,
        "num_kv_pairs": num_kv_pairs_for(seq_len),
        "lr": lr,
        "restart": restart,
        **run,
        "curriculum": curriculum,
        "n_params": sum(p.numel() for p in model.parameters()),
        "wall_time_s": round(time.time() - t0, 2),
    }


def _train_at(
    cfg: MqarConfig,
    model,
    arch: str,
    seq_len: int,
    lr: float,
    restart: int,
    device,
    score_first: bool = False,
) -> dict:
    """Up to `cfg.steps` steps of the project's recipe (a fresh optimizer and schedule) on
    sequences of `seq_len`, held-out accuracy every `eval_every` steps (and at step 0 with
    `score_first`: a model trained at another length may already recall at this one), stopping
    at `early_stop`."""
    import torch
    import torch.nn.functional as F

    from pipeline.train import make_optimizer
    from pipeline.train.config import Recipe
    from pipeline.train.loop import recipe_steps

    # the project's one training recipe, at this run's rate and length
    recipe = Recipe(lr=lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps, beta2=cfg.beta2)
    batch_size = max(1, cfg.batch_tokens // seq_len)
    optimizer = make_optimizer(model, recipe)
    x_test, y_test = (torch.from_numpy(a).to(device) for a in held_out_sequences(cfg, seq_len))
    pairs = num_kv_pairs_for(seq_len)
    history, best, best_slots, stopped_at = [], 0.0, [0.0] * pairs, None

    def score(done: int, loss: float | None) -> bool:
        nonlocal best, best_slots
        acc, slots = slot_accuracy(model, x_test, y_test, batch_size, pairs)
        if acc > best or not history:
            best, best_slots = acc, [round(s, 4) for s in slots]
        history.append({"step": done, "loss": loss, "accuracy": acc})
        return acc >= cfg.early_stop

    if score_first and score(0, None):
        stopped_at = 0

    def loss_at(step: int):
        x, y = (torch.from_numpy(a).to(device) for a in train_batch(cfg, seq_len, step, restart))
        logits, t = query_logits(model, x, y)
        return F.cross_entropy(logits.float(), t)

    steps = range(cfg.steps if stopped_at is None else 0)
    for step in recipe_steps(recipe, model, optimizer, steps, loss_at):
        if not step.finite:
            history.append({"step": step.step + 1, "loss": float("nan"), "accuracy": best})
            break
        done = step.step + 1
        scored = done % cfg.eval_every == 0 or done == cfg.steps
        if scored and score(done, round(step.loss.item(), 4)):
            stopped_at = done
            break
    return {
        "seq_len": seq_len,
        "num_kv_pairs": pairs,
        "accuracy": best,
        "slot_accuracy": best_slots,
        "final_accuracy": history[-1]["accuracy"] if history else 0.0,
        "steps_run": history[-1]["step"] if history else 0,
        "stopped_early_at": stopped_at,
        "history": history,
    }


# ---- the sweep ------------------------------------------------------------------------------------


def cell_name(arch: str, d_model: int, seq_len: int, lr: float, restart: int = 0) -> str:
    """The file of one training run (run 0 of a learning rate keeps the name it had before
    restarts, so the runs of an earlier sweep are kept)."""
    run = f"-r{restart}" if restart else ""
    return f"{arch}-d{d_model}-T{seq_len}-lr{lr:g}{run}.json"


def cell_runs(cfg: MqarConfig, d_model: int) -> list[tuple[float, int]]:
    """The training runs of a cell of width `d_model`, in the order they are tried: every
    learning rate (scaled to the width) from the first initialisation, then every rate from the
    next, ... (learning rate, restart)."""
    scale = cfg.lr_reference_width / d_model if cfg.lr_reference_width else 1.0
    return [(float(f"{lr * scale:.6g}"), r) for r in range(cfg.restarts) for lr in cfg.lrs]


def cell_settings(cfg: MqarConfig) -> dict:
    return {k: getattr(cfg, k) for k in CELL_SETTINGS}


def sweep_grid(cfg: MqarConfig) -> dict:
    """The cells asked for (the plan's scope: it changes no cell's result)."""
    return {
        "archs": cfg.archs,
        "d_models": cfg.d_models,
        "seq_lens": cfg.seq_lens,
        "lrs": cfg.lrs,
        "restarts": cfg.restarts,
    }


def run_group(
    cfg: MqarConfig, cells_dir: str, arch: str, d_model: int, seq_len: int, done: dict
) -> list:
    """Every run of one (arch, d_model, seq_len) in order (`cell_runs`), stopping once one
    reaches `early_stop`: the runs in `done` (what the ledger holds, by file name) are kept, the
    others trained and written atomically (the sweep's driver records them)."""
    from models.precision import torch_threads

    with torch_threads(cfg.threads):
        return _run_cell(cfg, cells_dir, arch, d_model, seq_len, done)


def _run_cell(
    cfg: MqarConfig, cells_dir: str, arch: str, d_model: int, seq_len: int, done: dict
) -> list:
    settings = cell_settings(cfg)
    out = []
    for lr, restart in cell_runs(cfg, d_model):
        name = cell_name(arch, d_model, seq_len, lr, restart)
        cell = done.get(name)
        if cell is None:
            if out and max(c["accuracy"] for c in out) >= cfg.early_stop:
                break  # an earlier run already solved the cell
            run = train_cell(cfg, arch, d_model, seq_len, lr, restart)
            cell = {**run, "settings": settings}
            write_json_atomic(Path(cells_dir) / name, cell)
        out.append(cell)
        if cell["accuracy"] >= cfg.early_stop:
            break
    return out


def cell_facts(cell: dict) -> dict:
    """What the ledger keeps of a cell: its result without the histories (in the cell's file)."""
    facts = {k: v for k, v in cell.items() if k not in ("history", "settings")}
    facts["curriculum"] = [
        {k: v for k, v in stage.items() if k != "history"} for stage in facts.get("curriculum", [])
    ]
    return facts


def best_rows(cells: list[dict], cfg: MqarConfig) -> list[dict]:
    """One row per (arch, d_model, seq_len): the best accuracy over learning rates."""
    rows = []
    for arch in cfg.archs:
        for seq_len in cfg.seq_lens:
            for d_model in cfg.d_models:
                mine = [
                    c
                    for c in cells
                    if (c["arch"], c["d_model"], c["seq_len"]) == (arch, d_model, seq_len)
                ]
                if not mine:
                    continue
                best = max(mine, key=lambda c: (c["accuracy"], -c["steps_run"]))
                rows.append(
                    {
                        "arch": arch,
                        "seq_len": seq_len,
                        "num_kv_pairs": best["num_kv_pairs"],
                        "d_model": d_model,
                        "accuracy": round(best["accuracy"], 4),
                        "best_lr": best["lr"],
                        "best_restart": best.get("restart", 0),
                        "runs": len(mine),
                        "steps_run": best["steps_run"],
                        "curriculum_steps": sum(s["steps_run"] for s in best["curriculum"]),
                        "n_params": best["n_params"],
                    }
                )
    return rows


CSV_COLUMNS = (
    "arch",
    "seq_len",
    "num_kv_pairs",
    "d_model",
    "accuracy",
    "best_lr",
    "best_restart",
    "runs",
    "steps_run",
    "curriculum_steps",
    "n_params",
)


def rows_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def accuracy_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Accuracy (%) per architecture (rows) and model dimension (columns), one block of rows per
    sequence length: (header, rows of cells)."""
    d_models = sorted({r["d_model"] for r in rows})
    header = ["sequence length (pairs)", "model", *(f"d_model {d}" for d in d_models)]
    body = []
    for seq_len in sorted({r["seq_len"] for r in rows}):
        for arch in dict.fromkeys(r["arch"] for r in rows):
            mine = {r["d_model"]: r for r in rows if (r["arch"], r["seq_len"]) == (arch, seq_len)}
            if not mine:
                continue
            pairs = next(iter(mine.values()))["num_kv_pairs"]
            cells = [f"{100 * mine[d]['accuracy']:.1f}" if d in mine else "—" for d in d_models]
            body.append([f"{seq_len} ({pairs})", arch, *cells])
    return header, body


def rows_markdown(rows: list[dict]) -> str:
    """`accuracy_table` as Markdown."""
    header, body = accuracy_table(rows)
    lines = [
        "| " + " | ".join(header) + " |",
        "| :--- | :--- | " + " | ".join("---:" for _ in header[2:]) + " |",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def figure_png(rows: list[dict]) -> bytes:
    """Figure 2: accuracy vs model dimension, one panel per sequence length, one line per model."""
    from pipeline.plotting import png_bytes as _png
    from pipeline.plotting import pyplot as _pyplot

    plt = _pyplot()
    seq_lens = sorted({r["seq_len"] for r in rows})
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    fig, axes = plt.subplots(
        1, len(seq_lens), figsize=(3.2 * len(seq_lens), 3.0), dpi=110, sharey=True, squeeze=False
    )
    for ax, seq_len in zip(axes[0], seq_lens):
        for arch in archs:
            pts = sorted(
                (r["d_model"], r["accuracy"])
                for r in rows
                if (r["arch"], r["seq_len"]) == (arch, seq_len)
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arch)
        ax.set_xscale("log", base=2)
        ds = sorted({r["d_model"] for r in rows})
        ax.set_xticks(ds)
        ax.set_xticklabels([str(d) for d in ds])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"Sequence length {seq_len}")
        ax.set_xlabel("model dimension")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _png(fig)


def run_mqar(cfg: MqarConfig) -> dict:
    """Train every cell of the sweep the ledger does not hold, then write the table, the figure
    and meta.json."""
    from ar_slicing.machinery.plan import StagePlan
    from pipeline.stage import run_stage

    unknown = sorted(set(cfg.archs) - set(MQAR_ARCHITECTURES))
    if unknown:
        raise ArSliceError(
            f"--archs: unknown {', '.join(unknown)}; choose from {', '.join(MQAR_ARCHITECTURES)}"
        )
    bad = cfg.steps <= 0 or cfg.restarts < 1 or cfg.lr_reference_width < 0
    if not cfg.lrs or not cfg.d_models or not cfg.seq_lens or bad:
        raise ArSliceError(
            "--lrs, --d-models and --seq-lens need values, --steps must be > 0, --restarts >= 1 "
            f"and --lr-reference-width >= 0 (got --steps {cfg.steps}, --restarts "
            f"{cfg.restarts}, --lr-reference-width {cfg.lr_reference_width})"
        )
    from models.precision import resolve_device

    resolve_device(cfg.device)  # refuse a missing GPU before any worker starts
    lens = cfg.curriculum_lens
    if not lens or (lens != [0] and (min(lens) <= 0 or lens != sorted(set(lens)))):
        raise ArSliceError(
            "--curriculum-lens must be increasing lengths > 0, or 0 for no curriculum "
            f"(got {' '.join(map(str, lens))})"
        )
    curricula = {c for t in cfg.seq_lens for c in curriculum_for(cfg, t)}
    for seq_len in [*cfg.seq_lens, *curricula]:  # refuse impossible lengths before any training
        mqar_examples(
            1, seq_len, cfg.vocab_size, num_kv_pairs_for(seq_len), np.random.default_rng()
        )
    out = Path(cfg.out)
    plan = StagePlan("mqar", settings=cell_settings(cfg), inputs={}, scope=sweep_grid(cfg))
    # (one sweep writes a folder at a time)
    return run_stage(
        "mqar", out, plan, lambda stage, _: _run_sweep(stage, cfg), overwrite=cfg.overwrite
    )


def _run_sweep(stage, cfg: MqarConfig) -> Finished:
    from multiprocessing import get_context

    from tqdm.auto import tqdm

    from ar_slicing.machinery.executor import process_pool

    t0 = time.time()
    out = stage.out
    cells_dir = out / MQAR_CELLS_DIR
    cells_dir.mkdir(parents=True, exist_ok=True)
    groups = [(a, d, t) for a in cfg.archs for d in cfg.d_models for t in cfg.seq_lens]
    groups.sort(key=lambda g: -g[1] * g[2])  # biggest first: the pool ends evenly
    parts = StageParts(
        stage,
        [
            Part(name, (cells_dir / name,), g)
            for g in groups
            for name in (cell_name(*g, lr, r) for lr, r in cell_runs(cfg, g[1]))
        ],
    )
    runs = {g: [part for part in parts.all if part.task == g] for g in groups}  # in cell_runs order
    kept = {g: parts.held(runs[g]) for g in groups}  # the cells the ledger holds, with their facts
    stage.expect(out / name for name in (MQAR_CSV_NAME, MQAR_MD_NAME, MQAR_FIGURE))
    reused = len(parts.facts)
    bar = tqdm(total=len(groups), desc="mqar", unit="cell", disable=not cfg.progress)

    def finished(group, cells: list[dict]) -> list[dict]:
        # run_group gives the group's runs in cell_runs order, up to the one that solved it
        new = [
            (part, cell) for part, cell in zip(runs[group], cells) if part.name not in kept[group]
        ]
        parts.record_all(new, cell_facts)  # (by the driver, once a worker wrote it)
        bar.update(1)
        return cells

    cells: list[dict] = []
    if cfg.workers <= 1:
        for g in groups:
            cells += finished(g, run_group(cfg, str(cells_dir), *g, kept[g]))
    else:
        with process_pool(cfg.workers, get_context("spawn")) as pool:
            futures = [pool.submit(run_group, cfg, str(cells_dir), *g, kept[g]) for g in groups]
            for g, f in zip(groups, futures):
                cells += finished(g, f.result())
    bar.close()
    rows = best_rows(cells, cfg)
    with atomic_path(out / MQAR_CSV_NAME) as tmp:
        tmp.write_text(rows_csv(rows))
    with atomic_path(out / MQAR_MD_NAME) as tmp:
        tmp.write_text(rows_markdown(rows))
    write_bytes_atomic(out / MQAR_FIGURE, figure_png(rows))
    wall = time.time() - t0
    meta = build_meta(
        "mqar",
        config=cfg,
        inputs={},
        counts={
            "cells": len(groups),
            "training_runs": len(cells),
            "runs_kept_from_before": reused,
            "runs_stopped_early": sum(1 for c in cells if c["stopped_early_at"] is not None),
        },
        wall_time_s=wall,
        rows=rows,
    )
    return Finished(
        meta,
        [
            rows_markdown(rows).rstrip("\n"),
            f"mqar: {len(rows)} cells, {len(cells)} training runs, {wall:.0f} s -> {out}",
        ],
    )


# ---- for the report -------------------------------------------------------------------------------


@dataclass
class MqarResults:
    """A finished MQAR sweep: its rows, the markdown table and the figure's path."""

    rows: list[dict]
    markdown: str
    figure: Path
    meta: dict


def mqar_results(out_dir: str | Path) -> MqarResults | None:
    """The finished sweep in `out_dir` (e.g. `<run>/mqar`), or None when there is none yet."""
    out_dir = Path(out_dir)
    if not is_complete(out_dir):
        return None
    meta = read_json(meta_path(out_dir))
    rows = meta.get("rows") or []
    return MqarResults(
        rows=rows, markdown=rows_markdown(rows), figure=out_dir / MQAR_FIGURE, meta=meta
    )


COMMAND = Command(
    MqarConfig,
    run_mqar,
    plan_settings=cell_settings,
    summary="Zoology's multi-query associative recall probe (Figure 2)",
    examples="""\
  arslice mqar --out runs/demo/mqar                       # the full sweep (make mqar MQAR_ARGS=)
  arslice mqar --out runs/demo/mqar --archs attention     # attention's 9 cells, 14 min on 2 cores
  arslice mqar --out runs/demo/mqar --archs attention base_conv --lrs 3e-3 --restarts 1  # make mqar: docs/mqar.csv
  arslice mqar --out runs/demo/mqar-learned --archs attention --seq-lens 64 \\
      --attention-positions learned --curriculum-lens 0  # Zoology's positions, no curriculum
  arslice mqar --out /tmp/mqar --lrs 1e-3 3e-3 1e-2 --steps 8000 --device cuda --workers 1  # needs a GPU""",
)

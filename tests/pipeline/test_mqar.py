"""`arslice mqar`: the MQAR generator against Zoology's Definition 3.1, the sweep's resumable
outputs, and (slow) that the project's own two-layer attention and trainer solve the task."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import numpy as np
import pytest

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import read_json
from pipeline.config import printing_summaries
from pipeline.mqar import (
    IGNORE,
    MqarConfig,
    build_model,
    cell_runs,
    held_out_sequences,
    mqar_examples,
    mqar_results,
    num_kv_pairs_for,
    query_slots,
    run_mqar,
    slot_accuracy,
    train_batch,
    train_cell,
)
from tests.queries.test_queries import tiny_run  # noqa: F401  (a fixture)
from tests.reliability import as_killed
from tests.unpinned import run_unpinned


def check_definition(x: np.ndarray, y: np.ndarray, vocab_size: int, pairs: int) -> None:
    """Definition 3.1, checked sequence by sequence with plain loops."""
    half = vocab_size // 2
    for seq, tgt in zip(x.tolist(), y.tolist()):
        keys, values = seq[0 : 2 * pairs : 2], seq[1 : 2 * pairs : 2]
        assert all(1 <= k < half for k in keys), keys  # keys from the lower half
        assert all(half <= v < vocab_size for v in values), values  # values from the upper half
        assert len(set(keys)) == pairs and len(set(values)) == pairs
        queried = []
        for pos in range(2 * pairs, len(seq)):
            token = seq[pos]
            if tgt[pos] == IGNORE:
                assert token == 0, (pos, token)  # only the filler between queries
                continue
            # the target is the value paired with this key earlier in the sequence
            earlier = [i for i in range(pos) if seq[i] == token]
            assert earlier == [2 * keys.index(token)], (pos, earlier)
            assert tgt[pos] == seq[earlier[0] + 1]
            assert (pos - 2 * pairs) % 2 == 0
            queried.append(token)
        assert sorted(queried) == sorted(keys)  # every key queried exactly once
        for k in keys:  # no key twice in one sequence, but for its one query
            assert seq.count(k) == 2
        assert all(t == IGNORE for t in tgt[: 2 * pairs])


@pytest.mark.parametrize(
    "seq_len, vocab_size, power_a",
    [(16, 12, 0.01), (64, 512, 0.01), (256, 8192, 0.01), (64, 64, 1.0)],
)
def test_generator_follows_definition_3_1(seq_len, vocab_size, power_a):
    pairs = num_kv_pairs_for(seq_len)
    x, y = mqar_examples(200, seq_len, vocab_size, pairs, np.random.default_rng(1), power_a)
    assert x.shape == y.shape == (200, seq_len) and x.dtype == np.int64
    check_definition(x, y, vocab_size, pairs)


def test_generator_query_gaps_follow_the_power_law():
    """Slot g (0-based) is picked with weight (g+1)^(a-1): uniform at a = 1, early at a = 0.01."""
    n, seq_len, pairs = 4000, 64, 4
    slots = (seq_len - 2 * pairs) // 2
    for power_a in (1.0, 0.01):
        x, y = mqar_examples(n, seq_len, 512, pairs, np.random.default_rng(2), power_a)
        gaps = (np.argwhere(y != IGNORE)[:, 1] - 2 * pairs) // 2
        freq = np.bincount(gaps, minlength=slots) / n  # inclusion probability of each slot
        if power_a == 1.0:
            np.testing.assert_allclose(freq, pairs / slots, atol=0.03)
        else:
            # a naive sequential draw without replacement, the reference for the inclusion rates
            rng = np.random.default_rng(3)
            w = np.arange(1, slots + 1) ** (power_a - 1)
            ref = np.zeros(slots)
            for _ in range(n):
                ref[rng.choice(slots, size=pairs, replace=False, p=w / w.sum())] += 1
            np.testing.assert_allclose(freq, ref / n, atol=0.04)
            assert freq[0] > 2 * freq[-1]


def test_generator_is_seeded_and_refuses_impossible_shapes():
    a = mqar_examples(5, 64, 512, 4, np.random.default_rng(7))
    b = mqar_examples(5, 64, 512, 4, np.random.default_rng(7))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    with pytest.raises(ArSliceError, match="do not fit"):
        mqar_examples(1, 64, 8, 4, np.random.default_rng(0))  # 3 keys for 4 pairs
    with pytest.raises(ArSliceError, match="do not fit"):
        mqar_examples(1, 10, 512, 4, np.random.default_rng(0))  # no room for the queries


def test_every_step_trains_on_new_sequences_none_of_them_held_out():
    cfg = MqarConfig(out="unused", n_test=200, batch_tokens=64 * 50)
    x_test, _ = held_out_sequences(cfg, 64)
    held_out = {r.tobytes() for r in x_test}
    seen = set()
    for step in range(40):
        x, y = train_batch(cfg, 64, step)
        assert x.shape == (50, 64)
        check_definition(x, y, cfg.vocab_size, 4)
        rows = {r.tobytes() for r in x}
        assert not rows & held_out and not rows & seen  # never a test sequence, never a repeat
        seen |= rows
    # the same for every model and learning rate
    assert np.array_equal(train_batch(cfg, 64, 7)[0], train_batch(cfg, 64, 7)[0])
    assert np.array_equal(held_out_sequences(cfg, 64)[0], x_test)


TINY = dict(
    archs=["attention", "base_conv"],
    d_models=[16],
    seq_lens=[16],
    lrs=[3e-3, 1e-3],
    lr_reference_width=0,  # every width at the rates as given
    restarts=1,
    vocab_size=24,
    n_test=32,
    steps=6,
    batch_tokens=128,
    warmup_steps=2,
    eval_every=3,
    workers=1,
    progress=False,
)


def test_sweep_writes_table_figure_and_resumes(tmp_path, capsys):
    import torch

    out = tmp_path / "mqar"
    threads = torch.get_num_threads()
    meta = run_mqar(MqarConfig(out=str(out), **TINY, threads=threads + 1))
    # trained in this process (workers=1) with its own thread count, and this one's given back:
    # a later stage run from Python must not inherit it (its results would change)
    assert torch.get_num_threads() == threads
    cells = sorted(p.name for p in (out / "cells").iterdir())
    assert cells == [
        "attention-d16-T16-lr0.001.json",
        "attention-d16-T16-lr0.003.json",
        "base_conv-d16-T16-lr0.001.json",
        "base_conv-d16-T16-lr0.003.json",
    ]
    with open(out / "mqar.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["arch"], r["d_model"], r["seq_len"]) for r in rows] == [
        ("attention", "16", "16"),
        ("base_conv", "16", "16"),
    ]
    for r in rows:  # the table keeps the best learning rate of each cell
        runs = [
            json.loads((out / "cells" / f"{r['arch']}-d16-T16-lr{lr:g}.json").read_text())
            for lr in (3e-3, 1e-3)
        ]
        best = max(runs, key=lambda c: c["accuracy"])
        assert float(r["accuracy"]) == pytest.approx(best["accuracy"], abs=1e-4)
        assert float(r["best_lr"]) == best["lr"]
        assert 0.0 <= best["accuracy"] <= 1.0 and best["steps_run"] == 6
    assert (out / "mqar.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 16 (1) | attention |" in (out / "mqar.md").read_text()
    assert meta["counts"]["training_runs"] == 4 and meta["counts"]["runs_kept_from_before"] == 0

    # complete: skipped; interrupted with a cell lost: only it is retrained, the others kept
    run_mqar(MqarConfig(out=str(out), **TINY))
    assert capsys.readouterr().out == ""  # from Python: nothing printed
    with printing_summaries():
        run_mqar(MqarConfig(out=str(out), **TINY))
    assert "is complete; skipped" in capsys.readouterr().out
    kept = (out / "cells" / "attention-d16-T16-lr0.003.json").read_text()
    as_killed(out)
    (out / "cells" / "base_conv-d16-T16-lr0.001.json").unlink()
    meta = run_mqar(MqarConfig(out=str(out), **TINY))
    assert meta["counts"]["runs_kept_from_before"] == 3
    assert (out / "cells" / "attention-d16-T16-lr0.003.json").read_text() == kept
    assert (out / "cells" / "base_conv-d16-T16-lr0.001.json").is_file()

    # other settings: refused, naming each field with both values, unless --overwrite
    with pytest.raises(ArSliceError, match=r"settings\.steps: 6 -> 7(?s:.*)--overwrite"):
        run_mqar(MqarConfig(out=str(out), **{**TINY, "steps": 7}))
    meta = run_mqar(MqarConfig(out=str(out), **{**TINY, "steps": 7, "overwrite": True}))
    assert meta["counts"]["runs_kept_from_before"] == 0

    results = mqar_results(out)
    assert results is not None and results.figure.is_file()
    assert [r["arch"] for r in results.rows] == ["attention", "base_conv"]
    assert results.markdown.startswith("| sequence length (pairs) | model | d_model 16 |")
    assert mqar_results(tmp_path / "nothing") is None


def test_a_grid_grows_a_part_at_a_time_training_only_the_new_cells(tmp_path):
    """`--archs attention`, then the whole grid: the attention cells are kept, not retrained, and
    a finished sweep with another grid is not refused (the grid is the plan's scope)."""
    out = tmp_path / "m"
    first = run_mqar(MqarConfig(out=str(out), **{**TINY, "archs": ["attention"]}))
    attention = {p.name: p.read_bytes() for p in (out / "cells").iterdir()}
    assert sorted(attention) == ["attention-d16-T16-lr0.001.json", "attention-d16-T16-lr0.003.json"]
    assert [r["arch"] for r in first["rows"]] == ["attention"]
    grown = run_mqar(MqarConfig(out=str(out), **TINY))
    assert grown["counts"]["runs_kept_from_before"] == 2 and grown["counts"]["training_runs"] == 4
    assert {p.name: p.read_bytes() for p in (out / "cells").glob("attention-*")} == attention
    assert [r["arch"] for r in grown["rows"]] == ["attention", "base_conv"]
    # the whole grid is complete; a part of it again is a new table from the kept cells
    assert run_mqar(MqarConfig(out=str(out), **TINY))["created_at"] == grown["created_at"]
    part = run_mqar(MqarConfig(out=str(out), **{**TINY, "archs": ["base_conv"]}))
    assert part["counts"]["runs_kept_from_before"] == 2 and [r["arch"] for r in part["rows"]] == [
        "base_conv"
    ]


def test_a_sweep_of_other_cell_settings_is_refused_by_name(tmp_path):
    out = tmp_path / "m"
    run_mqar(MqarConfig(out=str(out), **TINY))
    before = {p.name: p.read_bytes() for p in (out / "cells").iterdir()}
    with pytest.raises(ArSliceError) as err:
        run_mqar(MqarConfig(out=str(out), **{**TINY, "steps": 8, "vocab_size": 32}))
    text = str(err.value)
    assert "settings.steps: 6 -> 8" in text and "settings.vocab_size: 24 -> 32" in text
    assert "--overwrite" in text and "warmup_steps" not in text
    assert {p.name: p.read_bytes() for p in (out / "cells").iterdir()} == before
    # how it runs is not a setting of the cells: another worker count is the same sweep
    assert run_mqar(MqarConfig(out=str(out), **{**TINY, "workers": 2, "threads": 2}))


def test_a_solved_cell_skips_the_remaining_learning_rates(tmp_path):
    cfg = MqarConfig(out=str(tmp_path / "m"), **{**TINY, "archs": ["attention"], "early_stop": 0.0})
    meta = run_mqar(cfg)
    assert sorted(p.name for p in (tmp_path / "m" / "cells").iterdir()) == [
        "attention-d16-T16-lr0.003.json"
    ]
    assert meta["counts"]["runs_stopped_early"] == 1


def test_restarts_try_each_rate_from_new_initialisations_until_one_solves_the_cell(tmp_path):
    """Run r of a rate starts from its own initialisation and sequences (seed + r) and is scored
    on the same held-out sequences; runs go rate by rate, restart by restart, and stop at the
    first that solves the cell. More restarts later train only the runs not held yet."""
    cfg = MqarConfig(out="unused", **TINY)
    first, again = train_batch(cfg, 16, 3, restart=1), train_batch(cfg, 16, 3, restart=1)
    assert np.array_equal(first[0], again[0])
    assert not np.array_equal(first[0], train_batch(cfg, 16, 3)[0])
    zero = train_cell(cfg, "attention", 16, 16, 1e-3)
    one = train_cell(cfg, "attention", 16, 16, 1e-3, restart=1)
    assert (zero["restart"], one["restart"]) == (0, 1)
    assert zero["history"] != one["history"]

    out = tmp_path / "m"
    never = {**TINY, "archs": ["attention"], "early_stop": 1.1}  # no run stops the cell
    run_mqar(MqarConfig(out=str(out), **never))
    kept = {p.name: p.read_bytes() for p in (out / "cells").iterdir()}
    assert sorted(kept) == ["attention-d16-T16-lr0.001.json", "attention-d16-T16-lr0.003.json"]
    meta = run_mqar(MqarConfig(out=str(out), **{**never, "restarts": 2}))
    assert meta["counts"]["runs_kept_from_before"] == 2 and meta["counts"]["training_runs"] == 4
    assert sorted(p.name for p in (out / "cells").iterdir()) == [
        "attention-d16-T16-lr0.001-r1.json",
        "attention-d16-T16-lr0.001.json",
        "attention-d16-T16-lr0.003-r1.json",
        "attention-d16-T16-lr0.003.json",
    ]
    assert {n: (out / "cells" / n).read_bytes() for n in kept} == kept
    cells = [read_json(p) for p in sorted((out / "cells").iterdir())]
    (row,) = meta["rows"]
    (best,) = [c for c in cells if (c["lr"], c["restart"]) == (row["best_lr"], row["best_restart"])]
    assert row["runs"] == 4 and best["accuracy"] == max(c["accuracy"] for c in cells)

    solved = tmp_path / "solved"
    meta = run_mqar(MqarConfig(out=str(solved), **{**never, "early_stop": 0.0, "restarts": 3}))
    assert [p.name for p in (solved / "cells").iterdir()] == ["attention-d16-T16-lr0.003.json"]
    with pytest.raises(ArSliceError, match="--restarts >= 1"):
        run_mqar(MqarConfig(out=str(tmp_path / "none"), **{**TINY, "restarts": 0}))


def test_learning_rates_scale_inversely_with_the_width(tmp_path):
    """--lrs are the rates of a model --lr-reference-width wide: half as wide trains at twice the
    rate (the cells' files, their records and the table say the rate a model trained at)."""
    out = tmp_path / "m"
    grid = {**TINY, "archs": ["attention"], "d_models": [16, 32], "lrs": [2e-3]}
    meta = run_mqar(MqarConfig(out=str(out), **{**grid, "lr_reference_width": 32}))
    names = sorted(p.name for p in (out / "cells").iterdir())
    assert names == ["attention-d16-T16-lr0.004.json", "attention-d32-T16-lr0.002.json"]
    assert [read_json(out / "cells" / n)["lr"] for n in names] == [0.004, 0.002]
    assert {r["d_model"]: r["best_lr"] for r in meta["rows"]} == {16: 0.004, 32: 0.002}
    with pytest.raises(ArSliceError, match=r"settings.lr_reference_width: 32 -> 64"):
        run_mqar(MqarConfig(out=str(out), **{**grid, "lr_reference_width": 64}))


class SlotZeroOracle:
    """Answers the query of the first key-value slot with its value and every other query with
    the filler token: what a run that solved one slot only does."""

    def hidden_and_head(self, inputs):
        import torch

        vocab = 128
        hidden = torch.zeros(*inputs.shape, vocab)
        hidden[..., 0] = 1.0
        first_key, first_value = inputs[:, 0:1], inputs[:, 1]
        asks = (inputs == first_key).nonzero()
        asks = asks[asks[:, 1] > 0]  # the queries of the first key (not the key itself)
        hidden[asks[:, 0], asks[:, 1]] = 0.0
        hidden[asks[:, 0], asks[:, 1], first_value[asks[:, 0]]] = 1.0
        return hidden, torch.eye(vocab), None

    def eval(self):
        return self

    def train(self):
        return self


def test_each_query_is_scored_by_the_slot_it_asks_for():
    import torch

    x, y = (torch.from_numpy(a) for a in mqar_examples(50, 64, 128, 4, np.random.default_rng(3)))
    slots = query_slots(x, y, 4)
    mask = y != IGNORE
    rows = mask.nonzero()[:, 0]
    # the queried key is that slot's key, and the target that slot's value
    assert torch.equal(x[rows, 2 * slots], x[mask]) and torch.equal(x[rows, 2 * slots + 1], y[mask])
    assert torch.bincount(slots, minlength=4).tolist() == [50, 50, 50, 50]  # each key once a row

    acc, per_slot = slot_accuracy(SlotZeroOracle(), x, y, 16, 4)
    assert (acc, per_slot) == (0.25, [1.0, 0.0, 0.0, 0.0])
    # a trained run records the slots of its best evaluation; their mean is its accuracy
    cfg = MqarConfig(out="unused", **{**TINY, "steps": 3, "eval_every": 1})
    cell = train_cell(cfg, "attention", 16, 64, 1e-3)
    assert len(cell["slot_accuracy"]) == 4
    assert sum(cell["slot_accuracy"]) / 4 == pytest.approx(cell["accuracy"], abs=1e-3)


def test_a_longer_run_first_trains_at_each_curriculum_length_then_is_scored_from_step_0(tmp_path):
    """Its first stage is the run at the first curriculum length (the same initialisation and
    batches, as rotary attention has no parameter of the length); each later stage, its own
    length last, is scored before any step there, and a model that recalls already stops at
    step 0. Lengths that are not shorter than the run's are not stages of it."""
    tiny = {**TINY, "steps": 4, "eval_every": 2, "early_stop": 1.1, "curriculum_lens": [16, 32]}
    cfg = MqarConfig(out="unused", **tiny, attention_positions="rotary")
    short = train_cell(cfg, "attention", 16, 16, 1e-3)
    middle = train_cell(cfg, "attention", 16, 32, 1e-3)
    longer = train_cell(cfg, "attention", 16, 64, 1e-3)
    assert short["curriculum"] == [] and short["history"][0]["step"] == 2
    (stage,) = middle["curriculum"]
    assert (stage["seq_len"], stage["num_kv_pairs"]) == (16, 1)
    assert stage["history"] == short["history"] and stage["accuracy"] == short["accuracy"]
    assert [h["step"] for h in middle["history"]] == [0, 2, 4]
    assert middle["history"][0]["loss"] is None and middle["num_kv_pairs"] == 2
    first, second = longer["curriculum"]
    assert [(s["seq_len"], s["num_kv_pairs"]) for s in (first, second)] == [(16, 1), (32, 2)]
    assert first["history"] == short["history"] and second["history"] == middle["history"]
    assert [h["step"] for h in longer["history"]] == [0, 2, 4] and longer["num_kv_pairs"] == 4

    off = train_cell(replace(cfg, curriculum_lens=[0]), "attention", 16, 32, 1e-3)
    assert off["curriculum"] == [] and [h["step"] for h in off["history"]] == [2, 4]

    at_once = replace(cfg, early_stop=0.0)  # every evaluation "solves" it
    cell = train_cell(at_once, "attention", 16, 64, 1e-3)
    assert [s["stopped_early_at"] for s in cell["curriculum"]] == [2, 0]
    assert (cell["stopped_early_at"], cell["steps_run"], len(cell["history"])) == (0, 0, 1)
    sweep = {**tiny, "archs": ["attention"], "seq_lens": [64], "lrs": [1e-3], "early_stop": 0.0}
    meta = run_mqar(MqarConfig(out=str(tmp_path / "m"), **sweep, attention_positions="rotary"))
    assert meta["counts"]["runs_stopped_early"] == 1  # stopped at step 0 is stopped early
    (row,) = meta["rows"]
    assert (row["steps_run"], row["curriculum_steps"]) == (0, 2)
    with open(tmp_path / "m" / "mqar.csv") as f:
        assert next(csv.DictReader(f))["curriculum_steps"] == "2"
    cell_file = read_json(tmp_path / "m" / "cells" / "attention-d16-T64-lr0.001.json")
    assert [s["seq_len"] for s in cell_file["curriculum"]] == [16, 32]


def test_attention_has_rotary_or_learned_positions_and_a_sweep_keeps_to_one(tmp_path):
    import torch

    learned = build_model("attention", 16, 32, 24)
    rotary = build_model("attention", 16, 32, 24, attention_positions="rotary")
    names = {n for n, _ in rotary.named_parameters()}
    assert not any("position" in n for n in names)
    assert rotary.backbone.layers[0].sequence_mixer.rotary_emb is not None
    assert learned.backbone.embeddings.position_embeddings.weight.shape == (32, 16)
    assert learned.backbone.layers[0].sequence_mixer.rotary_emb is None
    # rotary positions are relative: the model runs at any length, learned ones stop at theirs
    x = torch.from_numpy(mqar_examples(2, 64, 24, 4, np.random.default_rng(0))[0])
    assert rotary(x).shape == (2, 64, 24)
    with pytest.raises(ValueError, match="exceeds the model's 32 positions"):
        learned(x)

    out = tmp_path / "m"
    grid = {**TINY, "archs": ["attention"], "steps": 1}
    run_mqar(MqarConfig(out=str(out), **grid))  # rotary, the default
    with pytest.raises(ArSliceError, match=r'settings.attention_positions: "rotary" -> "learned"'):
        run_mqar(MqarConfig(out=str(out), **grid, attention_positions="learned"))
    with pytest.raises(ArSliceError, match=r"settings.curriculum_lens: \[32, 64\] -> \[0\]"):
        run_mqar(MqarConfig(out=str(out), **grid, curriculum_lens=[0]))
    # an impossible curriculum is refused before any training, naming the length
    for bad, message in (
        ([-1], "--curriculum-lens must be increasing lengths > 0"),
        ([64, 32], r"increasing lengths > 0, or 0 for no curriculum \(got 64 32\)"),
        ([0, 32], "increasing lengths > 0"),
        ([9], "a sequence of 9 tokens"),
    ):
        with pytest.raises(ArSliceError, match=message):
            run_mqar(MqarConfig(out=str(tmp_path / "bad"), **grid, curriculum_lens=bad))
        assert not (tmp_path / "bad").exists()


def test_every_family_builds_and_trains_a_step():
    cfg = MqarConfig(out="unused", **{**TINY, "steps": 1, "eval_every": 1})
    for arch in ("attention", "base_conv", "hyena", "rwkv"):
        cell = train_cell(cfg, arch, 16, 16, 1e-3)
        assert cell["steps_run"] == 1 and 0.0 <= cell["accuracy"] <= 1.0, arch


def test_cli_runs_a_sweep_and_refuses_unknown_families(tmp_path, capsys):
    from pipeline.cli import main

    out = tmp_path / "m"
    argv = ["mqar", "--out", str(out), "--archs", "hyena", "--d-models", "16", "--seq-lens", "16"]
    argv += ["--lrs", "1e-3", "--vocab-size", "24", "--n-test", "16"]
    argv += ["--steps", "2", "--batch-tokens", "128", "--workers", "1", "--no-progress"]
    assert main(argv) == 0
    assert "| 16 (1) | hyena |" in capsys.readouterr().out
    assert (out / "meta.json").is_file() and (out / "mqar.csv").is_file()
    with pytest.raises(SystemExit):
        main(["mqar", "--out", str(out), "--archs", "mamba"])
    assert "invalid choice: 'mamba'" in capsys.readouterr().err


@pytest.mark.slow
def test_two_layer_attention_solves_mqar_at_length_64_after_two_pairs_at_32(one_torch_thread):
    """The task is solvable by the project's own attention and trainer (Zoology Figure 2), with
    the sweep's defaults: d_model 128 with rotary positions finds the recall circuit at length 32
    (2 pairs), then recalls at 64 (4 pairs) within a few hundred steps; from the start at 64 the
    same width stayed near chance for 20000 steps (docs/mqar-probe.md). One thread, as each sweep
    worker runs (~1.5 min; it stops at 99%)."""
    cfg = MqarConfig(out="unused")
    lr, _ = cell_runs(cfg, 128)[0]  # the sweep's first run: 1.5e-3
    cell = train_cell(cfg, "attention", 128, 64, lr)
    (first,) = cell["curriculum"]
    assert first["seq_len"] == 32 and first["accuracy"] >= 0.99, first["history"]
    assert cell["accuracy"] >= 0.99 and cell["steps_run"] <= 400, cell["history"]


@pytest.mark.slow
def test_rotary_attention_solved_at_length_64_recalls_at_128():
    """The curriculum with positions that carry over: d_model 32 at its sweep rate solves length
    64 (4 pairs) after its stage at 32 and then recalls at 128 (8 pairs) with at most a few
    hundred steps there (~2.5 min, one thread). From the start at 128 attention stays near
    chance (docs/mqar-probe.md). Trained as `arslice mqar` trains, with the CPU's own kernels
    (tests/unpinned.py): under the training pin this run's rounding takes it 3,600 steps."""
    lr, _ = cell_runs(MqarConfig(out="unused"), 32)[0]  # 6e-3
    cell = run_unpinned("tests.pipeline.mqar_cell", "attention", "32", "128", repr(lr))
    assert [s["seq_len"] for s in cell["curriculum"]] == [32, 64]
    assert cell["curriculum"][1]["accuracy"] >= 0.99, cell["curriculum"][1]["history"]
    assert cell["accuracy"] >= 0.99 and cell["steps_run"] <= 400, cell["history"]


def test_the_report_shows_a_finished_probe_and_follows_it(tiny_run):  # noqa: F811
    from pipeline.report import ReportConfig, run_report

    report = tiny_run / "report"
    run_report(ReportConfig(run=str(tiny_run), bootstrap=0))
    assert "MQAR" not in (report / "report.md").read_text()
    assert not (report / "mqar.png").exists()

    run_mqar(MqarConfig(out=str(tiny_run / "mqar"), **TINY))
    # no --overwrite: a finished probe is a new input, so the report is rebuilt with it
    run_report(ReportConfig(run=str(tiny_run), bootstrap=0))
    md = (report / "report.md").read_text()
    assert "## MQAR" in md and "| 16 (1) | attention |" in md and "![MQAR](mqar.png)" in md
    assert (report / "mqar.png").read_bytes() == (tiny_run / "mqar" / "mqar.png").read_bytes()
    page = (report / "report.html").read_text()
    assert '<table class="mqar">' in page and "<td>16 (1)</td><td>attention</td>" in page


def test_based_is_a_family_of_the_probe():
    """Based's pair of mixers (short gated convolution, then Taylor linear attention) trains."""
    cfg = MqarConfig(out="unused", **TINY)
    model = build_model("based", 16, 16, cfg.vocab_size)
    mixers = [type(block.sequence_mixer).__name__ for block in model.backbone.layers]
    assert mixers == ["GatedConv", "LinearAttention"]
    cell = train_cell(cfg, "based", 16, 16, 3e-3)
    assert (
        cell["steps_run"] == cfg.steps and np.isfinite([h["loss"] for h in cell["history"]]).all()
    )

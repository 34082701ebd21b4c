"""`arslice verify`: a complete real run passes; each broken invariant is found and named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ar_slicing.errors import ArSliceError
from pipeline.config import printing_summaries
from pipeline.verify import VerifyConfig, verify_run
from tests.reliability import build_run, cli, tiny_run  # noqa: F401  (a fixture)


@pytest.fixture
def run_copy(tiny_run, tmp_path):  # noqa: F811
    dest = tmp_path / "run"
    shutil.copytree(tiny_run["run"], dest)
    return dest


def failures_of(run) -> str:
    with pytest.raises(ArSliceError) as err:
        verify_run(VerifyConfig(run=str(run)))
    return str(err.value)


def rewrite(path, fn):
    """Replace a Parquet file by fn(its table), keeping its schema."""
    table = pq.read_table(path)
    pq.write_table(fn(table).cast(table.schema), path)


def test_a_complete_run_passes(tiny_run, capsys):  # noqa: F811
    with printing_summaries():
        summary = verify_run(VerifyConfig(run=str(tiny_run["run"])))
    out = capsys.readouterr().out
    assert summary["failed"] == 0 and "FAIL" not in out
    for what in ("counts sum to total_pairs", "cover every target exactly once",
                 "one loss row per tag row", "every nll finite", "one tokenizer fingerprint"):  # fmt: skip
        assert what in out
    assert cli("verify", "--run", tiny_run["run"]) == 0


def test_truncated_tokens_bin(run_copy, capsys):
    path = run_copy / "tokens/val/tokens.bin"
    path.write_bytes(path.read_bytes()[:-2])
    assert "tokens.bin" in failures_of(run_copy) and "bytes" in failures_of(run_copy)
    assert cli("verify", "--run", run_copy) == 2
    assert "check(s) failed" in capsys.readouterr().err


def test_counts_not_summing_to_total_pairs(run_copy):
    meta_path = run_copy / "counts/meta.json"
    meta = json.loads(meta_path.read_text())
    meta["total_pairs"] += 1
    meta_path.write_text(json.dumps(meta))
    assert "counts sum to total_pairs" in failures_of(run_copy)


def test_unsorted_or_duplicated_bigrams(run_copy):
    path = run_copy / "counts/bigrams.parquet"
    original = pq.read_table(path)
    rewrite(path, lambda t: pa.concat_tables([t.slice(1, 1), t.slice(0, 1), t.slice(2)]))
    assert "sorted and unique" in failures_of(run_copy)
    rewrite(path, lambda t: pa.concat_tables([original.slice(0, 1), original]))
    message = failures_of(run_copy)
    assert "sorted and unique" in message and "distinct_bigrams" in message


def test_missing_and_duplicated_tag_rows(run_copy):
    part = run_copy / "tags/tags-00000.parquet"
    original = pq.read_table(part)
    rewrite(part, lambda t: pa.concat_tables([t.slice(0, 10), t.slice(11)]))
    assert "exactly once" in failures_of(run_copy)
    rewrite(part, lambda t: pa.concat_tables([original.slice(0, 11), original.slice(10)]))
    assert "not strictly increasing" in failures_of(run_copy)


def test_wrong_ar_hit_and_train_count(run_copy):
    part = run_copy / "tags/tags-00000.parquet"

    def flip(t):
        hit = t.column("is_ar_hit").to_numpy(zero_copy_only=False).copy()
        hit[5] = not hit[5]
        counts = t.column("train_count").to_numpy().copy()
        counts[7] += 1
        t = t.set_column(t.schema.get_field_index("is_ar_hit"), "is_ar_hit", pa.array(hit))
        return t.set_column(
            t.schema.get_field_index("train_count"), "train_count", pa.array(counts)
        )

    rewrite(part, flip)
    message = failures_of(run_copy)
    assert "is_ar_hit of every row" in message and "train_count of every row" in message


def test_repeat_pointing_at_another_bigram(run_copy):
    part = run_copy / "tags/tags-00000.parquet"

    def shift(t):
        prev_pos = t.column("prev_pos").to_pylist()
        pos = t.column("pos").to_pylist()
        # the first repeat whose position just before its prev_pos holds another bigram
        i = next(k for k, p in enumerate(prev_pos) if p is not None and p > 1)
        prev_pos[i] -= 1
        assert pos[i] > prev_pos[i]
        return t.set_column(t.schema.get_field_index("prev_pos"), "prev_pos", pa.array(prev_pos))

    rewrite(part, shift)
    assert "prev_pos of every row" in failures_of(run_copy)


def _set(t, name, values, type_=None):
    return t.set_column(t.schema.get_field_index(name), name, pa.array(values, type_))


def test_a_tagger_that_misses_a_repeat_is_caught(run_copy):
    """A repeat written as a non-repeat (consistently: no prev_pos, no AR hit) breaks no row's
    own rule; only the definition, recomputed from the stream, finds it."""
    part = run_copy / "tags/tags-00000.parquet"

    def forget_one(t):
        rep = t.column("is_repeat").to_pylist()
        i = rep.index(True)
        prev_pos, hit = t.column("prev_pos").to_pylist(), t.column("is_ar_hit").to_pylist()
        rep[i], prev_pos[i], hit[i] = False, None, False
        t = _set(t, "is_repeat", rep)
        t = _set(t, "is_ar_hit", hit)
        return _set(t, "prev_pos", prev_pos, pa.int32())

    rewrite(part, forget_one)
    assert "the latest earlier occurrence, from the stream" in failures_of(run_copy)


def test_prev_pos_at_an_older_occurrence_is_caught(run_copy):
    """A repeat whose prev_pos names an earlier occurrence of its bigram, but not the latest."""
    part = run_copy / "tags/tags-00000.parquet"

    def point_further_back(t):
        prev_pos = t.column("prev_pos").to_pylist()
        window, pos = t.column("window_id").to_pylist(), t.column("pos").to_pylist()
        where = {(window[k], pos[k]): k for k in range(len(pos))}
        # a repeat whose previous occurrence is itself a repeat: its prev_pos has an older one
        for i, p in enumerate(prev_pos):
            j = where.get((window[i], p)) if p is not None else None
            if j is not None and prev_pos[j] is not None:
                prev_pos[i] = prev_pos[j]
                return _set(t, "prev_pos", prev_pos, pa.int32())
        raise AssertionError("no bigram occurs three times in one window of the fixture")

    rewrite(part, point_further_back)
    message = failures_of(run_copy)
    assert "the latest earlier occurrence, from the stream" in message
    assert "prev_pos of every row" not in message  # the row's own rule still holds


def test_tags_from_another_run(run_copy, tmp_path, bpe_tokenizer_path):
    """Tags of another validation store (same tokenizer) put into this run."""
    other = build_run(tmp_path / "other", bpe_tokenizer_path, n_train=3, n_val=2)["run"]
    shutil.rmtree(run_copy / "tags")
    shutil.copytree(other / "tags", run_copy / "tags")
    message = failures_of(run_copy)
    assert "tags from another run" in message


def test_missing_loss_rows_and_non_finite_losses(run_copy):
    part = sorted((run_copy / "losses/attention").glob("losses-*.parquet"))[-1]
    original = pq.read_table(part)
    rewrite(part, lambda t: t.slice(0, t.num_rows - 1))
    assert "one loss row per tag row" in failures_of(run_copy)

    def poison(t):
        nll = t.column("nll").to_numpy().copy()
        nll[3] = np.nan
        return t.set_column(t.schema.get_field_index("nll"), "nll", pa.array(nll))

    rewrite(part, lambda t: poison(original))
    message = failures_of(run_copy)
    assert "every nll finite" in message and "NaN" in message
    assert "one loss row per tag row" not in message


def test_truncated_parts_are_failures_naming_each_file(run_copy, capsys):
    """A part cut short is a FAIL line naming it and why, for every such part; verify goes on to
    the other checks (the losses are still checked against the window table)."""
    tag_part = run_copy / "tags/tags-00000.parquet"
    loss_part = sorted((run_copy / "losses/attention").glob("losses-*.parquet"))[2]
    for part in (tag_part, loss_part):
        data = part.read_bytes()
        part.write_bytes(data[: len(data) // 2])
    assert cli("verify", "--run", run_copy) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    fails = [line for line in captured.out.splitlines() if "FAIL" in line]
    assert [line.split("FAIL  ")[1].split(":")[0] for line in fails] == [
        str(tag_part),
        str(loss_part),
    ]
    for line in fails:
        assert "not a whole Parquet file (Parquet magic bytes not found in footer)" in line
    assert "one tokenizer fingerprint" in captured.out  # the checks after them still ran


def test_fingerprint_disagreement_names_both(run_copy):
    meta_path = run_copy / "losses/attention/meta.json"
    meta = json.loads(meta_path.read_text())
    meta["fingerprint"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    message = failures_of(run_copy)
    assert "fingerprints differ" in message and "000000000000" in message
    assert "losses/attention" in message and "tags" in message


def test_incomplete_outputs_are_noted_not_failed(run_copy, capsys):
    (run_copy / "losses/attention/meta.json").unlink()
    summary = verify_run(VerifyConfig(run=str(run_copy)))
    assert any("losses/attention" in n and "incomplete" in n for n in summary["notes"])

"""The probes' definitions (docs/design.md, "Probes of a checkpoint"): the worked examples pinned,
the sequences each probe draws (layout, seeds, special tokens), the bootstrap intervals, and the
long tables read back from Parquet by DuckDB. The models' side is tests/pipeline/test_probe_forward.py."""

from __future__ import annotations

import math

import duckdb
import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.analysis.probes import (
    ProbeSizes,
    icl_positions,
    icl_score,
    induction_curve,
    induction_schema,
    induction_score,
    induction_sequences,
    induction_table,
    loss_by_position,
    probe_sequences,
    probe_vocabulary,
    recall_by_distance,
    recall_by_k,
    recall_schema,
    recall_sequences,
    recall_table,
    run_probes,
    tokenizer_probe_vocabulary,
)
from ar_slicing.analysis.probes.sequences import InductionSequences, RecallSequences
from ar_slicing.errors import ArSliceError

# ---- the worked examples ------------------------------------------------------------------------

# Induction: n = 3 after the prefix 0, two sequences; the model reads `0 7 2 9 7 2 9`
INDUCTION_TOKENS = np.array([[0, 7, 2, 9, 7, 2, 9], [0, 4, 8, 5, 4, 8, 5]])
INDUCTION_NLL = np.array([[4.0, 3.0, 3.5, 3.2, 0.5, 0.1], [4.1, 2.0, 4.0, 3.0, 1.5, 0.5]])
INDUCTION_ARGMAX = np.array([[1, 1, 1, 1, 2, 9], [1, 1, 1, 1, 8, 1]])

# Recall: k = 2 pairs (5 -> 8), (3 -> 6), queried in the order pair 2, pair 1: `0 5 8 3 6 3 6 5 8`
RECALL_TOKENS = np.array([[0, 5, 8, 3, 6, 3, 6, 5, 8]])
RECALL_ORDER = np.array([[1, 0]])
RECALL_NLL = np.array([[7.0, 6.5, 7.5, 6.0, 7.2, 0.2, 7.1, 2.0]])
RECALL_ARGMAX = np.array([[1, 1, 1, 1, 1, 6, 1, 3]])


def worked_induction():
    seqs = InductionSequences(INDUCTION_TOKENS, prefix=0, n=3)
    return induction_table(seqs, INDUCTION_NLL, INDUCTION_ARGMAX)


def worked_recall():
    seqs = RecallSequences(RECALL_TOKENS, prefix=0, k=2, order=RECALL_ORDER)
    return recall_table([(seqs, RECALL_NLL, RECALL_ARGMAX)])


def test_induction_score_follows_its_worked_example():
    table = worked_induction()
    rows = pl.from_arrow(table).filter(pl.col("seq_id") == 0)
    assert rows["pos"].to_list() == [1, 2, 3, 4, 5, 6]
    assert rows["token"].to_list() == [7, 2, 9, 7, 2, 9]
    assert rows["copy"].to_list() == [1, 1, 1, 2, 2, 2]
    # x_1 of each copy is in the curve, not in the score
    assert rows["scored"].to_list() == [False, True, True, False, True, True]
    got = induction_score(table, n_bootstrap=200, seed=0)
    # sequence 0: (3.0 + 3.5)/2 - (0.5 + 0.1)/2 = 2.95; sequence 1: 3.0 - 1.0 = 2.0
    assert got["first_nll"] == pytest.approx(3.125)
    assert got["second_nll"] == pytest.approx(0.65)
    assert got["score"] == pytest.approx(2.475)
    assert got["second_accuracy"] == pytest.approx(3 / 4)  # 2 and 9 of sequence 0, 8 of 1
    assert (got["sequences"], got["n"]) == (2, 3)
    # two sequences: every resample scores 2.0, 2.475 or 2.95
    assert 2.0 - 1e-6 <= got["score_lo"] <= got["score"] <= got["score_hi"] <= 2.95 + 1e-6
    curve = induction_curve(table)
    assert curve["pos"].to_list() == [1, 2, 3, 4, 5, 6]
    assert curve["mean_nll"].to_list() == pytest.approx([4.05, 2.5, 3.75, 3.1, 1.0, 0.3])
    assert curve["accuracy"].to_list() == pytest.approx([0, 0, 0, 0, 1.0, 0.5])


def test_induction_without_a_prefix_has_no_row_for_the_first_token():
    seqs = InductionSequences(INDUCTION_TOKENS[:, 1:], prefix=None, n=3)
    table = induction_table(seqs, INDUCTION_NLL[:, 1:], INDUCTION_ARGMAX[:, 1:])
    assert pl.from_arrow(table).filter(pl.col("seq_id") == 0)["pos"].to_list() == [2, 3, 4, 5, 6]
    # the same counted positions, so the same score as after a prefix
    assert induction_score(table, n_bootstrap=0)["score"] == pytest.approx(2.475)


def test_recall_follows_its_worked_example():
    table = worked_recall()
    rows = pl.from_arrow(table)
    assert rows["pos"].to_list() == list(range(1, 9))
    assert (
        rows["role"].to_list() == ["pair_key", "pair_value"] * 2 + ["query_key", "query_value"] * 2
    )
    assert rows["pair"].to_list() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert rows["distance"].to_list() == [None] * 4 + [2, 2, 6, 6]
    by_k = recall_by_k(table, head_rows=2048, n_bootstrap=100).row(0, named=True)
    assert (by_k["k"], by_k["sequences"], by_k["queries"]) == (2, 1, 2)
    assert by_k["accuracy"] == pytest.approx(0.5)  # 6 after key 3; 3, not 8, after key 5
    assert by_k["nll"] == pytest.approx(1.1)
    assert by_k["pair_value_nll"] == pytest.approx((6.5 + 6.0) / 2)
    assert by_k["chance_accuracy"] == pytest.approx(1 / 2048)
    assert by_k["chance_nll"] == pytest.approx(math.log(2048))  # 7.625
    assert (by_k["guess_accuracy"], by_k["guess_nll"]) == pytest.approx((0.5, math.log(2)))
    by_distance = recall_by_distance(table)
    assert by_distance["distance"].to_list() == [2, 6]
    assert by_distance["accuracy"].to_list() == [1.0, 0.0]
    assert by_distance["nll"].to_list() == pytest.approx([0.2, 2.0])


def worked_token_losses() -> pl.DataFrame:
    """Three windows of L = 256 (early 6, late 63): windows 0 and 1 reach 63, window 2 stops at
    40 (a short last window), so it counts at neither position."""
    rows = []
    special = {(0, 6): 3.0, (1, 6): 3.4, (2, 6): 9.0, (0, 63): 2.2, (1, 63): 2.0}
    for w, last in ((0, 70), (1, 64), (2, 40)):
        for pos in range(1, last + 1):
            rows.append((w, pos, special.get((w, pos), 1.0), (w, pos) == (1, 63)))
    return pl.DataFrame(rows, schema=["window_id", "pos", "nll", "is_ar_hit"], orient="row")


def test_icl_score_follows_its_worked_example():
    assert icl_positions(2048) == (50, 500)  # Olsson et al.'s
    assert icl_positions(256) == (6, 63)
    assert icl_positions(1024) == (25, 250)
    got = {
        r["slice"]: r
        for r in icl_score(worked_token_losses(), 256, n_bootstrap=100).rows(named=True)
    }
    assert got["all"]["windows"] == 2
    assert (got["all"]["nll_late"], got["all"]["nll_early"]) == pytest.approx((2.1, 3.2))
    assert got["all"]["score"] == pytest.approx(-1.1)
    assert got["other"]["score"] == pytest.approx(2.2 - 3.2)
    assert got["ar"]["tokens_early"] == 0 and got["ar"]["score"] is None  # no AR hit at pos 6
    assert got["all"]["score_lo"] <= got["all"]["score"] <= got["all"]["score_hi"]
    with pytest.raises(ArSliceError, match="too short"):
        icl_positions(4)


def test_loss_by_position_counts_every_window_at_the_positions_it_has():
    curve = loss_by_position(worked_token_losses())
    at = {(r["slice"], r["pos"]): r for r in curve.rows(named=True)}
    assert at[("all", 6)]["tokens"] == 3
    assert at[("all", 6)]["mean_nll"] == pytest.approx((3.0 + 3.4 + 9.0) / 3)
    assert at[("ar", 63)]["mean_nll"] == pytest.approx(2.0)
    assert at[("other", 63)]["mean_nll"] == pytest.approx(2.2)
    assert at[("all", 70)]["tokens"] == 1
    assert curve["slice"].unique(maintain_order=True).to_list() == ["all", "ar", "other"]
    two = pl.concat([worked_token_losses().with_columns(model=pl.lit(m)) for m in ("a", "b")])
    assert loss_by_position(two).filter(pl.col("model") == "b")["mean_nll"].to_list() == (
        curve["mean_nll"].to_list()
    )


# ---- the sequences -------------------------------------------------------------------------------


@given(
    vocab_size=st.integers(4, 300),
    special=st.sets(st.integers(0, 299), max_size=8),
    seed=st.integers(0, 2**32 - 1),
    prefix=st.sampled_from([None, 0]),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_sequences_draw_distinct_non_special_ids_in_the_stated_layout(
    vocab_size, special, seed, prefix, data
):
    special -= {0, 1, 2, 3}  # keep at least four ids
    vocab = probe_vocabulary(vocab_size, special)
    drawable = set(vocab.ids.tolist())
    assert drawable == set(range(vocab_size)) - special
    n = data.draw(st.integers(2, len(drawable)))
    k = data.draw(st.integers(1, len(drawable) // 2))
    ind = induction_sequences(vocab, n, 3, seed, prefix)
    body = ind.tokens if prefix is None else ind.tokens[:, 1:]
    assert prefix is None or (ind.tokens[:, 0] == prefix).all()
    assert body.shape == (3, 2 * n)
    assert (body[:, :n] == body[:, n:]).all()
    for row in body[:, :n]:
        assert len(set(row.tolist())) == n and set(row.tolist()) <= drawable
    rec = recall_sequences(vocab, k, 3, seed, prefix)
    body = rec.tokens if prefix is None else rec.tokens[:, 1:]
    assert body.shape == (3, 4 * k)
    for row, order in zip(body, rec.order):
        keys, values = row[0 : 2 * k : 2], row[1 : 2 * k : 2]
        assert len(set(row[: 2 * k].tolist())) == 2 * k and set(row.tolist()) <= drawable
        assert sorted(order.tolist()) == list(range(k))
        assert (row[2 * k :: 2] == keys[order]).all() and (
            row[2 * k + 1 :: 2] == values[order]
        ).all()


def test_the_same_vocabulary_draws_the_same_sequences_whatever_the_model():
    sizes = ProbeSizes(
        induction_length=8, induction_sequences=5, recall_pairs=(1, 3), recall_queries=6
    )
    # two models of one tokenizer: heads padded to 64 and to 40 rows draw the same ids
    a = probe_sequences(probe_vocabulary(40, [0], head_rows=64), sizes, seed=7)
    b = probe_sequences(probe_vocabulary(40, [0], head_rows=40), sizes, seed=7)
    assert a.digest == b.digest
    assert (a.induction.tokens == b.induction.tokens).all()
    assert all((x.tokens == y.tokens).all() for x, y in zip(a.recall, b.recall))
    assert probe_sequences(probe_vocabulary(40, [0]), sizes, seed=8).digest != a.digest
    # another vocabulary: its own draw, from its own ids, the same every time
    other = probe_vocabulary(50, [0, 49])
    c = probe_sequences(other, sizes, seed=7)
    assert c.digest == probe_sequences(other, sizes, seed=7).digest != a.digest
    assert set(np.unique(c.induction.tokens).tolist()) <= set(other.ids.tolist())
    # more sequences begin with the fewer; another k leaves a k's sequences as they were
    more = ProbeSizes(
        induction_length=8, induction_sequences=9, recall_pairs=(3, 2), recall_queries=6
    )
    d = probe_sequences(probe_vocabulary(40, [0]), more, seed=7)
    assert (d.induction.tokens[:5] == a.induction.tokens).all()
    assert (d.recall[0].tokens == a.recall[1].tokens).all()  # k = 3
    # sizes: ceil(queries / k) sequences of each k
    assert [len(r.tokens) for r in a.recall] == [6, 2]


def test_special_tokens_of_a_tokenizer_are_never_drawn(bpe_tokenizer_path):
    from tokenizers import AddedToken

    from ar_slicing.data.tokenizer import load_tokenizer

    tok = load_tokenizer(bpe_tokenizer_path)
    tok.add_special_tokens([AddedToken("<pad>", special=True)])
    tok.add_tokens(["plain_added"])  # added, not special: drawable
    vocab = tokenizer_probe_vocabulary(tok, head_rows=2048)
    specials = {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<pad>")}
    assert vocab.ids.size == tok.get_vocab_size(with_added_tokens=True) - 2
    assert not specials & set(vocab.ids.tolist())
    assert tok.token_to_id("plain_added") in vocab.ids
    seqs = probe_sequences(vocab, ProbeSizes(induction_length=500, induction_sequences=8), seed=0)
    drawn = set(np.unique(seqs.induction.tokens).tolist())
    for r in seqs.recall:
        drawn |= set(np.unique(r.tokens).tolist())
    assert not drawn & specials and drawn <= set(vocab.ids.tolist())


def test_impossible_sizes_are_refused_by_name():
    vocab = probe_vocabulary(10, [0])
    with pytest.raises(ArSliceError, match="induction length 10"):
        induction_sequences(vocab, 10, 1, 0)
    with pytest.raises(ArSliceError, match="5 key-value pairs: 10 distinct ids"):
        recall_sequences(vocab, 5, 1, 0)
    with pytest.raises(ArSliceError, match="every id .* is special"):
        probe_vocabulary(2, [0, 1])
    with pytest.raises(ArSliceError, match="prefix token 12"):
        probe_sequences(vocab, ProbeSizes(induction_length=4, recall_pairs=(2,)), prefix=12)
    seqs = InductionSequences(INDUCTION_TOKENS, prefix=0, n=3)
    with pytest.raises(ArSliceError, match="non-finite NLL"):
        induction_table(seqs, np.where(INDUCTION_NLL > 4, np.nan, INDUCTION_NLL), INDUCTION_ARGMAX)
    with pytest.raises(ArSliceError, match="nll of shape"):
        induction_table(seqs, INDUCTION_NLL[:, 1:], INDUCTION_ARGMAX)


# ---- bootstrap, and the tables as Parquet --------------------------------------------------------


def lookup_scores(copy_from: float, noise_seed: int):
    """A scorer that knows the answer with probability `copy_from` wherever the token occurred
    before in the row (NLL 0.1 there, else ~4): a stand-in for a model, to exercise the tables."""
    rng = np.random.default_rng(noise_seed)

    def score(rows: np.ndarray):
        nll = rng.normal(4.0, 0.5, size=(rows.shape[0], rows.shape[1] - 1))
        argmax = np.zeros_like(nll, dtype=np.int64)
        for i, row in enumerate(rows):
            for j in range(1, rows.shape[1]):
                prev = np.flatnonzero(row[: j - 1] == row[j - 1])  # the previous token seen before
                if prev.size and row[prev[-1] + 1] == row[j] and rng.random() < copy_from:
                    nll[i, j - 1], argmax[i, j - 1] = 0.1, row[j]
        return nll, argmax

    return score


def test_bootstrap_interval_holds_the_score_and_is_reproducible():
    vocab = probe_vocabulary(500, [0])
    sizes = ProbeSizes(
        induction_length=20, induction_sequences=40, recall_pairs=(2, 4), recall_queries=40
    )
    tables = run_probes(lookup_scores(0.7, 1), vocab, sizes, seed=3, prefix=0)
    a = induction_score(tables.induction, n_bootstrap=300, seed=5)
    assert a["score_lo"] < a["score"] < a["score_hi"]
    assert a == induction_score(tables.induction, n_bootstrap=300, seed=5)
    other = induction_score(tables.induction, n_bootstrap=300, seed=6)
    assert other["score"] == a["score"] and (other["score_lo"], other["score_hi"]) != (
        a["score_lo"],
        a["score_hi"],
    )
    by_k = recall_by_k(tables.recall, vocab.head_rows, n_bootstrap=300, seed=5)
    assert (by_k["accuracy_lo"] <= by_k["accuracy"]).all()
    assert (by_k["accuracy"] <= by_k["accuracy_hi"]).all()
    assert by_k.equals(recall_by_k(tables.recall, vocab.head_rows, n_bootstrap=300, seed=5))


def test_tables_keep_their_schema_in_parquet_and_duckdb_computes_the_same_scores(tmp_path):
    vocab = probe_vocabulary(300, [0])
    sizes = ProbeSizes(
        induction_length=10, induction_sequences=12, recall_pairs=(1, 4), recall_queries=16
    )
    tables = run_probes(lookup_scores(0.8, 2), vocab, sizes, seed=0, prefix=0)
    pq.write_table(tables.induction, tmp_path / "induction.parquet")
    pq.write_table(tables.recall, tmp_path / "recall.parquet")
    assert pq.read_schema(tmp_path / "induction.parquet").equals(induction_schema())
    assert pq.read_schema(tmp_path / "recall.parquet").equals(recall_schema())
    con = duckdb.connect()
    score = con.execute(
        """
        WITH s AS (
            SELECT seq_id, avg(nll) FILTER (WHERE copy = 1) AS first,
                   avg(nll) FILTER (WHERE copy = 2) AS second
            FROM read_parquet($path) WHERE scored GROUP BY seq_id)
        SELECT avg(first - second) FROM s
        """,
        {"path": str(tmp_path / "induction.parquet")},
    ).fetchone()[0]
    assert score == pytest.approx(induction_score(tables.induction, n_bootstrap=0)["score"])
    accuracy = con.execute(
        """
        SELECT k, avg((argmax = token)::DOUBLE), count(*) FROM read_parquet($path)
        WHERE role = 'query_value' GROUP BY k ORDER BY k
        """,
        {"path": str(tmp_path / "recall.parquet")},
    ).fetchall()
    by_k = recall_by_k(tables.recall, vocab.head_rows, n_bootstrap=0)
    assert [r[0] for r in accuracy] == by_k["k"].to_list() == [1, 4]
    assert [r[1] for r in accuracy] == pytest.approx(by_k["accuracy"].to_list())
    assert [r[2] for r in accuracy] == by_k["queries"].to_list() == [16, 16]
    # the stand-in copies: recall and induction both well above their no-copy values
    assert score > 2.0 and (by_k["accuracy"] > 0.5).all()
    assert len(np.unique(pl.from_arrow(tables.recall)["seq_id"])) == 16 + 4

"""The probes' model side (docs/design.md, "Probes of a checkpoint"): `score_rows` runs models
loaded by `load_model` through the eval stage's forward and returns each position's NLL and the
id the head ranks first, as the model's own logits give them; a hand-set GPT-2 that copies scores
the maximum, a model that ignores its input scores 0, a uniform one the stated baseline."""

from __future__ import annotations

import functools
import math

import numpy as np
import polars as pl
import pytest

from ar_slicing.analysis.probes import (
    ProbeSizes,
    induction_curve,
    induction_score,
    probe_sequences,
    probe_vocabulary,
    recall_by_k,
    run_probes,
)
from models import load_model
from pipeline.eval.forward import score_rows
from tests.handset_models import copying_gpt2, uniform_gpt2, unigram_gpt2
from tests.tiny_models import save_native_lm, save_neox

torch = pytest.importorskip("torch")

V = 32  # id 0 is the special token: the prefix, never drawn
SIZES = ProbeSizes(
    induction_length=12, induction_sequences=16, recall_pairs=(1, 3, 8), recall_queries=24
)


@pytest.fixture(scope="module")
def handset(tmp_path_factory, one_torch_thread):
    """The hand-set GPT-2s saved with save_pretrained, as load_model reads any hf: directory."""
    root = tmp_path_factory.mktemp("handset")
    out = {}
    for name, build in (
        ("copying", copying_gpt2),
        ("unigram", unigram_gpt2),
        ("uniform", uniform_gpt2),
    ):
        build(V).save_pretrained(root / name)
        out[name] = f"hf:{root / name}"
    return out


def probe(spec: str, batch_size="auto"):
    loaded = load_model(spec)
    vocab = probe_vocabulary(V, [0], head_rows=loaded.vocab_size)
    score = functools.partial(score_rows, loaded, device="cpu", dtype="fp32", batch_size=batch_size)
    return run_probes(score, vocab, SIZES, seed=0, prefix=0)


def test_a_model_that_copies_scores_the_maximum(handset):
    tables = probe(handset["copying"])
    got = induction_score(tables.induction, n_bootstrap=100)
    # uniform where nothing can be copied (ln V), certain where the token repeats
    assert got["first_nll"] == pytest.approx(math.log(V), abs=1e-4)
    assert got["second_nll"] < 1e-4 and got["second_accuracy"] == 1.0
    assert got["score"] == pytest.approx(math.log(V), abs=1e-4)
    curve = induction_curve(tables.induction)
    n = SIZES.induction_length
    # x_1 of the second copy follows x_n, a bigram never seen: the copier cannot know it
    assert curve.filter(pl.col("pos") == n + 1)["mean_nll"][0] == pytest.approx(
        math.log(V), abs=1e-4
    )
    by_k = recall_by_k(tables.recall, V, n_bootstrap=100)
    assert by_k["k"].to_list() == [1, 3, 8]
    assert by_k["accuracy"].to_list() == [1.0, 1.0, 1.0]
    assert (by_k["nll"] < 1e-4).all()
    assert by_k["pair_value_nll"].to_list() == pytest.approx([math.log(V)] * 3, abs=1e-4)


def test_a_model_that_ignores_its_input_scores_zero(handset):
    tables = probe(handset["unigram"])
    # another model of the same vocabulary reads exactly the same sequences
    copier = probe(handset["copying"])
    assert tables.sequences_digest == copier.sequences_digest
    for ours, theirs in ((tables.induction, copier.induction), (tables.recall, copier.recall)):
        assert ours.select(["seq_id", "pos", "token"]).equals(
            theirs.select(["seq_id", "pos", "token"])
        )
    got = induction_score(tables.induction, n_bootstrap=100)
    assert got["first_nll"] > 3.0  # a real, non-uniform distribution: ln 32 = 3.47
    assert abs(got["score"]) < 1e-5
    recall = pl.from_arrow(tables.recall)
    assert recall["argmax"].n_unique() == 1  # the same prediction everywhere
    # each value costs at its query what it costs where its pair states it
    by_k = recall_by_k(tables.recall, V, n_bootstrap=0)
    assert by_k["nll"].to_list() == pytest.approx(by_k["pair_value_nll"].to_list(), abs=1e-5)


def test_a_uniform_model_scores_the_stated_random_token_baseline(handset):
    tables = probe(handset["uniform"])
    for table in (tables.induction, tables.recall):
        nll = pl.from_arrow(table)["nll"].to_numpy()
        assert nll == pytest.approx(np.full(nll.shape, math.log(V)), abs=1e-5)
    by_k = recall_by_k(tables.recall, V, n_bootstrap=0)
    assert by_k["nll"].to_list() == pytest.approx(by_k["chance_nll"].to_list(), abs=1e-5)
    # every logit ties: the argmax is id 0, the special token no probe draws
    assert by_k["accuracy"].to_list() == [0.0, 0.0, 0.0]
    assert induction_score(tables.induction, n_bootstrap=0)["score"] == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("family", ["neox", "attention", "base_conv", "hyena", "rwkv"])
def test_score_rows_gives_the_models_own_nll_and_argmax(tmp_path, family, one_torch_thread):
    """Through load_model and the eval stage's forward, against the logits of the model's own
    forward: the transformers model's, or this project's LanguageModel's."""
    vocab = 300
    if family == "neox":
        save_neox(tmp_path / "m", vocab, initializer_range=0.3)
        spec = f"hf:{tmp_path / 'm'}"
    else:
        options = {"filter_order": 16} if family == "hyena" else {}
        save_native_lm(tmp_path / "m", vocab, mixer=family, l_max=64, spread=1.0, **options)
        spec = f"native:{tmp_path / 'm'}"
    loaded = load_model(spec)
    seqs = probe_sequences(probe_vocabulary(vocab, [0], loaded.vocab_size), SIZES, seed=1, prefix=0)
    rows = seqs.induction.tokens[:5]
    nll, top = score_rows(loaded, rows, "cpu", "fp32", batch_size=2)
    with torch.no_grad():
        out = loaded.model(torch.from_numpy(rows[:, :-1]))
        logits = (out.logits if hasattr(out, "logits") else out).float()
    want_nll = -torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(rows[:, 1:])[..., None])
    assert nll == pytest.approx(want_nll[..., 0].numpy(), abs=2e-5)
    assert (top == logits.argmax(-1).numpy()).all()
    assert len(np.unique(top)) > 3  # a model whose predictions differ from place to place
    one_by_one = [score_rows(loaded, r[None], "cpu", "fp32", batch_size=1) for r in rows]
    assert np.concatenate([n for n, _ in one_by_one]) == pytest.approx(nll, abs=1e-5)


def test_tiled_and_chunked_heads_agree_on_the_argmax_and_ties_keep_the_lowest_id():
    from models.nll import chunked_nll, tiled_nll

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=gen)
    head = torch.randn(3000, 16, generator=gen)  # three vocabulary tiles of 1024
    head[2500] = head[40] = head[1500] = 10 * hidden[0, 3]  # a three-way tie at (0, 3)
    bias = torch.zeros(3000)
    targets = torch.randint(0, 3000, (2, 7), generator=gen)
    targets[1, 2] = -1  # ignored: NLL 0, argmax still given
    nll_t, top_t = tiled_nll(hidden, head, bias, targets, rows=5, with_argmax=True)
    nll_c, top_c = chunked_nll(hidden, head, bias, targets, chunk_size=4, with_argmax=True)
    logits = hidden @ head.T
    assert (top_t == logits.argmax(-1)).all() and (top_c == logits.argmax(-1)).all()
    assert top_t[0, 3] == 40
    assert torch.allclose(nll_t, nll_c, atol=1e-4)
    assert torch.equal(nll_t, tiled_nll(hidden, head, bias, targets, rows=5))

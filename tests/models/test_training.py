"""End to end on real text: a tiny LM learns stdlib source, survives save/load, and scores the same."""

from __future__ import annotations

import pytest
import torch

from models import load_model
from models.checkpoints.native import save_native
from models.mixers.rwkv import wkv_chunked, wkv_sequential
from models.nll import per_token_nll
from tests.tiny_models import tiny_mixer_lm

# tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def token_stream(bpe_tokenizer, stdlib_texts) -> torch.Tensor:
    eos = bpe_tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for text in stdlib_texts[:8]:
        ids += bpe_tokenizer.encode(text).ids + [eos]
    return torch.tensor(ids)


def train_and_score(mixer, token_stream, tmp_path, bpe_tokenizer_path, steps=40, seq=64):
    model = tiny_mixer_lm(mixer, 1024, d_model=48, l_max=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    held_out = token_stream[-(4 * (seq + 1)) :].view(4, seq + 1)
    train = token_stream[: -(4 * (seq + 1))]

    def held_out_loss():
        model.eval()
        with torch.no_grad():
            loss = model(held_out[:, :-1], held_out[:, 1:]).item()
        model.train()
        return loss

    before = held_out_loss()
    for _ in range(steps):
        starts = torch.randint(0, len(train) - seq - 1, (8,), generator=g)
        batch = torch.stack([train[s : s + seq + 1] for s in starts.tolist()])
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = held_out_loss()

    save_native(model.eval(), tmp_path / mixer, tokenizer_json=bpe_tokenizer_path)
    loaded = load_model(f"native:{tmp_path / mixer}")
    nll = per_token_nll(loaded, held_out[:, :-1], held_out[:, 1:], chunk_size=37)
    with torch.no_grad():
        per_token = model(held_out[:, :-1], held_out[:, 1:], loss_reduction="none")
    return before, after, nll, per_token


def check(before, after, nll, per_token):
    assert after < before - 0.5, (before, after)  # it learned something about Python source
    torch.testing.assert_close(nll, per_token, atol=1e-4, rtol=1e-4)
    assert abs(nll.mean().item() - after) < 1e-4


def test_attention_lm_learns_real_text_and_scores_the_same_after_reload(
    token_stream, tmp_path, bpe_tokenizer_path
):
    check(*train_and_score("attention", token_stream, tmp_path, bpe_tokenizer_path))


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["base_conv", "hyena", "rwkv"])
def test_every_mixer_learns_real_text(mixer, token_stream, tmp_path, bpe_tokenizer_path):
    check(*train_and_score(mixer, token_stream, tmp_path, bpe_tokenizer_path, steps=80))


@pytest.mark.slow
def test_chunked_wkv_at_evaluation_length():
    torch.manual_seed(0)
    td = torch.linspace(-6, 6, 96)  # decays from ~0 to ~400 per step
    tf = torch.randn(96)
    k, v = torch.randn(2, 2048, 96) * 4, torch.randn(2, 2048, 96)
    ref = wkv_sequential(td.double(), tf.double(), k.double(), v.double())
    torch.testing.assert_close(wkv_chunked(td, tf, k, v).double(), ref, atol=2e-5, rtol=1e-4)

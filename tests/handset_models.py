"""transformers GPT-2 models whose weights are set by hand, for the probes' tests: one that copies
(a previous-token head and an induction head, Olsson et al. 2022's circuit, written out), one
whose output ignores its input (a unigram model) and one uniform over its head.

The copier's residual stream is a set of one-hot slots, each stored as +1 in one coordinate and
-1 in a mirror coordinate, so every position's residual has mean 0 and a norm that depends only on
how many slots are filled: a LayerNorm then only scales it, by a factor the weights compensate.

    TOK   the current token            (embedding)
    POS   the current position         (position embedding)
    PREV  the previous token           (written by layer 0's head: attend to t - 1, copy TOK)
    PRED  the token to predict         (written by layer 1's head: attend to the s whose PREV is
                                        this TOK, copy its TOK; else attend to position 0, the sink)
    CONST always 0 in the residual; the LayerNorm bias makes it 1 for the sink's query term

The head reads PRED; position 0 (the prefix) is the attention sink and its token is the special
id, whose head row is 0, so a position with nothing to copy predicts uniformly (NLL ln V).
"""

from __future__ import annotations

import math

# attention logits (after the 1/sqrt(head_dim) scaling) of a match, of the sink, and the logit of
# the copied token: e^-20 of the mass strays, e^-30 of the probability
MATCH_LOGIT, SINK_LOGIT, COPY_LOGIT = 40.0, 20.0, 30.0


def _config(vocab_size: int, n_positions: int, d_model: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=d_model,
        n_layer=2,
        n_head=1,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
    )


def copying_gpt2(vocab_size: int, n_positions: int = 64, special: int = 0):
    """A 2-layer GPT-2 that predicts, at each position t, the token that followed the earlier
    occurrence of token t (an induction head), and is uniform over its head where there is
    none. Its inputs must start with `special` (the prefix, never drawn)."""
    import torch
    from transformers import GPT2LMHeadModel

    V, P = vocab_size, n_positions
    tok, pos, prev, pred = 0, 2 * V, 2 * V + 2 * P, 4 * V + 2 * P
    const = 6 * V + 2 * P
    D = const + 1
    model = GPT2LMHeadModel(_config(V, P, D)).eval()
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}

    def one_hot(slot: int, size: int, i: int, value: float, where: torch.Tensor, col=None):
        """Set +value at slot+i and -value at its mirror slot+size+i (of a row or a column)."""
        if col is None:
            where[slot + i] += value
            where[slot + size + i] -= value
        else:
            where[slot + i, col] += value

    for v in range(V):
        one_hot(tok, V, v, 1.0, sd["transformer.wte.weight"][v])
    for p in range(P):
        one_hot(pos, P, p, 1.0, sd["transformer.wpe.weight"][p])
    eps = model.config.layer_norm_epsilon

    def ln_scale(slots: int) -> float:
        """What a LayerNorm multiplies a residual of `slots` filled ± slots by (mean 0)."""
        return 1.0 / math.sqrt(2 * slots / D + eps)

    scale = math.sqrt(D)  # the attention logits are divided by sqrt(head_dim) = sqrt(D)
    for layer in range(2):
        sd[f"transformer.h.{layer}.ln_1.weight"].fill_(1.0)
        sd[f"transformer.h.{layer}.ln_2.weight"].fill_(1.0)
        sd[f"transformer.h.{layer}.ln_1.bias"][const] = 1.0
        sd[f"transformer.h.{layer}.attn.c_proj.weight"].copy_(torch.eye(D))
    sd["transformer.ln_f.weight"].fill_(1.0)

    # layer 0, previous-token head: the query of position t is POS(t-1), the key of s is POS(s)
    w, a = sd["transformer.h.0.attn.c_attn.weight"], ln_scale(2)  # (D, 3D): q | k | v
    c = math.sqrt(MATCH_LOGIT * scale) / a
    for p in range(1, P):
        w[pos + p, pos + p - 1] = c
    for p in range(P):
        w[pos + p, D + pos + p] = c
    for v in range(V):  # value: copy TOK (both signs) into PREV
        w[tok + v, 2 * D + prev + v] = 1.0 / a
        w[tok + V + v, 2 * D + prev + V + v] = 1.0 / a

    # layer 1, induction head: the query is TOK(t), the key PREV(s); position 0 is the sink
    w, a = sd["transformer.h.1.attn.c_attn.weight"], ln_scale(3)
    c = math.sqrt(MATCH_LOGIT * scale) / a
    for v in range(V):
        w[tok + v, tok + v] = c
        w[prev + v, D + tok + v] = c
    w[const, const] = 1.0  # the query's constant term (the LayerNorm bias's 1) ...
    w[pos, D + const] = SINK_LOGIT * scale / a  # ... meets position 0's key
    for v in range(V):  # value: copy TOK into PRED
        w[tok + v, 2 * D + pred + v] = 1.0 / a
        w[tok + V + v, 2 * D + pred + V + v] = 1.0 / a

    # the head reads PRED; the special token's row stays 0 (the sink's copy of it is no signal)
    head, a = sd["lm_head.weight"], ln_scale(4)
    for v in range(V):
        if v != special:
            head[v, pred + v] = COPY_LOGIT / a
    model.load_state_dict(sd)
    return model


def unigram_gpt2(vocab_size: int, n_positions: int = 64, seed: int = 0):
    """A GPT-2 whose token and position embeddings are 0, so every position reads the same input
    and predicts the same distribution: the LayerNorm biases and the head (random, from `seed`)
    make it a fixed, non-uniform one."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(_config(vocab_size, n_positions, 32)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 1.0)
        model.transformer.wte.weight.zero_()
        model.transformer.wpe.weight.zero_()
    return model


def uniform_gpt2(vocab_size: int, n_positions: int = 64, seed: int = 0):
    """A random GPT-2 whose head is 0: every logit is 0, every NLL ln V, every argmax id 0."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(_config(vocab_size, n_positions, 32)).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model

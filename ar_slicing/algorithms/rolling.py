"""Rolling per-document windows with the semantics of lm-evaluation-harness `loglikelihood_rolling`.

lm-eval scores a document by calling `get_rolling_token_windows(tokens, prefix_token=P,
max_seq_len=L, context_len=1)` and `make_disjoint_window` on each pair, with P its
`prefix_token_id` (`prefix_token` below: the tokenizer's BOS when it has one, else its EOS): every
token of the document is predicted exactly once, the first one conditioned on the prefix alone, in windows
of at most L predictions; a model never reads more than L tokens, and never reads anything outside
the document. All windows but the last are disjoint blocks of L predictions; the last one (when
it predicts fewer than L tokens) reads a full L tokens, so its context reaches back into tokens
the previous window predicted.

Here a window is three integers over the *extended document* `E = [P] + doc + [EOS]`
(index 0 is the prefix, `E[j] = doc[j-1]` for `1 <= j <= n`, `E[n+1]` is the EOS that ends the
document in the token stream): `(start, stop, n_scored)` means the model reads `E[start:stop]`
and its last `n_scored` outputs predict `E[stop-n_scored+1 : stop+1]`.

The document's own tokens are windowed exactly as lm-eval windows them. The trailing EOS, which
lm-eval never scores but which is a target of the packed stream (and so has a tag row), is scored
as one more prediction conditioned on the at most L tokens before it in `E` (its document and the
prefix): when the document's last window has room (fewer than L inputs, i.e. a document shorter
than L) it is appended to that window at no cost; otherwise it gets a window of its own. Either
way the document tokens' predictions are exactly lm-eval's, so summing them gives lm-eval's
rolling loglikelihood, and the EOS adds one row.

Worked example (n = 34 tokens, L = 10), the same windows as lm-eval's
`test_get_rolling_token_windows_v1`, plus the EOS window:

>>> rolling_windows(34, 10)
[(0, 10, 10), (10, 20, 10), (20, 30, 10), (24, 34, 4), (25, 35, 1)]

The first reads the prefix and doc[0:9] and predicts doc[0:10]; the fourth reads doc[23:33] and
predicts doc[30:34]; the last reads doc[24:34] and predicts the EOS. A short document keeps its EOS
in its only window:

>>> rolling_windows(3, 10)
[(0, 4, 4)]

**The harness's default for tokenizers that add BOS** (`--harness-bos`). lm-eval 0.4's
`loglikelihood_rolling` windows `tok_encode(doc)`, which calls `tokenizer.encode(doc)` with the
tokenizer's own default: a tokenizer with `add_bos_token=True` (Llama, Mistral, ...) returns
`[BOS] + doc`, and `prefix_token_id` is that same BOS, so the harness scores p(BOS | BOS) and
every document token reads two BOS before the text. (It skips the added BOS only when the text
itself starts with the BOS string, `has_bos_prefix`; or when `add_bos_token=False` is passed to the
model.) A token store's documents carry no BOS, so by default the windows here are those of
`add_bos_token=False`; `harness_token_list` gives the harness's, and `rolling_windows` over it
(with `lead` tokens before the document, see `rolling_sequences` in pipeline/eval/inputs.py)
scores each document token as the harness does. The p(BOS | BOS) term has no row: it predicts
no token of the stream.

>>> harness_token_list([7, 8, 9], encode_prefix=[1])  # tokenizer.encode adds BOS=1
[1, 7, 8, 9]
>>> [window_tokens([1, 7, 8, 9], 1, w) for w in lm_eval_rolling_windows(4, 3)]
[([1, 1, 7], [1, 7, 8]), ([1, 7, 8], [9])]
"""

from __future__ import annotations


def prefix_token(
    custom: int | None, bos_token_id: int | None, eos_token_id: int
) -> tuple[int, str]:
    """(the token before each document, where it came from): lm-evaluation-harness
    `HFLM.prefix_token_id` (lm_eval/models/huggingface.py), transcribed — a custom prefix if one
    is given, else the tokenizer's BOS if it has one, else its EOS. A tokenizer whose BOS is its
    EOS (GPT-2, GPT-NeoX) gets that one token either way.

    >>> prefix_token(None, None, 0), prefix_token(None, 1, 2), prefix_token(7, 1, 2)
    ((0, 'EOS'), (1, 'BOS'), (7, '--prefix-token'))
    """
    if custom is not None:
        return int(custom), "--prefix-token"
    if bos_token_id is not None:
        return int(bos_token_id), "BOS" if bos_token_id != eos_token_id else "EOS"
    return int(eos_token_id), "EOS"


def harness_token_list(doc_tokens, encode_prefix) -> list[int]:
    """What lm-eval's `tok_encode(doc)` returns for a document whose `add_special_tokens=False`
    encoding is `doc_tokens`, with a tokenizer whose `encode` puts `encode_prefix` before the text
    ([BOS] for `add_bos_token=True`, [] for GPT-2's): the token list its rolling windows cut."""
    return [*(int(t) for t in encode_prefix), *(int(t) for t in doc_tokens)]


def lm_eval_rolling_windows(n_tokens: int, max_len: int) -> list[tuple[int, int, int]]:
    """lm-eval's disjoint rolling windows (context_len=1) for a document of `n_tokens` tokens.

    Same `(start, stop, n_scored)` convention over `E = [P] + doc` as `rolling_windows`; no
    window for the trailing EOS. An empty document has no windows (lm-eval yields none).

    >>> lm_eval_rolling_windows(34, 10)
    [(0, 10, 10), (10, 20, 10), (20, 30, 10), (24, 34, 4)]
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    windows = []
    first = min(max_len, n_tokens)
    if first:
        windows.append((0, first, first))
    predicted = first
    while predicted < n_tokens:
        # lm-eval: window_end = predicted + pred_len; inputs tokens[end-L-1 : end-1], i.e. E[end-L : end].
        n_pred = min(n_tokens - predicted, max_len)
        end = predicted + n_pred
        windows.append((end - max_len, end, n_pred))
        predicted = end
    return windows


def rolling_windows(
    n_tokens: int, max_len: int, trailing_eos: bool = True
) -> list[tuple[int, int, int]]:
    """Windows scoring every token of a document (and its trailing EOS when `trailing_eos`).

    See the module docstring for the convention and the worked example.
    """
    windows = lm_eval_rolling_windows(n_tokens, max_len)
    if not trailing_eos:
        return windows
    eos_index = n_tokens + 1  # position of the trailing EOS in E
    if windows and windows[-1][1] - windows[-1][0] < max_len:
        start, stop, k = windows[-1]
        windows[-1] = (start, stop + 1, k + 1)
    else:
        windows.append((max(0, eos_index - max_len), eos_index, 1))
    return windows


def window_tokens(
    doc_tokens, prefix_id: int, window: tuple[int, int, int]
) -> tuple[list[int], list[int]]:
    """(inputs, targets) of one window: the model reads `inputs`, and its last `len(targets)`
    outputs are scored against `targets`. `doc_tokens` is the document followed by its EOS when
    the window scores that EOS; `prefix_id` is the token before the document.
    """
    start, stop, k = window
    extended = [prefix_id, *[int(t) for t in doc_tokens]]
    return extended[start:stop], extended[stop - k + 1 : stop + 1]

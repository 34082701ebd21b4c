"""Tagged windows of real text for the eval benchmarks (`bench_eval.py`, `gpu_eval.py`).

Python standard-library sources, tokenized by a byte-level BPE trained here, joined into a
validation store holding exactly `n_windows` full windows, counted and tagged by the pipeline's
own stages.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def build_tagged_text(root: Path, n_windows: int, window: int, vocab_size: int, train_docs: int):
    """Writes `root/val` (store), `root/counts`, `root/tags`; returns the trained `Tokenizer`.

    The BPE trains on the first `train_docs` stdlib files; documents are encoded in order until
    the EOS-joined stream holds `n_windows * window + 1` tokens (the last one cut to fit).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ar_slicing.data.store import write_token_store
    from ar_slicing.data.tokenizer import describe
    from pipeline.count import CountConfig, run_count
    from pipeline.tag import TagConfig, run_tag

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.rglob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts[:train_docs],
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    need, docs, have = n_windows * window + 1, [], 0
    for i in range(0, len(texts), 64):  # encode only as much text as the windows need
        for enc in tok.encode_batch(texts[i : i + 64]):
            docs.append(enc.ids[: need - have - 1])
            have += len(docs[-1]) + 1
            if have >= need:
                break
        if have >= need:
            break
    if have < need:
        raise SystemExit(f"the standard library has too little text for {n_windows} windows")
    info = describe(tok, "bench")
    store = write_token_store(root / "val", docs, tokenizer_info=info, tokenizer_json=tok.to_str())
    run_count(CountConfig(tokens=[str(store.path)], out=str(root / "counts"), workers=1))
    run_tag(
        TagConfig(
            tokens=str(store.path),
            counts=str(root / "counts"),
            out=str(root / "tags"),
            window=window,
            workers=1,
        )
    )
    return tok

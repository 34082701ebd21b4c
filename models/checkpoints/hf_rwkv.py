"""transformers RWKV-4 checkpoints (`RwkvForCausalLM`, e.g. RWKV-4-Pile) mapped onto
models/mixers/rwkv.py's `FastRwkv`.

Offline, transformers computes RWKV's WKV with a per-token Python loop; `FastRwkv` keeps the
checkpoint's modules and names but runs the time mixing through `wkv_chunked`.

In eval mode transformers divides `attention.output` and `feed_forward.value` of block i by
2^(i // rescale_every) and halves the hidden state after every `rescale_every` blocks (an fp16
overflow guard, as in BlinkDL's inference code). That is the same function up to the LayerNorms'
epsilon, which then meets a smaller hidden state; `FastRwkv` rescales the same way, so it computes
exactly what transformers computes (checked against a transformers-made checkpoint in
tests/fixtures/upstream).
"""

from __future__ import annotations

# transformers name -> models/mixers/rwkv.py name, inside attention / feed_forward
_RENAME = {
    "time_mix_key": "time_mix_k",
    "time_mix_value": "time_mix_v",
    "time_mix_receptance": "time_mix_r",
}


def rwkv_from_transformers(hf_model, chunk_size: int = 16):
    """`FastRwkv` with the weights of a loaded transformers `RwkvForCausalLM`, rescaled for
    inference as transformers rescales them (unless they already are)."""
    from models.checkpoints.io import load_state_dict_checked
    from models.mixers.rwkv import FastRwkv

    config = hf_model.config
    fast = FastRwkv(config, chunk_size)
    state = {}
    rescale = config.rescale_every > 0 and not getattr(hf_model.rwkv, "layers_are_rescaled", False)
    for name, tensor in hf_model.state_dict().items():
        parts = name.split(".")
        parts[-1] = _RENAME.get(parts[-1], parts[-1])
        if rescale and parts[-3:] in (
            ["attention", "output", "weight"],
            ["feed_forward", "value", "weight"],
        ):
            block = int(parts[parts.index("blocks") + 1])
            tensor = tensor / 2 ** (block // config.rescale_every)
        state[".".join(parts)] = tensor
    load_state_dict_checked(fast, state, source=f"transformers {type(hf_model).__name__}")
    dtype = hf_model.rwkv.embeddings.weight.dtype
    fast = fast.to(dtype=dtype).eval()
    for block in fast.rwkv.blocks:  # as transformers does, decays stay fp32 in a bf16/fp16 model
        block.attention.time_decay.data = block.attention.time_decay.data.float()
        block.attention.time_first.data = block.attention.time_first.data.float()
    return fast

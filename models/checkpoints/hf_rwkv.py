"""transformers RWKV-4 checkpoints (`RwkvForCausalLM`, e.g. RWKV-4-Pile) run through models/mixers/rwkv.py.

Offline, transformers computes RWKV's WKV with a per-token Python loop; `FastRwkv` keeps the
checkpoint's modules and names (`rwkv.embeddings`, `rwkv.blocks.{i}.{pre_ln,ln1,ln2,attention,
feed_forward}`, `rwkv.ln_out`, `head`) but runs the time mixing through `wkv_chunked`.

In eval mode transformers divides `attention.output` and `feed_forward.value` of block i by
2^(i // rescale_every) and halves the hidden state after every `rescale_every` blocks (an fp16
overflow guard, as in BlinkDL's inference code). That is the same function up to the LayerNorms'
epsilon, which then meets a smaller hidden state; `FastRwkv` rescales the same way, so it computes
exactly what transformers computes (checked against a transformers-made checkpoint in
tests/fixtures/upstream).
"""

from __future__ import annotations

import torch
from torch import nn

from models.mixers.rwkv import RWKVChannelMixer, RWKVTimeMixer

# transformers name -> models/mixers/rwkv.py name, inside attention / feed_forward
_RENAME = {
    "time_mix_key": "time_mix_k",
    "time_mix_value": "time_mix_v",
    "time_mix_receptance": "time_mix_r",
}


class FastRwkvBlock(nn.Module):
    def __init__(self, d_model, d_attn, d_hidden, layer_id, eps, chunk_size):
        super().__init__()
        self.layer_id = layer_id
        if layer_id == 0:
            self.pre_ln = nn.LayerNorm(d_model, eps=eps)
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)
        self.attention = RWKVTimeMixer(
            d_model, layer_idx=layer_id, d_attn=d_attn, chunk_size=chunk_size
        )
        self.feed_forward = RWKVChannelMixer(d_model, layer_idx=layer_id, d_hidden=d_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_id == 0:
            x = self.pre_ln(x)
        x = x + self.attention(self.ln1(x))
        return x + self.feed_forward(self.ln2(x))


class FastRwkvModel(nn.Module):
    def __init__(self, config, chunk_size: int = 16):
        super().__init__()
        self.rescale_every = config.rescale_every
        d = config.hidden_size
        d_attn = config.attention_hidden_size or d
        d_hidden = config.intermediate_size or 4 * d
        self.embeddings = nn.Embedding(config.vocab_size, d)
        self.blocks = nn.ModuleList(
            FastRwkvBlock(d, d_attn, d_hidden, i, config.layer_norm_epsilon, chunk_size)
            for i in range(config.num_hidden_layers)
        )
        self.ln_out = nn.LayerNorm(d)  # transformers builds ln_out with the default epsilon

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)  # (B, T, D)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.rescale_every > 0 and (i + 1) % self.rescale_every == 0:
                x = x / 2  # transformers' inference rescaling (the weights are rescaled to match)
        return self.ln_out(x)


class FastRwkv(nn.Module):
    """`RwkvForCausalLM`'s function with the chunked WKV. Build with `FastRwkv.from_transformers`."""

    def __init__(self, config, chunk_size: int = 16):
        super().__init__()
        self.config = config
        self.rwkv = FastRwkvModel(config, chunk_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def from_transformers(cls, hf_model, chunk_size: int = 16) -> FastRwkv:
        """Copy the weights of a transformers `RwkvForCausalLM`, rescaled for inference as
        transformers rescales them (unless they already are)."""
        from models.checkpoints.io import load_state_dict_checked

        config = hf_model.config
        fast = cls(config, chunk_size)
        state = {}
        rescale = config.rescale_every > 0 and not getattr(
            hf_model.rwkv, "layers_are_rescaled", False
        )
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
        for (
            block
        ) in fast.rwkv.blocks:  # as transformers does, decays stay fp32 in a bf16/fp16 model
            block.attention.time_decay.data = block.attention.time_decay.data.float()
            block.attention.time_first.data = block.attention.time_first.data.float()
        return fast

    def hidden_and_head(self, input_ids: torch.Tensor):
        return self.rwkv(input_ids), self.head.weight, None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rwkv(input_ids))  # (B, T, V) logits

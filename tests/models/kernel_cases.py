"""The fused kernels' test cases (models/kernels/), each measured as the largest |difference| from
its fp64 reference: run in-process on CUDA by the gpu tests, and on a CPU under Triton's
interpreter, which must be switched on before triton is imported, so in a process of its own:

    TRITON_INTERPRET=1 python -m tests.models.kernel_cases              # {case: max |Δ|} as JSON
    TRITON_INTERPRET=1 python -m tests.models.kernel_cases eval SPEC TAGS OUT KERNELS

Shapes are small (the interpreter runs a program's every statement in numpy) and chosen for the
edges: lengths that are not a multiple of the convolution's 64-token block or the SSD scan's
chunk, channel counts that are not a multiple of the 64- and 128-channel blocks, head and state
sizes that are not a power of two, batch 1 and more, groups of heads sharing B and C, inputs read
through strided views as the mixers pass them, decays from very slow to very fast and keys
spread over tens of nats.
"""

from __future__ import annotations

import json
import sys

# name -> the kernel and its shape: B sequences of T tokens, E (or D) channels, N states
KERNEL_CASES = {
    "conv+scan B1 T37 E20 N8": dict(kernel="scan", B=1, T=37, E=20, N=8),
    "conv+scan B3 T130 E100 N16": dict(kernel="scan", B=3, T=130, E=100, N=16),
    "conv+scan B2 T5 E70 N5, no bias/D/z": dict(kernel="scan", B=2, T=5, E=70, N=5, bare=True),
    "wkv B1 T37 D20": dict(kernel="wkv", B=1, T=37, D=20),
    "wkv B3 T130 D150, extreme decays": dict(kernel="wkv", B=3, T=130, D=150, extreme=True),
    "wkv B2 T9 D129, no gate": dict(kernel="wkv", B=2, T=9, D=129, bare=True),
    # Mamba-2's SSD: in fp32 the kernel's chunk is 32 tokens (ssd.SSD_CHUNK_FP32); the last case
    # runs the 64-token chunk of its bf16 launch, in fp32
    "ssd B1 T37 H4 P20 G2 N12": dict(kernel="ssd", B=1, T=37, H=4, P=20, G=2, N=12),
    "ssd B3 T150 H4 P16 G1 N16, D per channel, z gate, dt limit": dict(
        kernel="ssd", B=3, T=150, H=4, P=16, G=1, N=16, gated=True
    ),
    "ssd B2 T129 H6 P70 G3 N5, states in and out, no bias/D/softplus": dict(
        kernel="ssd", B=2, T=129, H=6, P=70, G=3, N=5, bare=True
    ),
    "ssd B2 T150 H4 P24 G2 N24, chunks of 64": dict(
        kernel="ssd", B=2, T=150, H=4, P=24, G=2, N=24, chunk=64
    ),
}
MODEL_CASES = ("mamba", "rwkv", "mamba2")  # a tiny model's NLL, kernels against the PyTorch path
TOLERANCE = 1e-4  # fp32 against fp64


def scan_inputs(B, T, E, N, bare=False, device="cpu", seed=0):
    """Mamba-1 scan inputs laid out as the mixer passes them: x and z halves of one in_proj
    output, dt low-rank, B and C slices of one x_proj output; decays from slow to fast."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    xz = randn(B, T, 2 * E)
    x, z = xz.chunk(2, dim=-1)  # (B, T, E) strided views
    proj = randn(B, T, 3 + 2 * N, scale=0.5)  # (outputs of a few units: fp32 keeps ~1e-6 of them)
    _, Bm, Cm = proj.split([3, N, N], dim=-1)  # (B, T, N) strided views
    inputs = dict(
        x=x, conv_weight=randn(E, 1, 4, scale=0.5), conv_bias=randn(E), dt=randn(B, T, E),
        dt_bias=randn(E) - 1.0, A=-torch.exp(randn(E, N, scale=2.0)), B=Bm, C=Cm, D=randn(E), z=z,
    )  # fmt: skip
    if bare:
        inputs.update(conv_bias=None, dt_bias=None, D=None, z=None)
    return inputs


def wkv_inputs(B, T, D, extreme=False, bare=False, device="cpu", seed=0):
    """RWKV-4 WKV inputs; `extreme`: decays e^{-20}..e^{7} per step and keys spread over ~60 nats."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    time_decay = randn(D, scale=3.0)
    if extreme:
        time_decay[:6] = torch.tensor([-20.0, -8.0, 0.0, 3.0, 5.0, 7.0])
    k = randn(B, T, D, scale=10.0 if extreme else 1.0)
    return dict(
        time_decay=time_decay, time_first=randn(D), k=k, v=randn(B, T, D),
        r=None if bare else randn(B, T, D),
    )  # fmt: skip


def ssd_inputs(B, T, H, P, G, N, gated=False, bare=False, device="cpu", seed=0):
    """Mamba-2 SSD inputs laid out as the mixer passes them: z, x, B, C and dt views of one
    in_proj output (x, B and C through the convolution's (B, T, H P + 2 G N) output); one head
    decaying by e^{-0.01 Δ} a token, the last by e^{-30 Δ}. `gated`: D per channel, the silu(z)
    gate and a limit on Δ; `bare`: no dt bias, D or softplus (Δ = dt > 0), and an initial state;
    every case returns the final state."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    # B and C of a third: outputs of a few units, of which fp32 keeps ~1e-6
    scale = torch.ones(2 * H * P + 2 * G * N + H)
    scale[2 * H * P : 2 * H * P + 2 * G * N] = 1 / 3
    zxbcdt = randn(B, T, scale.numel()) * scale.to(device)
    z, xBC, dt = zxbcdt.split([H * P, H * P + 2 * G * N, H], dim=-1)
    x, Bm, Cm = xBC.split([H * P, G * N, G * N], dim=-1)
    inputs = dict(
        x=x.unflatten(-1, (H, P)), dt=dt, A=-torch.logspace(-2, 1.5, H).to(device),
        B=Bm.unflatten(-1, (G, N)), C=Cm.unflatten(-1, (G, N)), chunk_size=16,
        D=randn(H, P) if gated else randn(H), z=z.unflatten(-1, (H, P)) if gated else None,
        initial_state=None, dt_bias=randn(H) - 1.0, dt_softplus=True,
        dt_limit=(0.05, 1.5) if gated else (0.0, float("inf")), return_final_state=True,
    )  # fmt: skip
    if bare:
        inputs.update(D=None, dt_bias=None, dt_softplus=False, dt=torch.rand_like(dt) + 0.01,
                      initial_state=randn(B, H, P, N, scale=0.5))  # fmt: skip
    return inputs


def _fp64_cpu(value):
    import torch

    return value.double().cpu() if isinstance(value, torch.Tensor) else value


def kernel_error(name: str, device: str, path: str = "triton") -> dict:
    """Case `name` on `device` by the kernels of `path` ("triton": this project's, "field": the
    field's adapters): {"error": max |kernel - fp64 reference| over its outputs, "scale": the
    reference's largest |value|}."""
    from models.kernels import implementation, wkv
    from models.kernels import selective_scan as ss

    case = dict(KERNEL_CASES[name])
    kind = case.pop("kernel")
    if kind == "ssd":
        from models.mixers.mamba2 import ssd_sequential

        chunk = case.pop("chunk", None)
        a = ssd_inputs(**case, device=device)
        want = ssd_sequential(**{k: _fp64_cpu(v) for k, v in a.items() if k != "chunk_size"})
        launch = {"kernel_chunk": chunk} if chunk and path == "triton" else {}
        got = list(zip(implementation("ssd", path)(**a, **launch), want))  # (y, final state)
    elif kind == "wkv":
        a = wkv_inputs(**case, device=device)
        want = wkv.reference(**{k: v if v is None else v.cpu() for k, v in a.items()})
        got = [(implementation("wkv", path)(**a), want)]
    else:
        a = scan_inputs(**case, device=device)
        u_want, y_want = ss.reference(**{k: v if v is None else v.cpu() for k, v in a.items()})
        u = implementation("causal_conv1d", path)(a["x"], a["conv_weight"], a["conv_bias"])
        y = implementation("selective_scan", path)(
            u, a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"]
        )
        got = [(u, u_want), (y, y_want)]
    return {
        "error": max(float((x.double().cpu() - w).abs().max()) for x, w in got),
        "scale": max(float(w.abs().max()) for _, w in got),
    }


def tiny_model(arch: str):
    """A tiny transformers Mamba, Mamba-2 (two groups of heads, head and state sizes not powers of
    two) or RWKV (random weights, decays from slow to fast) in this project's forward
    (models/mixers/), as `hf:` loads it."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM, RwkvConfig, RwkvForCausalLM

    torch.manual_seed(5)
    if arch == "mamba2":
        from transformers import Mamba2Config, Mamba2ForCausalLM

        from models.checkpoints.mamba_ssm import mamba2_from_transformers

        hf = Mamba2ForCausalLM(
            Mamba2Config(
                vocab_size=96, hidden_size=40, num_heads=4, head_dim=20, state_size=12,
                n_groups=2, num_hidden_layers=2, time_step_limit=(0.0, 3.0),
            )
        )  # fmt: skip
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.randn_like(p) * 2)
            hf.backbone.embeddings.weight.normal_(0, 0.5)
        # the PyTorch path in chunks of 16; the kernel's chunk (32 in fp32) is its own
        return mamba2_from_transformers(hf.eval(), chunk_size=16).eval()
    if arch == "mamba":
        from models.checkpoints.mamba_ssm import mamba_from_transformers

        hf = MambaForCausalLM(
            MambaConfig(vocab_size=96, hidden_size=40, state_size=6, num_hidden_layers=2)
        )
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.randn_like(p) * 2)
            hf.backbone.embeddings.weight.normal_(0, 0.5)
        return mamba_from_transformers(hf.eval()).eval()
    from models.checkpoints.hf_rwkv import rwkv_from_transformers

    hf = RwkvForCausalLM(
        RwkvConfig(
            vocab_size=96,
            hidden_size=72,
            num_hidden_layers=2,
            attention_hidden_size=72,
            intermediate_size=96,
            context_length=16,
        )
    )
    with torch.no_grad():
        hf.head.weight.normal_(0, 0.5)
    return rwkv_from_transformers(hf.eval()).eval()


def model_error(arch: str, device: str) -> dict:
    """A tiny model's per-token NLL (2 sequences of 45 tokens, fp32) with the kernels forced
    ("triton") against the PyTorch path: {"error": max |Δ|, "paths": {op: paths taken}}."""
    import torch

    from models.kernels import paths_taken, use_kernels
    from models.nll import chunked_nll

    model = tiny_model(arch).to(device)
    ids = torch.randint(0, 96, (2, 46), generator=torch.Generator().manual_seed(1)).to(device)
    nll = {}
    with torch.inference_mode():
        for path in ("triton", "pytorch"):
            with use_kernels(path) as taken:
                hidden, weight, bias = model.hidden_and_head(ids[:, :-1])
                nll[path] = chunked_nll(hidden, weight, bias, ids[:, 1:])
            if path == "triton":
                paths = paths_taken(taken)
    error = float((nll["triton"].double() - nll["pytorch"].double()).abs().max())
    return {"error": error, "paths": paths, "mean_nll": float(nll["pytorch"].mean())}


def evaluate(spec: str, tags: str, out: str, kernels: str) -> None:
    """`arslice eval` of `spec` on the CPU in fp32 with --kernels `kernels`."""
    from pipeline.eval import EvalConfig, run_eval

    run_eval(
        EvalConfig(
            model=spec,
            tags=tags,
            out=out,
            device="cpu",
            dtype="fp32",
            batch_size="3",
            chunk_windows=4,
            kernels=kernels,
        )  # fmt: skip
    )


def main(argv: list[str]) -> int:
    from models.kernels import interpreting

    if not interpreting():
        print("set TRITON_INTERPRET=1 (before anything imports triton)", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    if argv[:1] == ["eval"]:
        evaluate(*argv[1:])
        return 0
    results = {name: kernel_error(name, "cpu") for name in KERNEL_CASES}
    results.update({f"model {arch}": model_error(arch, "cpu") for arch in MODEL_CASES})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The fused kernels' test cases (models/kernels/), each measured as the largest |difference| from
its fp64 reference: run in-process on CUDA by the gpu tests, and on a CPU under Triton's
interpreter, which must be switched on before triton is imported, so in a process of its own:

    TRITON_INTERPRET=1 python -m tests.models.kernel_cases              # {case: max |Δ|} as JSON
    TRITON_INTERPRET=1 python -m tests.models.kernel_cases eval SPEC TAGS OUT KERNELS

Shapes are small (the interpreter runs a program's every statement in numpy) and chosen for the
edges: lengths that are not a multiple of the convolution's 64-token block, channel counts that
are not a multiple of the 64- and 128-channel blocks, state sizes that are not a power of two,
batch 1 and more, inputs read through strided views as the mixers pass them, decays from very
slow to very fast and keys spread over tens of nats.
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
}
MODEL_CASES = ("mamba", "rwkv")  # a tiny model's NLL, kernels against the PyTorch path
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


def kernel_error(name: str, device: str, path: str = "triton") -> dict:
    """Case `name` on `device` by the kernels of `path` ("triton": this project's, "field": the
    field's adapters): {"error": max |kernel - fp64 reference| over its outputs, "scale": the
    reference's largest |value|}."""
    from models.kernels import implementation, wkv
    from models.kernels import selective_scan as ss

    case = dict(KERNEL_CASES[name])
    kind = case.pop("kernel")
    if kind == "wkv":
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
    """A tiny transformers Mamba or RWKV (random weights, decays from slow to fast) in this
    project's forward (models/mixers/), as `hf:` loads it."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM, RwkvConfig, RwkvForCausalLM

    torch.manual_seed(5)
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

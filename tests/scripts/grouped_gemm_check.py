"""Transformer Engine's grouped GEMM (``GroupedLinear``, the experts of megatron-core's ``TEGroupedMLP``) on one GPU
against an fp64 reference: forward output, input gradient and every expert's weight gradient, for the expert
shapes our MoE models run, with experts that receive no token.

Run: PYTHONPATH=.:tests python tests/scripts/grouped_gemm_check.py DTYPE   (bf16 | fp16 | fp32)
under the environment to check (``NVTE_USE_CUTLASS_GROUPED_GEMM=1``: TE's CUTLASS grouped GEMM, else one cuBLAS GEMM
per expert). Prints one JSON line per case: ``{"case", "experts", "in", "out", "m_splits", "out_err", "dgrad_err",
"wgrad_err", "digest", "cutlass_launches"}``, each error the largest |x - ref| / max|ref| of that tensor; ``digest`` a
hash of the bits of the three results; ``cutlass_launches`` how many of the forward + backward's kernels were TE's
CUTLASS grouped GEMM (``cutlass::gemm::GroupProblemShape`` in the kernel's name, counted by the profiler). The bits
alone cannot tell the two paths apart: on an H100 both gave the same bits on the 2B shape.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

try:
    import transformer_engine.pytorch as te
except ImportError as exc:
    raise SystemExit(f"grouped_gemm_check.py checks Transformer Engine's GroupedLinear on a GPU: {exc}") from None

CUTLASS_KERNEL = "GroupProblemShape"
"""In the name of TE's CUTLASS grouped GEMM kernel (``cutlass_grouped_gemm.cuh``: a ``GemmUniversal`` over a
``cutlass::gemm::GroupProblemShape``); cuBLAS's kernels (``nvjet_*``, ``sm90_xmma_*``) never carry it."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (name, experts, in_features, out_features, tokens per expert): fc1 (SwiGLU: 2 x ffn) and fc2 of the benchmark
# shapes (qwen3-moe-2b: hidden 1024, expert ffn 768, 16 experts; a Qwen3-30B-A3B-like layer: 2048 / 768, 128
# experts) and of the tiny test models, with empty experts and sizes that are no multiple of a tile.
CASES = [
    ("2b_fc1", 16, 1024, 1536, [911, 0, 2048, 17, 1, 640, 0, 0, 1500, 333, 64, 128, 4095, 7, 250, 999]),
    ("2b_fc2", 16, 768, 1024, [911, 0, 2048, 17, 1, 640, 0, 0, 1500, 333, 64, 128, 4095, 7, 250, 999]),
    ("a3b_fc1", 128, 2048, 1536, [(37 * e) % 211 if e % 9 else 0 for e in range(128)]),
    ("a3b_fc2", 128, 768, 2048, [(37 * e) % 211 if e % 9 else 0 for e in range(128)]),
    # Wider layers (a Qwen2-57B-A14B-like fc1: 3584 -> 2 x 2560; DeepSeek-V3's fc2: 2048 -> 7168), N no multiple of 128
    ("h3584_fc1", 8, 3584, 5120, [700, 0, 129, 1, 2000, 64, 513, 300]),
    ("dsv3_fc2", 8, 2048, 7168, [700, 0, 129, 1, 2000, 64, 513, 300]),
    ("odd_n", 4, 1024, 1000, [300, 77, 0, 1024]),
    # Equal token counts, a multiple of 128: the weight gradients run on CUTLASS too
    ("equal_256", 8, 1024, 1536, [256] * 8),
    # The tiny test models (not multiples of 128: TE keeps cuBLAS)
    ("tiny_fc1", 4, 64, 96, [5, 0, 13, 2]),
    ("tiny_fc2", 4, 48, 64, [5, 0, 13, 2]),
    ("all_in_one", 8, 256, 512, [0, 0, 0, 3000, 0, 0, 0, 0]),
]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check(name: str, experts: int, n_in: int, n_out: int, splits: list[int], dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1234)
    layer = te.GroupedLinear(experts, n_in, n_out, bias=False, params_dtype=dtype, device="cuda")
    with torch.no_grad():
        for e in range(experts):
            getattr(layer, f"weight{e}").copy_(torch.randn(n_out, n_in, generator=gen, device="cuda") / n_in ** 0.5)
    tokens = sum(splits)
    x = torch.randn(tokens, n_in, generator=gen, device="cuda").to(dtype).requires_grad_()
    dy = torch.randn(tokens, n_out, generator=gen, device="cuda").to(dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = layer(x, splits)
        y.backward(dy)
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if CUTLASS_KERNEL in e.key)

    weights = [getattr(layer, f"weight{e}").detach().double() for e in range(experts)]
    xs, dys = x.detach().double().split(splits), dy.double().split(splits)
    y_ref = torch.cat([xi @ w.T for xi, w in zip(xs, weights)])
    dx_ref = torch.cat([dyi @ w for dyi, w in zip(dys, weights)])
    dw_ref = torch.stack([dyi.T @ xi for dyi, xi in zip(dys, xs)])
    params = [getattr(layer, f"weight{e}") for e in range(experts)]
    dw = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    digest = hashlib.sha256(b"".join(t.detach().float().cpu().numpy().tobytes() for t in (y, x.grad, dw))).hexdigest()
    return {"case": name, "experts": experts, "in": n_in, "out": n_out, "m_splits": splits, "out_err": rel(y, y_ref),
            "dgrad_err": rel(x.grad, dx_ref), "wgrad_err": rel(dw, dw_ref), "digest": digest[:16],
            "cutlass_launches": launches}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in DTYPES or not torch.cuda.is_available():
        raise SystemExit(f"usage: grouped_gemm_check.py {{{' | '.join(DTYPES)}}} (on a CUDA GPU)")
    dtype = DTYPES[argv[0]]
    for case in CASES:
        print(json.dumps(check(*case, dtype)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

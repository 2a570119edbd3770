"""The GPU kernels of one cudnn_flex tree-attention forward + backward next to causal cuDNN's, on one CUDA GPU.

    python benchmarks/cudnn_flex_kernel_profile.py --out benchmarks/results/te/cudnn_flex_profile_h200.txt

attention_bench's GRPO and multi-turn micro-batches (bf16, 16 / 8 heads, d = 128): the backend's call
(``cudnn_flex._flex``: one varlen sequence per tree, token-major q / k / v as Megatron passes them) and SDPA's cuDNN
backend causal over the same slots (the per-pair reference of ``attention_bench.py``). After three warm-up calls, one
call of each under torch.profiler: one line per kernel (``<workload> <method> <kernel name> <grid> us <time>``), each
method's total, and its per-useful-pair efficiency from those kernel totals (tree pairs / tree kernel time over causal
pairs / causal kernel time), beside the tile ceiling: where a tree call loses against causal cuDNN, kernel by kernel.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(__file__))
import attention_bench as ab  # noqa: E402
from fa4_kernel_profile import kernel_lines  # noqa: E402
from megatron_tree.attention import cudnn_flex  # noqa: E402
from megatron_tree.core.platform import have_transformer_engine  # noqa: E402


def step_of(attn, inputs: list[torch.Tensor], grad: torch.Tensor):
    """``step()``: one forward + backward of ``attn(*inputs)`` (gradients cleared first), warmed up three times."""

    def step():
        for x in inputs:
            x.grad = None
        attn(*inputs).backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", nargs="+", default=["grpo", "multi_turn"], choices=["grpo", "multi_turn"])
    args = ap.parse_args()
    reason = cudnn_flex.cudnn_flex_unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    have_transformer_engine()  # its cuDNN symbols first, as attention_bench does
    dev = torch.device("cuda")
    loads = ab.workloads(0)
    lines = []
    for name in args.workloads:
        mb = ab.fullest_micro_batch(loads[name], ab.SLOTS)
        end = mb.attention_mask[0].to(device=dev, dtype=torch.int32)
        pairs = ab.micro_batch_work(mb)[1]
        q, k, v, g = ab.bf16_inputs(end.shape[0], dev, torch.Generator(device=dev).manual_seed(0))
        mask = cudnn_flex.cudnn_flex_tree_mask(end)
        tree = step_of(lambda q, k, v: cudnn_flex._flex(q, k, v, mask, ab.HEAD_DIM ** -0.5),
                       [ab.token_major(x).requires_grad_() for x in (q, k, v)], ab.token_major(g))
        causal = step_of(ab.sdpa_gqa(SDPBackend.CUDNN_ATTENTION, is_causal=True), [q, k, v], g)
        totals = {}
        for method, step in (("cudnn_flex_tree", tree), ("causal_cudnn", causal)):
            kernels, totals[method] = kernel_lines(step, f"{name} {method}")
            lines += kernels
        t = end.shape[0]
        ceiling = ab.segment_tile_ceiling(end, mask.cu_seqlens, pairs)
        eff = pairs / totals["cudnn_flex_tree"] / (t * (t + 1) / 2 / totals["causal_cudnn"])
        lines.append(f"{name} kernel-time efficiency per useful pair {eff:.3f} (tile ceiling {ceiling:.3f}: "
                     f"{eff / ceiling:.3f} of causal cuDNN's speed per computed tile)")
        print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

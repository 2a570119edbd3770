"""The GPU kernels of one cudnn_flex tree-attention forward + backward next to causal cuDNN's, on one CUDA GPU.

    python benchmarks/cudnn_flex_kernel_profile.py --out benchmarks/results/te/cudnn_flex_profile_h200.txt

attention_bench's GRPO and multi-turn micro-batches (bf16, 16 / 8 heads, d = 128): the backend's call
(``cudnn_flex._flex``: one varlen sequence per tree, token-major q / k / v as Megatron passes them) and SDPA's cuDNN
backend causal over the same slots (the per-pair reference of ``attention_bench.py``). After three warm-up calls, one
call of each under torch.profiler: one line per kernel (``<workload> <method> <kernel name> <grid> us <time>``), each
method's total, and its per-useful-pair efficiency from those kernel totals (tree pairs / tree kernel time over causal
pairs / causal kernel time), beside the tile ceiling: where a tree call loses against causal cuDNN, kernel by kernel.
Then one line per phase (:func:`phase`): the forward kernel, the backward's attention kernel, each with its own
per-useful-pair efficiency, and the passes over the slots (fills, dO . O, fp32 -> bf16 conversions) with their
share of each call.
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


PHASES = ("forward", "backward kernel", "slot passes")


def phase(kernel: str) -> str:
    """The phase of a forward + backward call that GPU kernel ``kernel`` (its full name) belongs to: ``forward``
    (cudnn_flex's ``...sm90fwd...``, cuDNN's ``..._fprop_...``), ``backward kernel`` (``...sm90bwd...``, ``..._bprop_...``)
    or ``slot passes`` (everything else: per-slot work whose time does not grow with the pairs)."""
    name = kernel.lower()
    if "sm90fwd" in name or "fprop" in name:
        return "forward"
    if "sm90bwd" in name or "bprop" in name:
        return "backward kernel"
    return "slot passes"


def phase_lines(label: str, tree: list[tuple[str, float]], causal: list[tuple[str, float]], pair_ratio: float
                ) -> list[str]:
    """One line per phase: tree and causal kernel microseconds, and for the two attention kernels the per-useful-pair
    efficiency (``pair_ratio`` = tree pairs / causal pairs), for the slot passes their share of each call."""
    sums = [{p: sum(us for name, us in kernels if phase(name) == p) for p in PHASES} for kernels in (tree, causal)]
    totals = [sum(s.values()) for s in sums]
    lines = []
    for p in PHASES:
        t, c = sums[0][p], sums[1][p]
        what = (f"{t / totals[0]:.1%} of the tree call, {c / totals[1]:.1%} of causal's" if p == "slot passes"
                else f"per useful pair {pair_ratio * c / t:.3f}" if t else "not run")
        lines.append(f"{label} phase {p}: tree {t:.0f} us, causal cuDNN {c:.0f} us, {what}")
    return lines


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
        kernels, totals = {}, {}
        for method, step in (("cudnn_flex_tree", tree), ("causal_cudnn", causal)):
            method_lines, kernels[method] = kernel_lines(step, f"{name} {method}")
            totals[method] = sum(us for _, us in kernels[method])
            lines += method_lines
        t = end.shape[0]
        pair_ratio = pairs / (t * (t + 1) / 2)
        ceiling = ab.segment_tile_ceiling(end, mask.cu_seqlens, pairs, ab.CUDNN_FLEX_TILE)
        eff = pair_ratio * totals["causal_cudnn"] / totals["cudnn_flex_tree"]
        lines.append(f"{name} kernel-time efficiency per useful pair {eff:.3f} (tile ceiling at its 64 x 128 tiles "
                     f"{ceiling:.3f}: {eff / ceiling:.3f} of causal cuDNN's speed per computed tile)")
        lines += phase_lines(name, kernels["cudnn_flex_tree"], kernels["causal_cudnn"], pair_ratio)
        print("\n".join(lines[-4:]), flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""The GPU kernels of one FA4 tree-attention forward + backward, with their grids and times, on one CUDA GPU.

    python benchmarks/fa4_kernel_profile.py --out benchmarks/results/te/fa4_profile.txt

attention_bench's GRPO and multi-turn trees at T = 32768 (bf16, 16 / 8 heads, d = 128; q / k / v head-major as
the bench makes them), and GRPO again with token-major q / k / v (Megatron's [T, b, h, d] permuted, as the model
calls it). After three warm-up calls, one call under torch.profiler: one line per kernel
(``<workload> <layout> <kernel name> <grid> us <time>``) and the total.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
import attention_bench as ab  # noqa: E402


def kernel_lines(step, label: str) -> tuple[list[str], list[tuple[str, float]]]:
    """Profile one ``step()``: one line per GPU kernel and the total, and the kernels as (name, microseconds)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    total = sum(e["dur"] for e in events)
    lines = [f"{label} {e['name'][:70]} {e['args'].get('grid')} us {e['dur']}" for e in events]
    return lines + [f"{label} kernel total us {total}"], [(e["name"], e["dur"]) for e in events]


def main():
    args = ab.fa4_harness_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    dev = torch.device("cuda")
    loads = ab.workloads(0)
    lines = []
    for name, layout in [("grpo", "head-major"), ("multi_turn", "head-major"), ("grpo", "token-major")]:
        step = ab.fa4_tree_step(loads[name], ab.SLOTS, dev, token_major=layout == "token-major")
        lines += kernel_lines(step, f"{name} {layout}")[0]
        print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

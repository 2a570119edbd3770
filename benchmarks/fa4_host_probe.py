"""Host (CPU) time vs GPU kernel time of one FA4 tree-attention forward + backward, on one CUDA GPU.

    python benchmarks/fa4_host_probe.py --out benchmarks/results/te/fa4_host.json

For the attention_bench workloads at T = 32768 (bf16, 16 / 8 heads, d = 128), per forward + backward:
``host_ms`` the host's time to issue it (20 calls back to back, no sync, divided by 20), ``throughput_ms`` the
wall time per call of the same 20 calls once the GPU has finished them, ``kernel_ms`` the sum of the GPU
kernels' times (torch.profiler). ``throughput_ms`` above ``kernel_ms`` with ``host_ms`` close to it: the call is
bound by the host, not by the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
import attention_bench as ab  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = ab.fa4_harness_args(parser)
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "calls": args.calls, "workloads": {}}
    loads = ab.workloads(0)
    for name in ["grpo", "multi_turn", "no_sharing"]:
        step = ab.fa4_tree_step(loads[name], ab.SLOTS, dev)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                step()
            torch.cuda.synchronize()
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        row = {"host_ms": (t1 - t0) * 1e3 / args.calls, "throughput_ms": (t2 - t0) * 1e3 / args.calls,
               "kernel_ms": kernel_us / 1e3 / args.calls}
        result["workloads"][name] = row
        print(name, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

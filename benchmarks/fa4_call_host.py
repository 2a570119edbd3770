"""Host time of one FA4 tree-attention call: FA4's own Python per call vs the replayed forward kernel call.

``megatron_tree.attention.fa4_kernels`` replays the tree forward's kernel call for every call of a geometry after
the first (``megatron_tree.attention.kernel_replay``). This measures, on one GPU, the host seconds a call takes to
queue (``host_us``: ``calls`` calls queued back to back, no sync inside, divided by ``calls``) and the wall time per
call once the GPU finished (``wall_us``), forward alone (``torch.no_grad``, as the forward-only passes) and forward +
backward, for a packed GRPO tree of T slots (16 query / 8 K/V heads, d = 128, Megatron's token-major memory), with
the replay and with FA4's own path.

    python benchmarks/fa4_call_host.py --out benchmarks/results/te/fa4_call_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_reference import bf16_inputs, gpu_tree  # noqa: E402

from megatron_tree.attention import fa4_kernels  # noqa: E402
from megatron_tree.attention.fa4 import fa4_tree_attention, fa4_tree_mask  # noqa: E402


def timed(fn, calls: int, repeats: int) -> tuple[float, float]:
    """Median over ``repeats`` of (host us per call to queue ``calls`` calls, wall us per call)."""
    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        queued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append((queued - start) / calls * 1e6)
        wall.append((done - start) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[3000], help="micro-batch sizes (the test tree packs ~3k)")
    ap.add_argument("--calls", type=int, default=28, help="calls per timing (a model's layers)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for max_tokens in args.tokens:
        end = gpu_tree("grpo", max_tokens=max_tokens)
        t = end.shape[0]
        prepared = fa4_tree_mask(end)
        q, k, v, grad = (x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3).bfloat16()
                         for x in bf16_inputs(t, t, 16, 8, 128))
        q, k, v = (x.requires_grad_() for x in (q, k, v))

        def forward():
            with torch.no_grad():
                fa4_tree_attention(q, k, v, prepared)

        def forward_backward():
            fa4_tree_attention(q, k, v, prepared).backward(grad)

        for path in ("replay", "fa4"):
            saved = fa4_kernels._FWD_REPLAY
            if path == "fa4":
                fa4_kernels._FWD_REPLAY = fa4_kernels._ORIGINAL_FWD
            try:
                for name, fn in (("forward", forward), ("forward_backward", forward_backward)):
                    fn(), fn()  # compile, record
                    host, wall = timed(fn, args.calls, args.repeats)
                    rows.append(dict(slots=t, path=path, call=name, host_us=round(host, 1), wall_us=round(wall, 1)))
                    print(f"T={t:6d} {path:6s} {name:16s} host {host:7.1f} us/call, wall {wall:7.1f} us/call", flush=True)
            finally:
                fa4_kernels._FWD_REPLAY = saved
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                              calls=args.calls, repeats=args.repeats, rows=rows), indent=1))


if __name__ == "__main__":
    main()

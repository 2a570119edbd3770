"""Host time of one cudnn_flex tree-attention call: the backend's launches against cuDNN frontend's own call.

The backend resolves each geometry once with the frontend's code and then launches its compiled kernels directly
(``megatron_tree.attention.cudnn_flex_kernels``); ``flex_attn_func`` redoes that Python on every call. This measures,
on one GPU, the host time to queue one call (``host_us``: ``calls`` calls queued back to back with no sync inside,
divided by ``calls``) and the wall time per call once the GPU has finished (``wall_us``). A call whose host time is
above its wall time is host-bound there. Both are measured forward alone (``torch.no_grad``, as the forward-only
passes run it) and forward + backward, on the fullest micro-batch of the GPU tests' GRPO batch packed at each
``--tokens`` (that batch holds 3,818 tokens: 2,000 slots at 3,000, all of it at 16,000; 16 query / 8 K/V heads,
d = 128, Megatron's token-major memory), one varlen sequence per tree.

    python benchmarks/cudnn_flex_call_host.py --out benchmarks/results/te/cudnn_flex_call_host.json
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
from kernel_reference import bf16_inputs, frontend_flex, gpu_tree  # noqa: E402

from megatron_tree.attention import cudnn_flex  # noqa: E402


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
    ap.add_argument("--tokens", type=int, nargs="+", default=[3000, 16000], help="micro-batch sizes (max tokens) to pack the batch at")
    ap.add_argument("--calls", type=int, default=28, help="calls per timing (a model's layers)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    reason = cudnn_flex.cudnn_flex_unavailable_reason()
    if reason is not None:
        sys.exit(f"cudnn_flex_call_host.py: {reason}")
    rows = []
    for max_tokens in args.tokens:
        end = gpu_tree("grpo", max_tokens=max_tokens)
        t = end.shape[0]
        prepared = cudnn_flex.cudnn_flex_tree_mask(end)
        q, k, v, grad = (x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3).bfloat16()
                         for x in bf16_inputs(t, t, 16, 8, 128))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        for path, attend in (("launch", cudnn_flex._flex), ("frontend", frontend_flex)):
            def forward():
                with torch.no_grad():
                    attend(q, k, v, prepared, 128 ** -0.5)

            def forward_backward():
                attend(q, k, v, prepared, 128 ** -0.5).backward(grad)

            for name, fn in (("forward", forward), ("forward_backward", forward_backward)):
                fn(), fn()  # compile, record
                host, wall = timed(fn, args.calls, args.repeats)
                rows.append(dict(slots=t, path=path, call=name, host_us=round(host, 1), wall_us=round(wall, 1)))
                print(f"T={t:6d} {path:8s} {name:16s} host {host:7.1f} us/call, wall {wall:7.1f} us/call", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                              calls=args.calls, repeats=args.repeats, rows=rows), indent=1))


if __name__ == "__main__":
    main()

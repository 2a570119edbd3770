"""Host time of one call of megatron-core's bias-dropout-add, fused (``torch.compile``) vs eager.

A transformer layer calls it on both residuals; on small tensors the kernels take no time, so what is left is the
host's cost per call: Dynamo's guards and AOT autograd's wrappers for the compiled function, two ops for the eager one
(``F.dropout`` with p = 0 returns its input, then one add). Why ``te_overrides`` keeps ``bias_dropout_fusion`` off.

    python benchmarks/bias_dropout_host.py --out benchmarks/results/bias_dropout_host.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def per_call_us(fused: bool, backward: bool, calls: int) -> float:
    """Microseconds of host time per call (training mode, no bias, dropout 0, [64, 1, 32] fp32 on the CPU)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    bda = get_bias_dropout_add(True, fused)
    x, residual = (torch.randn(64, 1, 32, requires_grad=True) for _ in range(2))
    grad = torch.ones(64, 1, 32)

    def call():
        with torch.enable_grad():
            out = bda((x, None), residual, 0.0)
        if backward:
            out.backward(grad)

    for _ in range(20):  # compiles, warms up
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = {f"{'fused' if fused else 'eager'}_{'forward_backward' if bwd else 'forward'}_us":
            round(per_call_us(fused, bwd, args.calls), 1) for fused in (True, False) for bwd in (False, True)}
    result = dict(torch=torch.__version__, cpu=platform.processor() or platform.machine(), **rows)
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

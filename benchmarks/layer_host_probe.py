"""Host time per call of the small per-layer ops of the Transformer Engine spec, on one CUDA GPU.

    python benchmarks/layer_host_probe.py --out benchmarks/results/te/layer_host.json

A step of many small layer calls (the chunks of a tree larger than a micro-batch, forward-only passes) waits on the
host: each op costs its Python and dispatch, whatever its kernel takes. Each row is the host's time to issue one call
(``--calls`` back to back on a tiny input so the kernels never hold it up, no sync; microseconds), forward alone and
forward + backward:

* the MLP's SwiGLU as megatron-core runs it: ``bias_swiglu_impl`` (``bias_activation_fusion``: a ``torch.compile`` d
  function each way), Transformer Engine's fusible op (``use_te_activation_func``: ``te.pytorch.ops.SwiGLU``), eager
  torch (``silu(a) * b``);
* the q / k RMSNorm: megatron-core's ``TENorm`` (Transformer Engine's ``RMSNorm``) vs ``torch.nn.functional.rms_norm``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, x: torch.Tensor, backward: bool, calls: int) -> float:
    """Microseconds of host time to issue ``fn(x)`` (and its backward), mean over ``calls`` after a warm-up."""
    grad = None

    def call():
        nonlocal grad
        out = fn(x)
        if backward:
            if grad is None:
                grad = torch.ones_like(out)
            out.backward(grad)

    for _ in range(30):  # compiles, warms up
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(host / calls * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import transformer_engine.pytorch as te
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.extensions.transformer_engine import TENorm

    dev = torch.device("cuda")
    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=1, normalization="RMSNorm",
                               layernorm_epsilon=1e-6, params_dtype=torch.bfloat16, bf16=True)
    x = torch.randn(64, 1, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    heads = torch.randn(64, 1, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    te_swiglu = te.ops.SwiGLU()
    te_norm = TENorm(config, 128, eps=1e-6).to(dev)
    weight = torch.ones(128, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def eager_swiglu(y):
        a, b = torch.chunk(y, 2, dim=-1)
        return F.silu(a) * b

    ops = {
        "swiglu_compiled": (lambda y: bias_swiglu_impl(y, None), x),
        "swiglu_te_op": (te_swiglu, x),
        "swiglu_eager": (eager_swiglu, x),
        "qk_rmsnorm_te": (te_norm, heads),
        "qk_rmsnorm_torch": (lambda h: F.rms_norm(h, (128,), weight, 1e-6), heads),
    }
    rows = {f"{name}_{'forward_backward' if bwd else 'forward'}_us": per_call_us(fn, inp, bwd, args.calls)
            for name, (fn, inp) in ops.items() for bwd in (False, True)}
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, te=importlib.metadata.version("transformer_engine"), **rows)
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

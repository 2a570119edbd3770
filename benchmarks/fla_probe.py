"""Which calls of flash-linear-attention's ``chunk_gated_delta_rule`` run forward + backward on this GPU: each
variant in its own process (an illegal memory access poisons the CUDA context), CUDA_LAUNCH_BLOCKING=1 so the
failing kernel is named. Prints one line per variant: ``VARIANT ok max_rel_err=...`` against the fp32 PyTorch
path, or ``VARIANT FAIL <last error line>``.

    python benchmarks/fla_probe.py            # every variant
"""

from __future__ import annotations

import os
import subprocess
import sys

VARIANTS = {
    # name: (dtype of q/k/v, dtype of g/beta, initial state, cu_seqlens, H, HV, dk, dv, pass cu_seqlens_cpu)
    "mixed_varlen_h0": ("bf16", "fp32", True, [0, 100, 164, 500, 537], 4, 4, 64, 128, False),
    "bf16_varlen_h0": ("bf16", "bf16", True, [0, 100, 164, 500, 537], 4, 4, 64, 128, False),
    "mixed_varlen_noh0": ("bf16", "fp32", False, [0, 100, 164, 500, 537], 4, 4, 64, 128, False),
    "mixed_varlen_h0_cucpu": ("bf16", "fp32", True, [0, 100, 164, 500, 537], 4, 4, 64, 128, True),
    "mixed_dense_h0": ("bf16", "fp32", True, None, 4, 4, 64, 128, False),
    "mixed_varlen64_h0": ("bf16", "fp32", True, [0, 128, 192, 512, 576], 4, 4, 64, 128, False),
    "mixed_varlen_h0_qwen35": ("bf16", "fp32", True, [0, 100, 164, 500, 537], 2, 4, 128, 128, False),
    "bf16_varlen_h0_qwen35": ("bf16", "bf16", True, [0, 100, 164, 500, 537], 2, 4, 128, 128, False),
}


def run(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

    from megatron_tree.linear_attention.chunked_delta_rule import chunk_gated_delta_rule as ours

    lo, gdt, with_h0, cu, h, hv, dk, dv, cucpu = VARIANTS[name]
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    t = cu[-1] if cu else 537
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = len(cu) - 1 if cu else 1
    q = torch.randn(1, t, h, dk, device="cuda", generator=gen)
    k = F.normalize(torch.randn(1, t, h, dk, device="cuda", generator=gen), dim=-1)
    v = torch.randn(1, t, hv, dv, device="cuda", generator=gen)
    g = F.logsigmoid(torch.randn(1, t, hv, device="cuda", generator=gen))
    beta = torch.rand(1, t, hv, device="cuda", generator=gen).sigmoid()
    h0 = torch.randn(n, hv, dk, dv, device="cuda", generator=gen) if with_h0 else None
    if hv != h:  # our path takes equal heads: repeat q / k like the module does
        q, k = (x.repeat_interleave(hv // h, dim=2) for x in (q, k))
    wo = torch.randn(1, t, hv, dv, device="cuda", generator=gen)
    wf = torch.randn(n, hv, dk, dv, device="cuda", generator=gen)

    def step(fn, xs, **kw):
        xs = [x.clone().requires_grad_() if x is not None else None for x in xs]
        o, final = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
        loss = (o.float() * wo).sum() + (final.float() * wf).sum()
        grads = torch.autograd.grad(loss, [x for x in xs if x is not None])
        torch.cuda.synchronize()
        return [o.float(), final.float(), *(gr.float() for gr in grads)]

    kw = {}
    if cu:
        kw["cu_seqlens"] = torch.tensor(cu, device="cuda")
        if cucpu:
            kw["cu_seqlens_cpu"] = torch.tensor(cu)
    low = [q.to(dt[lo]), k.to(dt[lo]), v.to(dt[lo]), g.to(dt[gdt]), beta.to(dt[gdt]), h0]
    got = step(fla, low, **kw)
    ref = step(ours, [q, k, v, g, beta, h0], **({"cu_seqlens": kw["cu_seqlens"]} if cu else {}))
    errs = [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, ref)]
    print(f"{name} ok max_rel_err={max(errs):.2e} (o, final, grads: {' '.join(f'{e:.1e}' for e in errs)})", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
        sys.exit(0)
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for name in VARIANTS:
        p = subprocess.run([sys.executable, __file__, name], env=env, capture_output=True, text=True, timeout=300)
        if p.returncode == 0:
            print(p.stdout.strip().splitlines()[-1], flush=True)
        else:
            lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
            where = [ln.strip() for ln in lines if 'File "' in ln and "/fla/" in ln][-2:]
            print(f"{name} FAIL {lines[-1][:300] if lines else p.returncode} | {' | '.join(where)}", flush=True)

"""Transformer Engine's THD attention (Megatron's sequence packing: the flat baseline's attention) forward and
backward on the e2e benchmark's flat micro-batches, against each segment alone in fp32 (PyTorch SDPA): are its
outputs and gradients finite, and how far off? One line per (head dim, micro-batch, layout): ``packed`` (one THD
call, Megatron's sequence packing), ``alone`` (one THD call per segment), ``bshd`` (one causal BSHD call per segment).

    python benchmarks/te_thd_probe.py --model qwen3.5-hybrid-2b --workload grpo --head-dims 128,256
    python benchmarks/te_thd_probe.py --head-dims 192 --v-head-dim 128 --kv-heads 8   # MLA's shape

Found on the H200 (TE 2.20.2, cuDNN 9.14.0; ``benchmarks/results/te/te_thd_probe.txt``): the THD backward is wrong at
head dim 256 (packed or alone; BSHD right), right at 64, 128 and 192 / v 128; the fused RoPE is right.

Why: the ``qwen3.5-hybrid-2b`` flat baseline (head dim 256, GQA 4:1, bf16) got non-finite gradients from inside a
full-attention layer's backward on the H200 while the tree steps (other attention backends) stayed finite
(``benchmarks/results/te/e2e_qwen3.5-hybrid-2b_flat_nan_hooks.txt``). The segments are those
:func:`megatron_tree.mcore.packed_seq.thd_packed_seq_params` gives the flat step (each sequence, then the padding
slots as one more segment), ``attn_mask_type="padding_causal"`` as Megatron's THD path; TE picks its backend as
there (``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2`` prints which). Then megatron-core's fused THD RoPE (TE's kernel, what
``apply_rope_fusion`` runs on packed sequences) on the same segments against its unfused THD RoPE in fp32, with the
rotary dims the ``--rotary-percents`` give (Qwen3.5: 0.25 of a 256 head). Needs CUDA and Transformer Engine.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from e2e_bench import workloads

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.mcore.packed_seq import thd_packed_seq_params


def reference(q, k, v, cu, grad):
    """Each segment alone, fp32, causal: output [T, H, dv] and the gradients of ``(out * grad).sum()``."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, n, d]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(grad.float())
    return out.detach(), q.grad, k.grad, v.grad


def rope_check(t: torch.Tensor, cu: torch.Tensor, rotary_dim: int, max_seqlen: int) -> tuple[bool, str]:
    """megatron-core's ``apply_rotary_pos_emb`` on THD ``t`` [T, H, d] (bf16): fused (TE) vs unfused in fp32, output
    and input gradient; (finite, errors)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer import TransformerConfig

    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, device=t.device, dtype=torch.float32) / rotary_dim)
    angles = torch.outer(torch.arange(max_seqlen, device=t.device, dtype=torch.float32), inv_freq)
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]  # [max_s, 1, 1, rotary_dim], as RotaryEmbedding
    grad = torch.randn_like(t)
    results = []
    for fused, dtype in ((True, t.dtype), (False, torch.float32)):
        config = TransformerConfig(num_layers=1, hidden_size=t.shape[1] * t.shape[2], num_attention_heads=t.shape[1],
                                   apply_rope_fusion=fused)
        x = t.detach().to(dtype).requires_grad_()
        out = apply_rotary_pos_emb(x, freqs, config, cu_seqlens=cu)
        out.backward(grad.to(dtype))
        results.append((out.detach(), x.grad))
    (out, dx), (ref, ref_dx) = results
    finite = bool(torch.isfinite(out).all() and torch.isfinite(dx).all())
    return finite, f"out {rel(out, ref):.2e} dx {rel(dx, ref_dx):.2e}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> None:
    from transformer_engine.pytorch import DotProductAttention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.5-hybrid-2b", help="e2e_bench model (its vocabulary draws the tokens)")
    ap.add_argument("--workload", default="grpo")
    ap.add_argument("--max-tokens-per-mb", type=int, default=16384)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--head-dims", default="128,256")
    ap.add_argument("--v-head-dim", type=int, help="value head dim (default: the head dim; MLA: 192 with 128)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=3, help="probe the first N flat micro-batches")
    ap.add_argument("--rotary-percents", default="0.25,1.0")
    ap.add_argument("--layouts", default="packed,alone,bshd", help="TE calls to probe (see run_layout)")
    args = ap.parse_args()
    from megatron_tree.runtime import init_distributed

    init_distributed(seed=1, backend="nccl")  # megatron-core's RoPE reads the context-parallel group
    seqs = workloads(args.workload, np.random.default_rng(0), 1000, args.scale)
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb, packing_algorithm="kk"),
                     share_prefixes=False, pad_to_multiple_of=128)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d in map(int, args.head_dims.split(",")):
        dv = args.v_head_dim or d
        attention = {fmt: DotProductAttention(args.heads, (d, dv), num_gqa_groups=args.kv_heads, attention_dropout=0.0,
                                              qkv_format=fmt, attn_mask_type=mask).cuda()
                     for fmt, mask in (("thd", "padding_causal"), ("bshd", "causal"))}
        for i, mb in enumerate(mbs[: args.micro_batches]):
            params = thd_packed_seq_params(mb)
            cu = params.cu_seqlens_q.cuda()
            t = int(cu[-1])

            def rand(h, width=d):
                return torch.randn(t, h, width, generator=gen, device="cuda", dtype=torch.bfloat16)

            widths = ((args.heads, d), (args.kv_heads, d), (args.kv_heads, dv))
            q, k, v = (rand(h, w).requires_grad_() for h, w in widths)
            grad = rand(args.heads, dv)
            ref = reference(q, k, v, cu, grad)
            lengths = (cu[1:] - cu[:-1]).tolist()
            for layout in args.layouts.split(","):
                q.grad = k.grad = v.grad = None
                out = run_layout(attention, layout, q, k, v, cu, params.max_seqlen_q)
                out.backward(grad)
                got = (out.detach(), q.grad, k.grad, v.grad)
                finite = all(bool(torch.isfinite(x).all()) for x in got)
                errs = " ".join(f"{n} {rel(a, b):.2e}" for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref))
                dims = f"{d}" if dv == d else f"{d}/v{dv}"
                print(f"head_dim {dims} mb {i} {layout}: {t} slots, {len(lengths)} segments (longest "
                      f"{max(lengths)}, last {lengths[-1]}): finite={finite} {errs}", flush=True)
            for percent in map(float, args.rotary_percents.split(",")):
                finite, errs = rope_check(q.detach(), cu, int(d * percent), params.max_seqlen_q)
                print(f"  fused THD RoPE, rotary dim {int(d * percent)}: finite={finite} {errs}", flush=True)


def run_layout(attention: dict, layout: str, q, k, v, cu, max_seqlen: int) -> torch.Tensor:
    """TE's attention output [T, H, dv] over the THD segments ``cu`` of q, k, v [T, H, d]: ``packed`` one THD call
    (Megatron's sequence packing), ``alone`` one THD call per segment, ``bshd`` one causal [1, n, H, d] call per
    segment (an unpacked batch of one)."""
    if layout == "packed":
        return attention["thd"](q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                                max_seqlen_kv=max_seqlen).view(*q.shape[:2], v.shape[2])
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].clone() for x in (q, k, v))  # TE refuses views at an offset into the packed tensor
        shape = (b - a, q.shape[1], v.shape[2])
        if layout == "alone":
            one = torch.tensor([0, b - a], device=q.device, dtype=cu.dtype)
            outs.append(attention["thd"](qs, ks, vs, cu_seqlens_q=one, cu_seqlens_kv=one, max_seqlen_q=b - a,
                                         max_seqlen_kv=b - a).view(shape))
        elif layout == "bshd":
            outs.append(attention["bshd"](qs[None], ks[None], vs[None]).view(shape))
        else:
            raise ValueError(f"unknown layout {layout!r}: packed, alone or bshd")
    return torch.cat(outs)

if __name__ == "__main__":
    main()

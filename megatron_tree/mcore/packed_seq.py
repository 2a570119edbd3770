"""Flat micro-batches as Megatron's packed sequences (THD): the flat baseline users run.

Megatron's sequence packing feeds ``GPTModel`` one row of concatenated sequences together with
``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)``: Transformer Engine's
``TEDotProductAttention`` runs cuDNN fused attention causally within each segment, and RoPE
restarts at every segment. A flat :class:`~megatron_tree.core.microbatch.TreeMicroBatch`
(``pack_trees(..., share_prefixes=False)``: every sequence its own chain) has exactly that
layout: :func:`thd_packed_seq_params` describes it. :func:`thd_backward_refusal` says where that path's
gradients are known wrong.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_tree.core.microbatch import TreeMicroBatch

__all__ = ["THD_BACKWARD_WRONG_HEAD_DIMS", "thd_backward_refusal", "thd_packed_seq_params"]

THD_BACKWARD_WRONG_HEAD_DIMS = frozenset({256})
"""Head dims at which Transformer Engine's THD attention backward was measured wrong: 256 on the H200 (TE 2.20.2,
cuDNN 9.14.0 fused attention, bf16; dQ / dK / dV 0.5-1.0 off in relative terms or NaN, MHA and GQA 4:1, several
segments or one alone; its forward, the BSHD layout and head dims 64 / 128 / 192 with v 128 right:
``benchmarks/te_thd_probe.py``, ``benchmarks/results/te/te_thd_probe.txt``). Qwen3.5's / Qwen3-Next's / Gemma 3's
full-attention layers have head dim 256."""


def thd_backward_refusal(head_dim: int) -> str | None:
    """Why training through Megatron's THD sequence packing at ``head_dim`` is refused, or None."""
    if head_dim not in THD_BACKWARD_WRONG_HEAD_DIMS:
        return None
    return (
        f"Transformer Engine's THD (packed sequence) attention backward gives wrong gradients at head dim {head_dim} "
        f"(measured on the H200, TE 2.20.2 / cuDNN 9.14.0: dQ, dK, dV off by 50-100% or NaN; the forward is right); "
        f"train this model's flat baseline as chains through the tree model instead (build_tree_model, "
        f"pack_trees(..., share_prefixes=False), tree_forward_backward), which is exact there"
    )


def thd_packed_seq_params(mb: TreeMicroBatch) -> PackedSeqParams:
    """THD ``PackedSeqParams`` of the flat micro-batch ``mb`` (on ``mb``'s device; reads its
    ``position_ids`` on the host, so call it before moving ``mb`` to the GPU).

    Segments in slot order: each sequence (its slots start at depth 0), then the padding slots
    ``[num_tokens, T)`` as one more segment (they attend only among themselves and feed no
    target). ``cu_seqlens_q == cu_seqlens_kv`` int32 ``[segments + 1]``, ``max_seqlen`` = the
    longest segment. Raises ``ValueError`` for a micro-batch with shared prefixes.
    """
    if mb.num_tokens != mb.num_original_tokens:
        raise ValueError(
            f"THD packing needs a flat micro-batch (every sequence its own segment), but this one "
            f"shares prefixes: {mb.num_tokens} unique tokens for {mb.num_original_tokens} original; "
            f"pack with pack_trees(..., share_prefixes=False)"
        )
    depth = mb.position_ids[0, : mb.num_tokens]
    starts = torch.nonzero(depth == 0).flatten().to(torch.int32)
    ends = [mb.num_tokens] if mb.num_slots == mb.num_tokens else [mb.num_tokens, mb.num_slots]
    cu = torch.cat([starts, torch.tensor(ends, dtype=torch.int32, device=starts.device)])
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen
    )

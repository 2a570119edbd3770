"""Tree micro-batches without a branch: varlen causal attention through Transformer Engine's cuDNN kernel.

A micro-batch in which no node has two children (every sequence its own chain: no prefix is
shared, e.g. a batch of unrelated prompts, or the flat baseline's packing) is plain varlen causal
attention: each chain is one segment of a packed THD row. There the fastest dense kernel on the
GPU without FlashAttention-4, TE's cuDNN fused attention, computes exactly what the tree mask describes, so the ``auto``
backend (:mod:`megatron_tree.attention`) sends such micro-batches here instead of FlexAttention.

Shape legend: s = slots, np / ng = query / key-value heads per TP rank, hn = head dim.
"""

from __future__ import annotations

import functools

import torch

from megatron_tree.attention.shapes import AttentionShape, ProvenShapes

__all__ = ["PROVEN", "chain_segments", "refusal", "te_chain_attention"]

PROVEN = ProvenShapes.grid(
    head_dims=(64,), gqa_ratios=(4,), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="tests/attention/test_attention.py::test_chain_forest_through_te_matches_dense_bf16 (H200, TE 2.20.2)",
)
"""Where TE's cuDNN varlen kernel was proven exact through this module (forward and backward against the
dense reference); other calls do not take this path."""


def refusal(shape: AttentionShape, *, dropout_p: float) -> str | None:
    """Why a chain forest of ``shape`` does not go through TE's kernel here, None when it does."""
    if shape.windowed:  # TE's window_size is not wired or proven here: ``auto`` runs windowed layers elsewhere
        return "TE's chain path takes no sliding window here"
    if dropout_p:
        return f"TE's chain path takes no attention dropout here (attention_dropout={dropout_p})"
    if not PROVEN.proves(shape):
        return f"TE's cuDNN varlen attention is proven here {PROVEN.describe()}; this call is {shape}"
    return None


def chain_segments(subtree_end: torch.Tensor) -> torch.Tensor | None:
    """``cu_seqlens`` int32 ``[segments + 1]`` if the tree of ``subtree_end`` (int ``[1, s]``) is a
    forest of chains, else ``None``. One host sync.

    Slot j starts a chain iff j == 0 or the previous slot's subtree ends at j; the forest is chains
    iff every other slot's subtree ends where its predecessor's does (its only child's subtree is
    the rest of the chain). Padding slots (each its own subtree) are chains of one slot.
    """
    end = subtree_end[0]
    idx = torch.arange(1, end.shape[0], device=end.device, dtype=end.dtype)
    starts = end[:-1] == idx
    if not bool((starts | (end[1:] == end[:-1])).all()):
        return None
    first = torch.zeros(1, dtype=torch.int32, device=end.device)
    last = torch.full((1,), end.shape[0], dtype=torch.int32, device=end.device)
    return torch.cat([first, (idx[starts]).to(torch.int32), last])


@functools.cache
def _te_attention(heads: int, kv_heads: int, head_dim: int, scale: float):
    # No parameters, only kernel selection state: one instance per shape, outside any model's
    # module tree (so models' state dicts do not change).
    from transformer_engine.pytorch import DotProductAttention

    return DotProductAttention(
        heads, head_dim, num_gqa_groups=kv_heads, qkv_format="thd", attn_mask_type="padding_causal",
        softmax_scale=scale,
    )


def te_chain_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *, scale: float
) -> torch.Tensor:
    """Causal attention within each segment ``[cu_seqlens[k], cu_seqlens[k+1])`` by TE's fused kernel, on the
    shapes of :data:`PROVEN` only (``ValueError`` elsewhere).

    query ``[1, np, s, hn]``, key ``[1, ng, s, hn]``, value ``[1, ng, s, dv]`` (bf16, CUDA) -> ``[1, np, s, dv]``.
    """
    shape = AttentionShape.of(query, key, value)
    if not PROVEN.proves(shape):
        raise ValueError(refusal(shape, dropout_p=0.0))
    _, heads, slots, head_dim = query.shape
    attn = _te_attention(heads, key.shape[1], head_dim, float(scale))
    q, k, v = (t.squeeze(0).transpose(0, 1).contiguous() for t in (query, key, value))  # [s, heads, hn]
    out = attn(q, k, v, qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
               max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    return out.view(slots, heads, value.shape[-1]).transpose(0, 1).unsqueeze(0)

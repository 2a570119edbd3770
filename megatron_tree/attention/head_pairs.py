"""Grouped K/V heads with two query heads each, laid out per query head and back: the two element-wise steps of a
per-query-head GQA backward.

FA4's and cuDNN frontend's flex attention backward kernels add each query head's dK / dV into zero-filled fp32
buffers of the K/V heads with atomics and convert them in further kernels. On tree tiles that epilogue weighs (a key
tile is read by a mean of 23 / 15 query tiles on the 32k GRPO / multi-turn trees of ``attention_bench.py``, 128
causal), so the tree backends run the backward on K/V repeated to the query heads (each head's dK / dV written
directly) and add the pairs after: :func:`repeat_heads`, then :func:`add_head_pairs`.

Shapes: ``x`` ``[b, T, hkv, d]`` with its last dim contiguous, head-major (a ``[b, hkv, T, d]`` tensor transposed) or
token-major (Megatron's ``[T, b, hkv, d]`` permuted, or a THD ``[T, hkv, d]`` tensor unsqueezed); the results keep
that memory order. Query head i reads K/V head i // 2, as the kernels' own GQA.
"""

from __future__ import annotations

import torch

__all__ = ["add_head_pairs", "repeat_heads"]


def repeat_heads(x: torch.Tensor) -> torch.Tensor:
    """x ``[b, T, hkv, d]`` -> ``[b, T, 2 hkv, d]``, head i = x's head i // 2, in x's memory order; one copy kernel."""
    b, t, h, d = x.shape
    head_major = x.stride(2) > x.stride(1)
    y = torch.empty(b, 2 * h, t, d, dtype=x.dtype, device=x.device).transpose(1, 2) if head_major \
        else torch.empty(b, t, 2 * h, d, dtype=x.dtype, device=x.device)
    y.unflatten(2, (h, 2)).copy_(x.unsqueeze(3))
    return y


def add_head_pairs(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x ``[b, T, 2 hkv, d]`` -> ``[b, T, hkv, d]`` laid out as ``like``, head j = x's heads 2j and 2j + 1 added (one
    kernel: torch adds bf16 / fp16 in fp32 and rounds once)."""
    pairs = x.unflatten(2, (like.shape[2], 2))
    return torch.add(pairs[:, :, :, 0], pairs[:, :, :, 1], out=torch.empty_like(like))

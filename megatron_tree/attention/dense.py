"""The ``"dense"`` tree attention backend: PyTorch SDPA with the materialised ``[Tq, T]`` tree mask.

The reference every other backend is tested against; runs on any device and dtype, with
attention dropout and with a sliding window. Memory and time grow with Tq * T, so it is for tests and small micro-batches.
Backend interface: :class:`megatron_tree.attention.TreeAttentionBackend`.
"""

from __future__ import annotations

import torch

from megatron_tree.core.masks import dense_tree_mask

__all__ = ["attend", "prepare"]


def prepare(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """The dense mask bool ``[b, 1, Tq, T]`` (True = attend; the head dim broadcasts); ``window``: a sliding
    window of that many path tokens (:mod:`megatron_tree.core.masks`), None = none."""
    return torch.stack([dense_tree_mask(row, query_slots, window) for row in subtree_end]).unsqueeze(1)


def attend(query, key, value, prepared, *, scale, dropout_p):
    """SDPA over query ``[b, np, Tq, hn]``, key/value ``[b, ng, T, hn]`` / ``[b, ng, T, dv]`` with the mask from
    :func:`prepare`. GQA through SDPA's ``enable_gqa`` (the kernel sums each key/value head's gradient over its
    query heads in its own accumulator; repeating K/V and summing their bf16 gradients doubled dK's error)."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=prepared, dropout_p=dropout_p, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )


def refusal(shape, *, batch: int, dropout_p: float) -> None:
    """Backend ``refusal``: the dense reference computes every call (any head dims, GQA ratio, dtype, device,
    sliding window or not)."""
    return None

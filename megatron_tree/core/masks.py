"""Materialise attention masks from the interval encoding (no Megatron import).

The interval encoding of a DFS-ordered tree is one int vector ``subtree_end`` of length T:
key j is visible to query i iff ``j <= i < subtree_end[j]``. Example, sequences
``[a b c]`` and ``[a b d e]`` -> trie a-b-{c, d-e}, slots ``a b c d e``::

    slot        a  b  c  d  e          query\\key  a b c d e
    depth       0  1  2  2  3              a      1 . . . .
    subtree_end 5  5  3  5  5              b      1 1 . . .
                                           c      1 1 1 . .
                                           d      1 1 . 1 .
                                           e      1 1 . 1 1
"""

from __future__ import annotations

import torch


def dense_tree_mask(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None) -> torch.Tensor:
    """Dense mask ``[Tq, T]`` bool, True = attend (PyTorch SDPA convention), from ``subtree_end`` [T] or [1, T].

    ``query_slots`` int [Tq]: the slot of each query row (context parallel: a rank's queries);
    None = every slot in order (Tq = T). Megatron's convention is the opposite (True = masked out):
    negate at that boundary.
    """
    end = subtree_end.reshape(-1)
    t = end.shape[0]
    idx = torch.arange(t, device=end.device)
    q = (idx if query_slots is None else query_slots.reshape(-1).to(idx))[:, None]
    k = idx[None, :]
    return (k <= q) & (q < end[None, :].to(idx.dtype))

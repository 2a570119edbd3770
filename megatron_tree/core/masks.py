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

Sliding window (``window`` W >= 1, Hugging Face's ``sliding_window``; megatron-core's
``window_size=(W - 1, 0)``): key j is visible to query i iff j is an ancestor-or-self of i and
``depth(i) - depth(j) < W``. Along the path to the root, depth and slot grow together, so this is
``window_start[i] <= j <= i < subtree_end[j]`` with ``window_start[i]`` the slot of i's ancestor at
depth ``max(depth(i) - W + 1, 0)`` (:func:`window_starts`). With W = 2 above: d sees b and d, e sees
d and e, c sees b and c.
"""

from __future__ import annotations

import torch


def check_window(window: int | None) -> None:
    """Raise unless ``window`` is None (no sliding window) or an int >= 1 (keys per query path, self included)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"window must be None or an int >= 1 (Hugging Face's sliding_window: a query sees the keys at most "
            f"window - 1 tokens above it on its path), got {window!r}"
        )


def tree_depths(subtree_end: torch.Tensor) -> torch.Tensor:
    """Depth of every slot, int64 ``[T]``, from ``subtree_end`` [T] or [1, T]: how many ancestors it has (roots 0).

    ``depth[i] = #{j : j < i < subtree_end[j]}``: +1 at ``j + 1`` and -1 at ``subtree_end[j]`` for every
    j, then a prefix sum (O(T), no host sync). Along a root path it equals the RoPE position minus
    the root's (positions grow by one per step), so depth differences are position differences.
    """
    end = subtree_end.reshape(-1).long()
    t = end.shape[0]
    delta = torch.zeros(t + 1, dtype=torch.long, device=end.device)
    delta[1:] += 1
    delta.index_add_(0, end, torch.full_like(end, -1))
    return delta.cumsum(0)[:t]


def window_starts(subtree_end: torch.Tensor, window: int) -> torch.Tensor:
    """``window_start`` int64 ``[T]``: the first slot each query sees under a sliding ``window`` (module docstring).

    ``window_start[i]`` is the slot of i's ancestor(-or-self) at depth ``max(depth(i) - window + 1, 0)``:
    in DFS pre-order that ancestor is the last slot ``j <= i`` of that depth (every slot between it and i
    lies in its subtree, deeper). Found for all slots at once by a ``searchsorted`` over the slots sorted
    by (depth, slot): O(T log T), no host sync. A padding slot (``subtree_end[j] == j + 1`` after the
    trees) starts its own window.
    """
    check_window(window)
    end = subtree_end.reshape(-1)
    t = end.shape[0]
    depth = tree_depths(end)
    slot = torch.arange(t, device=end.device)
    key = depth * (t + 1) + slot  # unique, ordered by (depth, slot)
    ordered = key.sort().values
    target = (depth - (window - 1)).clamp_min(0)
    pos = torch.searchsorted(ordered, target * (t + 1) + slot, right=True) - 1
    return ordered[pos] - target * (t + 1)


def tree_parents(subtree_end: torch.Tensor) -> torch.Tensor:
    """The parent slot of every slot, int64 ``[T]`` (-1 for roots), from ``subtree_end`` [T] or [1, T]: its
    ancestor one level up, the first slot of a sliding window of 2 (:func:`window_starts`). O(T log T), no host
    sync."""
    end = subtree_end.reshape(-1)
    return torch.where(tree_depths(end) > 0, window_starts(end, 2), -1)


def dense_tree_mask(
    subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None, window: int | None = None
) -> torch.Tensor:
    """Dense mask ``[Tq, T]`` bool, True = attend (PyTorch SDPA convention), from ``subtree_end`` [T] or [1, T].

    ``query_slots`` int [Tq]: the slot of each query row (context parallel: a rank's queries);
    None = every slot in order (Tq = T). ``window``: a sliding window of that many path tokens
    (module docstring), None = none. Megatron's convention is the opposite (True = masked out):
    negate at that boundary.
    """
    end = subtree_end.reshape(-1)
    t = end.shape[0]
    idx = torch.arange(t, device=end.device)
    q = (idx if query_slots is None else query_slots.reshape(-1).to(idx))[:, None]
    k = idx[None, :]
    mask = (k <= q) & (q < end[None, :].to(idx.dtype))
    if window is not None:
        mask &= k >= window_starts(end, window)[q.clamp_min(0)]
    return mask

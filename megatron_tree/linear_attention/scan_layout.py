"""The scan layout of a tree micro-batch: what recurrent (linear-attention) layers need from ``subtree_end``.

Shape legend: T = slots of the micro-batch (padding included), K = causal conv kernel width,
S = segments, L = levels, N_l = segments of level l, T_l = slots of level l.

A recurrent layer (Gated DeltaNet, Mamba) reads each slot's *root path*: the causal conv reads the
K - 1 nearest ancestors, the state scan carries one state along the path. In DFS pre-order a
*segment* is a maximal single-child chain: it is one contiguous slot range, the scan runs along it
as along a plain sequence, and it starts from the final state of its *parent segment* (the one
holding the parent of its first slot). Segments at the same *level* (depth in segments) are
independent, so a scan needs one batched call per level. Example, sequences ``[a b c]``,
``[a b d e]`` and ``[f]`` then one padding slot ``p``::

    slot         a  b  c  d  e  f  p        segments   [a b] [c] [d e] [f] [p]
    subtree_end  5  5  3  5  5  6  7        parent      -1    0    0   -1  -1
    parent      -1  0  1  1  3 -1 -1        level        0    1    1    0   0
    depth        0  1  2  2  3  0  0        level 0: [a b] [f] [p]   level 1: [c] [d e]

The conv ancestors with K = 3 (two ancestors, farthest first; T = 7 marks "no ancestor")::

    slot   a  b  c  d  e  f  p
    col 0  7  7  0  0  1  7  7
    col 1  7  0  1  1  3  7  7
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from megatron_tree.core.masks import tree_depths, window_starts
from megatron_tree.core.tree import concat_ranges

__all__ = ["TreeScanLayout", "packed_scan_layout", "tree_scan_layout"]


@dataclass(frozen=True, kw_only=True, eq=False)
class TreeScanLayout:
    """Parents, conv ancestors, segments and levels of a DFS-ordered forest (module docstring).

    Built once per micro-batch by :func:`tree_scan_layout`, read by every recurrent layer (and recompute).

    Device tensors (on ``subtree_end``'s device; move with :meth:`to`), all int64:
      parent            [T]       parent slot of each slot, -1 for roots (padding slots are roots).
      conv_ancestors    [T, K-1]  column c holds the ancestor ``K - 1 - c`` steps up the root path
                                  (farthest first, column K-2 = the parent), ``T`` where the path is shorter
                                  (the index of a zero row appended to the input).
      level_slots       L x [T_l] the slots of level l's segments, segment after segment in slot order.
      level_cu_seqlens  L x [N_l+1] offsets of level l's segments in ``level_slots[l]`` (FlashAttention's
                                  ``cu_seqlens``).
      level_parent      L x [N_l] index of each segment's parent among level l-1's segments
                                  (level 0: empty, its segments start from a zero state).
      scan_position     [T]       row of each slot in ``torch.cat(level_slots)``.

    Host-side (numpy int64 / ints; reading them never syncs a device):
      num_slots         int       T.
      conv_kernel       int       K.
      segment_start     [S]       first slot of each segment, ascending.
      segment_len       [S]       slots of each segment.
      segment_parent    [S]       parent segment, -1 for a root segment.
      segment_level     [S]       depth in segments (roots 0).
      level_lengths     L x tuple[int, ...]   segment lengths of each level (``level_cu_seqlens`` on the host).
    """

    parent: torch.Tensor
    conv_ancestors: torch.Tensor
    level_slots: tuple[torch.Tensor, ...]
    level_cu_seqlens: tuple[torch.Tensor, ...]
    level_parent: tuple[torch.Tensor, ...]
    scan_position: torch.Tensor
    num_slots: int
    conv_kernel: int
    segment_start: np.ndarray
    segment_len: np.ndarray
    segment_parent: np.ndarray
    segment_level: np.ndarray
    level_lengths: tuple[tuple[int, ...], ...]

    @property
    def num_levels(self) -> int:
        """L: levels (the tree's depth in segments); a scan makes one batched call per level."""
        return len(self.level_lengths)

    @property
    def device(self) -> torch.device:
        return self.parent.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TreeScanLayout":
        """Copy with every tensor (and tuple of tensors) on ``device``; host-side fields shared."""
        moved = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                moved[f.name] = value.to(device, non_blocking=non_blocking)
            elif isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
                moved[f.name] = tuple(t.to(device, non_blocking=non_blocking) for t in value)
        return dataclasses.replace(self, **moved)


def tree_scan_layout(subtree_end: torch.Tensor, *, conv_kernel: int) -> TreeScanLayout:
    """The :class:`TreeScanLayout` of ``subtree_end`` int [T] or [1, T] (the interval encoding: key j is
    visible to query i iff ``j <= i < subtree_end[j]``; a padding slot j has ``subtree_end[j] == j + 1``).

    ``conv_kernel`` K >= 1 is the causal conv's width (Qwen3-Next: ``linear_conv_kernel_dim`` = 4).
    Vectorised numpy on the host (one copy of ``subtree_end`` to the host per micro-batch), O(T log T),
    plus a Python step per level. Raises ``ValueError`` for a vector that is not a DFS interval encoding.
    """
    if isinstance(conv_kernel, bool) or not isinstance(conv_kernel, int) or conv_kernel < 1:
        raise ValueError(f"conv_kernel must be an int >= 1 (the causal conv's width, HF linear_conv_kernel_dim), "
                         f"got {conv_kernel!r}")
    if not isinstance(subtree_end, torch.Tensor):
        raise ValueError(f"subtree_end must be a torch.Tensor (int [T] or [1, T]), got {type(subtree_end).__name__}")
    if subtree_end.is_floating_point() or subtree_end.is_complex() or subtree_end.dtype == torch.bool:
        raise ValueError(f"subtree_end must hold integers (int32 or int64), got dtype {subtree_end.dtype}")
    if not (subtree_end.ndim == 1 or (subtree_end.ndim == 2 and subtree_end.shape[0] == 1)) or subtree_end.numel() == 0:
        raise ValueError(f"subtree_end must be [T] or [1, T] with T >= 1, got shape {tuple(subtree_end.shape)}")
    device = subtree_end.device
    end = subtree_end.detach().reshape(-1).cpu().numpy().astype(np.int64)
    t = end.shape[0]
    slot = np.arange(t, dtype=np.int64)
    bad = np.flatnonzero((end <= slot) | (end > t))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"subtree_end[{j}] = {int(end[j])} is outside ({j}, {t}]: every slot's subtree ends after "
                         f"the slot and at most at T = {t} (a padding slot j has subtree_end[j] = j + 1)")

    parent, depth = _parents(end)
    conv_ancestors = _ancestors(parent, conv_kernel - 1)

    # segments: a slot starts one unless it is the only child of the slot before it
    children = np.bincount(parent[parent >= 0], minlength=t)
    prev = slot - 1
    starts_here = (parent != prev) | (children[np.maximum(prev, 0)] > 1)
    starts_here[0] = True
    segment_id = np.cumsum(starts_here) - 1
    segment_start = np.flatnonzero(starts_here)
    segment_len = np.diff(np.append(segment_start, t))
    first_parent = parent[segment_start]
    segment_parent = np.where(first_parent >= 0, segment_id[np.maximum(first_parent, 0)], -1)
    # level = segment starts among the ancestors-or-self of a segment's first slot, minus one
    on_path = np.cumsum(starts_here) - np.cumsum(np.bincount(end, weights=starts_here, minlength=t + 1)[:t])
    segment_level = on_path[segment_start].astype(np.int64) - 1

    by_level = np.argsort(segment_level, kind="stable")
    level_count = np.bincount(segment_level)
    rank_in_level = np.empty_like(by_level)
    rank_in_level[by_level] = np.arange(by_level.shape[0]) - np.repeat(np.cumsum(level_count) - level_count,
                                                                       level_count)
    level_slots, level_cu, level_parent, level_lengths = [], [], [], []
    first = 0
    for count in level_count.tolist():
        segs = by_level[first : first + count]
        first += count
        lens = segment_len[segs]
        level_slots.append(concat_ranges(segment_start[segs], lens))
        level_cu.append(np.concatenate([[0], np.cumsum(lens)]))
        level_parent.append(rank_in_level[segment_parent[segs]] if segment_parent[segs[0]] >= 0
                            else np.zeros(0, np.int64))
        level_lengths.append(tuple(lens.tolist()))
    scan_position = np.empty(t, np.int64)
    scan_position[np.concatenate(level_slots)] = slot

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    return TreeScanLayout(
        parent=dev(parent),
        conv_ancestors=dev(conv_ancestors),
        level_slots=tuple(dev(a) for a in level_slots),
        level_cu_seqlens=tuple(dev(a) for a in level_cu),
        level_parent=tuple(dev(a) for a in level_parent),
        scan_position=dev(scan_position),
        num_slots=t,
        conv_kernel=conv_kernel,
        segment_start=segment_start,
        segment_len=segment_len,
        segment_parent=segment_parent,
        segment_level=segment_level,
        level_lengths=tuple(level_lengths),
    )


def packed_scan_layout(cu_seqlens: torch.Tensor, *, conv_kernel: int) -> TreeScanLayout:
    """The :class:`TreeScanLayout` of independent sequences packed in one row (THD, FlashAttention's varlen
    layout): sequence n holds slots ``[cu_seqlens[n], cu_seqlens[n+1])``, a chain of its own, so its conv window
    and its state start at its first slot. One level, one segment per non-empty sequence.

    ``cu_seqlens`` int [N+1], rising from 0 to T; ``conv_kernel`` as :func:`tree_scan_layout`. Tensors on
    ``cu_seqlens``' device (one copy to the host). Raises ``ValueError`` for offsets that do not rise from 0.
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool \
            or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be an int tensor [N+1] with N >= 1 (offsets of the packed sequences), got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} of shape "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    cu = cu_seqlens.detach().cpu().numpy().astype(np.int64)
    lens = np.diff(cu)
    if cu[0] != 0 or cu[-1] < 1 or (lens < 0).any():
        raise ValueError(f"cu_seqlens must rise from 0 to T >= 1 (offsets of the packed sequences), got "
                         f"{cu[:8].tolist()}{'...' if cu.shape[0] > 8 else ''} ending at {int(cu[-1])}")
    end = torch.from_numpy(np.repeat(cu[1:], lens)).to(cu_seqlens.device)  # each slot's subtree: its sequence's rest
    return tree_scan_layout(end, conv_kernel=conv_kernel)


def _parents(end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(parent [T], depth [T]) of a DFS interval encoding ``end`` [T]; ``ValueError`` if the intervals cross.

    ``depth[i] = #{j : j < i < end[j]}`` (:func:`~megatron_tree.core.masks.tree_depths`); the parent of a slot is
    its ancestor one level up, the first slot of a sliding window of 2
    (:func:`~megatron_tree.core.masks.window_starts`).
    """
    t = end.shape[0]
    end_t = torch.from_numpy(end)
    depth = tree_depths(end_t).numpy()
    parent = np.where(depth > 0, window_starts(end_t, 2).numpy(), -1)
    # a valid encoding nests: the parent's subtree holds the slot's subtree
    child = np.flatnonzero(depth > 0)
    p = parent[child]
    end_p = end[np.clip(p, 0, t - 1)]
    bad = child[(p < 0) | (p >= child) | (end_p < end[child]) | (end_p <= child)]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"subtree_end is not a DFS interval encoding: the subtree of slot {i} [{i}, {int(end[i])}) "
                         f"crosses an enclosing subtree (subtree_end around it: "
                         f"{end[max(i - 4, 0): i + 5].tolist()} from slot {max(i - 4, 0)}); build it with "
                         f"pack_trees, or nest every subtree inside its parent's")
    return parent, depth


def _ancestors(parent: np.ndarray, count: int) -> np.ndarray:
    """[T, count]: column c is the ancestor ``count - c`` steps up (farthest first), T where there is none."""
    t = parent.shape[0]
    table = np.empty((t, count), np.int64)
    up = np.arange(t, dtype=np.int64)
    lookup = np.append(parent, -1)  # lookup[-1] = lookup[t] = -1: no ancestor stays no ancestor
    for c in range(count - 1, -1, -1):
        up = lookup[up]
        table[:, c] = up
    table[table < 0] = t
    return table

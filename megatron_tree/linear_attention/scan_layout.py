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

A *chunk* of a tree larger than a micro-batch (:mod:`megatron_tree.core.chunks`) comes as ``subtree_end``
``[C + T]``: C context slots (the root path above its first slot, computed by earlier chunks) then its T own
slots. Only the own slots are scanned. The R distinct context slots that own slots hang from are *carried*:
the layer passes, per carried slot, the state the scan ended with there and its conv *window* (the K - 1 conv
inputs a child reads: the slot and its K - 2 nearest ancestors, farthest first, zero above a root). Own
slots hanging from one start from that state, and their conv reads the window's rows. Conversely the
``state_exports`` (own slots whose state later chunks read) each end a segment, so the scan ends with their
state; the layout says where (``level_exports``, ``export_order``) and which conv inputs form their window
(``export_windows``). In the module docstring's example cut after ``b`` (context ``a b`` and own ``c d e f
p``), ``c`` and ``d`` hang from the carried ``b``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from megatron_tree.core.masks import tree_depths, tree_parents
from megatron_tree.core.tree import concat_ranges

__all__ = ["TreeScanLayout", "packed_scan_layout", "tree_scan_layout"]


@dataclass(frozen=True, kw_only=True, eq=False)
class TreeScanLayout:
    """Parents, conv ancestors, segments and levels of a DFS-ordered forest (module docstring).

    Built once per micro-batch by :func:`tree_scan_layout`, read by every recurrent layer (and recompute).

    Slots are the T own slots (a chunk's context slots are not scanned); W = R * (K - 1) carried window rows,
    Q = state exports (module docstring; R = Q = 0 for a whole micro-batch).

    Device tensors (on ``subtree_end``'s device; move with :meth:`to`), all int64:
      parent            [T]       parent slot of each slot, -1 for roots and for slots hanging from the context
                                  (padding slots are roots).
      conv_ancestors    [T, K-1]  column c holds the ancestor ``K - 1 - c`` steps up the root path
                                  (farthest first, column K-2 = the parent) as a row of the conv's extended
                                  input ``[W carried window rows | T slots | a zero row]``: ``W + slot`` for a
                                  slot, ``(K - 1) r + c'`` for row c' of carried window r, ``W + T`` (the zero
                                  row) where the path is shorter.
      level_slots       L x [T_l] the slots of level l's segments, segment after segment in slot order.
      level_cu_seqlens  L x [N_l+1] offsets of level l's segments in ``level_slots[l]`` (FlashAttention's
                                  ``cu_seqlens``).
      level_parent      L x [N_l] index of each segment's parent among level l-1's segments
                                  (level 0: empty, its segments start from a zero or a carried state).
      root_carried      [N_0]     carried state each level-0 segment starts from, R for a zero state.
      scan_position     [T]       row of each slot in ``torch.cat(level_slots)``.
      export_windows    [Q, K-1]  rows of the extended conv input that form each state export's window.
      level_exports     L x [Q_l] the segments of level l (index among them) that end at a state export.
      export_order      [Q]       row of each state export in ``torch.cat`` of the level picks.

    Host-side (numpy int64 / ints; reading them never syncs a device):
      num_slots         int       T.
      conv_kernel       int       K.
      context_len       int       C.
      carried_parents   [R]       context slot of each carried state, ascending (root first).
      state_exports     [Q]       own slots whose state (and window) the scan hands out, ascending.
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
    root_carried: torch.Tensor
    scan_position: torch.Tensor
    export_windows: torch.Tensor
    level_exports: tuple[torch.Tensor, ...]
    export_order: torch.Tensor
    num_slots: int
    conv_kernel: int
    context_len: int
    carried_parents: np.ndarray
    state_exports: np.ndarray
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
    def num_carried(self) -> int:
        """R: carried states (and conv windows) the scan starts from."""
        return self.carried_parents.shape[0]

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


def tree_scan_layout(subtree_end: torch.Tensor, *, conv_kernel: int, context: int = 0,
                     state_exports=()) -> TreeScanLayout:
    """The :class:`TreeScanLayout` of ``subtree_end`` int [C + T] or [1, C + T] (the interval encoding: key j is
    visible to query i iff ``j <= i < subtree_end[j]``; a padding slot j has ``subtree_end[j] == j + 1``).

    ``conv_kernel`` K >= 1 is the causal conv's width (Qwen3-Next: ``linear_conv_kernel_dim`` = 4). ``context``
    C >= 0: the first C slots are a chunk's context, a root path (module docstring); ``state_exports``: own slots
    (ints in ``[0, T)``, ascending) whose state and conv window the scan hands out. Vectorised numpy on the host
    (one copy of ``subtree_end`` to the host per micro-batch), O(T log T), plus a Python step per level. Raises
    ``ValueError`` for a vector that is not a DFS interval encoding, a context that is not a root path, or bad
    state exports.
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
    total = subtree_end.numel()
    if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context < total:
        raise ValueError(f"context must be an int in [0, {total}) (the context slots in front of a chunk's own), "
                         f"got {context!r}")
    device = subtree_end.device
    end = subtree_end.detach().reshape(-1).cpu().numpy().astype(np.int64)
    slot = np.arange(total, dtype=np.int64)
    bad = np.flatnonzero((end <= slot) | (end > total))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"subtree_end[{j}] = {int(end[j])} is outside ({j}, {total}]: every slot's subtree ends "
                         f"after the slot and at most at T = {total} (a padding slot j has subtree_end[j] = j + 1)")

    full_parent, depth = _parents(end)
    c = context
    if c and not np.array_equal(depth[:c], np.arange(c)):
        raise ValueError(f"the {c} context slots must be a root path (slot i at depth i), got depths "
                         f"{depth[:c][:8].tolist()}...; pass the chunk's context_mask (TreeMicroBatch.context_mask)")
    t = total - c
    end, slot = end[c:] - c, slot[:t]
    hung = full_parent[c:]
    parent = np.where(hung >= c, hung - c, -1)
    from_context = (hung >= 0) & (hung < c)
    carried_parents = np.unique(hung[from_context])
    exports = np.asarray(state_exports, np.int64).reshape(-1)
    if exports.size and (exports[0] < 0 or exports[-1] >= t or np.any(np.diff(exports) <= 0)):
        raise ValueError(f"state_exports must be ascending own slots in [0, {t}), got {exports[:8].tolist()}...; "
                         f"pass TreeChunk.state_exports")

    # conv: the carried windows are chains of K - 1 rows in front of the slots (row K - 2 = the carried slot)
    k1 = conv_kernel - 1
    w = carried_parents.shape[0] * k1
    ext_parent = np.concatenate([np.where(np.arange(w) % max(k1, 1) > 0, np.arange(w) - 1, -1),
                                 np.where(parent >= 0, parent + w, -1)])
    if k1:
        ext_parent[w + slot[from_context]] = np.searchsorted(carried_parents, hung[from_context]) * k1 + k1 - 1
    ext_ancestors = _ancestors(ext_parent, k1)  # [W + T, K-1], W + T = the zero row
    conv_ancestors = ext_ancestors[w:]
    export_windows = np.concatenate([ext_ancestors[w + exports, 1:], w + exports[:, None]], 1)[:, :k1]

    # segments: a slot starts one unless it is the only child of the slot before it, which is no state export
    children = np.bincount(parent[parent >= 0], minlength=t)
    prev = slot - 1
    starts_here = (parent != prev) | (children[np.maximum(prev, 0)] > 1)
    starts_here[0] = True
    starts_here[exports[exports + 1 < t] + 1] = True
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
    carried_of = np.full(t, carried_parents.shape[0], np.int64)
    carried_of[from_context] = np.searchsorted(carried_parents, hung[from_context])
    root_carried = carried_of[segment_start[by_level[: level_count[0]]]]

    export_segment = segment_id[exports]
    assert np.array_equal(segment_start[export_segment] + segment_len[export_segment] - 1, exports)
    export_level = segment_level[export_segment]
    export_by_level = np.argsort(export_level, kind="stable")
    export_order = np.empty_like(export_by_level)
    export_order[export_by_level] = np.arange(exports.shape[0])
    level_exports = [rank_in_level[export_segment[export_by_level][export_level[export_by_level] == lev]]
                     for lev in range(level_count.shape[0])]

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    return TreeScanLayout(
        parent=dev(parent),
        conv_ancestors=dev(conv_ancestors),
        level_slots=tuple(dev(a) for a in level_slots),
        level_cu_seqlens=tuple(dev(a) for a in level_cu),
        level_parent=tuple(dev(a) for a in level_parent),
        root_carried=dev(root_carried),
        scan_position=dev(scan_position),
        export_windows=dev(export_windows),
        level_exports=tuple(dev(a) for a in level_exports),
        export_order=dev(export_order),
        num_slots=t,
        conv_kernel=conv_kernel,
        context_len=c,
        carried_parents=carried_parents,
        state_exports=exports,
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

    ``depth[i] = #{j : j < i < end[j]}`` and the parents as :mod:`megatron_tree.core.masks` finds them
    (:func:`~megatron_tree.core.masks.tree_depths`, :func:`~megatron_tree.core.masks.tree_parents`).
    """
    t = end.shape[0]
    end_t = torch.from_numpy(end)
    depth = tree_depths(end_t).numpy()
    parent = tree_parents(end_t).numpy()
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

"""Prefix forest of token sequences, laid out in DFS pre-order (no Megatron import).

Legend: n = sequences, L_i = length of sequence i, T = unique tokens (slots), M = nodes.

The forest is built without per-token Python loops: sort the sequences (a prefix sorts
before its extensions), take the longest common prefix (LCP) of each adjacent pair, and
emit sequence r's tokens from depth ``lcp[r]`` on. Concatenating those emissions in sorted
order is exactly the DFS pre-order of the trie, so every subtree is one contiguous slot
range. Tiny example, sequences ``[a b c]``, ``[a b d e]``, ``[a b c]`` (a duplicate)::

    sorted      a b c | a b c | a b d e        lcp = [0, 3, 2]
    emitted     a b c |       |     d e        slots: a b c d e
    trie        a ─ b ┬ c                      nodes: [a b] [c] [d e]
                      └ d ─ e                  subtree_end: 5 5 3 5 5

Chains of single-child tokens are compressed into nodes; a node is a slot range
``[node_start, node_start + node_len)`` whose tokens all share one ``subtree_end``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True)
class TokenForest:
    """A prefix forest in DFS pre-order. All arrays are numpy int64.

    Per slot [T]:  ``tokens``, ``depth`` (= position in every sequence through it),
                   ``subtree_end`` (exclusive end of the slot's subtree: key j is visible to
                   query i iff ``j <= i < subtree_end[j]``).
    Per node [M]:  ``node_start``, ``node_len``, ``node_parent`` (-1 for roots), nodes sorted
                   by ``node_start`` (so parents come before children).
    Per input sequence [n]: ``seq_node`` (node holding the sequence's last token),
                   ``seq_len``, ``seq_rank`` (position in DFS order; sequences of one subtree
                   have consecutive ranks).
    """

    tokens: np.ndarray
    depth: np.ndarray
    subtree_end: np.ndarray
    node_start: np.ndarray
    node_len: np.ndarray
    node_parent: np.ndarray
    seq_node: np.ndarray
    seq_len: np.ndarray
    seq_rank: np.ndarray

    @property
    def num_tokens(self) -> int:
        """T: unique tokens."""
        return int(self.tokens.shape[0])

    @property
    def num_original_tokens(self) -> int:
        """Sum of sequence lengths."""
        return int(self.seq_len.sum())

    def path_nodes(self, seq: int) -> np.ndarray:
        """Nodes from the root to sequence ``seq``'s last token, root first."""
        out = []
        node = int(self.seq_node[seq])
        while node >= 0:
            out.append(node)
            node = int(self.node_parent[node])
        return np.asarray(out[::-1], dtype=np.int64)

    def path_slots(self, seqs: Sequence[int]) -> np.ndarray:
        """Slots along each sequence's root-to-leaf path, concatenated: ``[sum L_i]``.

        Sequence ``seqs[k]``'s slot at depth d is ``out[offset_k + d]``.
        """
        nodes = [self.path_nodes(s) for s in seqs]
        nodes = np.concatenate(nodes) if nodes else np.zeros(0, np.int64)
        return concat_ranges(self.node_start[nodes], self.node_len[nodes])


def concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for each (s, l), vectorised."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    seg_begin = np.cumsum(lens) - lens
    return np.repeat(starts - seg_begin, lens) + np.arange(total, dtype=np.int64)


def as_sequences(
    sequences: Sequence | torch.Tensor | np.ndarray, attention_mask: torch.Tensor | np.ndarray | None = None
) -> list[np.ndarray]:
    """Normalise the two input forms to a list of 1-D int64 numpy arrays.

    * a list of 1-D int sequences (lists, numpy arrays or tensors), ``attention_mask=None``;
    * a padded ``input_ids`` [B, S] with ``attention_mask`` [B, S] (1 = token), every row
      left- or right-padded (its ones contiguous and touching one end).

    Raises ``ValueError`` for empty sequences, negative tokens, mismatched shapes and masks
    that are not left/right padding.
    """
    if attention_mask is not None:
        ids = _to_numpy(sequences)
        mask = _to_numpy(attention_mask)
        if ids.ndim != 2 or mask.shape != ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must both be [B, S] with the same shape; got "
                f"{tuple(ids.shape)} and {tuple(mask.shape)}"
            )
        mask = mask.astype(bool)
        lens = mask.sum(1)
        first = mask.argmax(1)
        # A row is valid iff its ones form one run that starts at 0 or ends at S-1.
        width = ids.shape[1]
        last = width - 1 - mask[:, ::-1].argmax(1)
        run_ok = (last - first + 1) == lens
        end_ok = (first == 0) | (last == width - 1)
        bad = np.flatnonzero((lens > 0) & ~(run_ok & end_ok))
        if bad.size:
            raise ValueError(
                f"attention_mask row {int(bad[0])} is not left or right padding (its ones must be one "
                f"contiguous run touching the start or the end of the row): {mask[bad[0]].astype(int).tolist()}"
            )
        seqs = [ids[b, first[b] : first[b] + lens[b]] for b in range(ids.shape[0])]
    else:
        if isinstance(sequences, (torch.Tensor, np.ndarray)) and _to_numpy(sequences).ndim == 2:
            raise ValueError(
                "a 2-D input_ids tensor needs its attention_mask (pack_trees(input_ids, spec, "
                "attention_mask=mask)); pass a list of 1-D sequences otherwise"
            )
        seqs = [_to_numpy(s) for s in sequences]
    out = []
    for i, s in enumerate(seqs):
        if s.ndim != 1:
            raise ValueError(f"sequence {i} must be 1-D, got shape {tuple(s.shape)}")
        if s.size == 0:
            raise ValueError(f"sequence {i} is empty; every sequence needs at least one token")
        if not np.issubdtype(s.dtype, np.integer):
            raise ValueError(f"sequence {i} must hold integer token ids, got dtype {s.dtype}")
        s = s.astype(np.int64, copy=False)
        if s.min() < 0:
            raise ValueError(f"sequence {i} holds a negative token id {int(s.min())}; token ids must be >= 0")
        out.append(s)
    if not out:
        raise ValueError("got no sequences; pass at least one non-empty sequence")
    return out


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def build_forest(sequences: list[np.ndarray]) -> TokenForest:
    """Build the prefix forest of ``sequences`` (1-D int64 arrays, validated by :func:`as_sequences`).

    Duplicates and sequences that are a prefix of another are normal input: they share
    every slot with the sequence they repeat. Work is O(total tokens) in numpy plus
    O(n + M) Python steps; nothing loops per token.
    """
    n = len(sequences)
    keys = [s.astype(">i8", copy=False).tobytes() for s in sequences]  # big-endian: bytes order = token order
    order = np.asarray(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
    srt = [sequences[i] for i in order]
    lens = np.fromiter((s.shape[0] for s in srt), np.int64, n)
    lcp = np.zeros(n + 1, np.int64)
    for r in range(1, n):
        lcp[r] = _lcp(srt[r - 1], srt[r]) if keys[order[r - 1]][:8] == keys[order[r]][:8] else 0
    lcp[n] = -1  # sentinel: ends every subtree
    emit = lens - lcp[:n]
    start = np.zeros(n + 1, np.int64)
    np.cumsum(emit, out=start[1:])

    flat = np.concatenate(srt)
    pos = np.arange(flat.shape[0], dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    keep = pos >= np.repeat(lcp[:n], lens)
    tokens = flat[keep]
    depth = pos[keep]

    # next strictly smaller lcp to the right (monotonic stack over sequences)
    nxt = np.full(n + 1, n, np.int64)
    stack: list[int] = []
    lcp_l = lcp.tolist()
    for r in range(1, n + 1):
        while stack and lcp_l[r] < lcp_l[stack[-1]]:
            nxt[stack.pop()] = r
        stack.append(r)

    # Nodes of sequence r's emitted segment [lcp_r, len_r): split at the strict prefix-minima
    # ("stair") of lcp after r that lie inside the segment. A node starting at depth b ends its
    # subtree where the first later sequence with lcp <= b begins.
    nd_start, nd_len, nd_end, seq_node_sorted = [], [], [], np.empty(n, np.int64)
    nxt_l, lens_l, start_l = nxt.tolist(), lens.tolist(), start.tolist()
    for r in range(n):
        lo, hi = lcp_l[r], lens_l[r]
        if lo == hi:  # duplicate of the previous sequence
            seq_node_sorted[r] = seq_node_sorted[r - 1]
            continue
        p = r + 1
        cuts = []  # (depth, sequence that branches there), descending depth
        while lcp_l[p] > lo:
            if lcp_l[p] < hi:
                cuts.append((lcp_l[p], p))
            p = nxt_l[p]
        seg_end_seq = p  # first later sequence with lcp <= lo
        bounds = [lo] + [d for d, _ in reversed(cuts)] + [hi]
        ends = [start_l[seg_end_seq]] + [start_l[q] for _, q in reversed(cuts)]
        base = start_l[r] - lo
        for k in range(len(bounds) - 1):
            nd_start.append(base + bounds[k])
            nd_len.append(bounds[k + 1] - bounds[k])
            nd_end.append(ends[k])
        seq_node_sorted[r] = len(nd_start) - 1

    node_start = np.asarray(nd_start, np.int64)
    node_len = np.asarray(nd_len, np.int64)
    node_end = np.asarray(nd_end, np.int64)
    subtree_end = np.repeat(node_end, node_len)

    # Parents: nodes are already in start order; a stack of open subtrees gives each one's parent.
    parent = np.full(node_start.shape[0], -1, np.int64)
    open_nodes: list[int] = []
    ns_l, ne_l = node_start.tolist(), node_end.tolist()
    for u in range(len(ns_l)):
        while open_nodes and ne_l[open_nodes[-1]] <= ns_l[u]:
            open_nodes.pop()
        if open_nodes:
            parent[u] = open_nodes[-1]
        open_nodes.append(u)

    seq_node = np.empty(n, np.int64)
    seq_node[order] = seq_node_sorted
    seq_rank = np.empty(n, np.int64)
    seq_rank[order] = np.arange(n)
    seq_len = np.empty(n, np.int64)
    seq_len[order] = lens
    return TokenForest(
        tokens=tokens,
        depth=depth,
        subtree_end=subtree_end,
        node_start=node_start,
        node_len=node_len,
        node_parent=parent,
        seq_node=seq_node,
        seq_len=seq_len,
        seq_rank=seq_rank,
    )


def chain_forest(sequences: list[np.ndarray]) -> TokenForest:
    """The forest with no sharing: every sequence its own chain, laid out in input order.

    This is the packed flat layout (block-diagonal causal attention), the baseline that
    tree packing is measured against.
    """
    n = len(sequences)
    lens = np.fromiter((s.shape[0] for s in sequences), np.int64, n)
    ends = np.cumsum(lens)
    starts = ends - lens
    return TokenForest(
        tokens=np.concatenate(sequences),
        depth=np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(starts, lens),
        subtree_end=np.repeat(ends, lens),
        node_start=starts,
        node_len=lens,
        node_parent=np.full(n, -1, np.int64),
        seq_node=np.arange(n, dtype=np.int64),
        seq_len=lens,
        seq_rank=np.arange(n, dtype=np.int64),
    )

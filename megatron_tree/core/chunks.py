"""Cut a tree larger than a micro-batch into chunks that share their ancestors' work (no Megatron import).

Legend: G = slots of the tree (its own forest, DFS pre-order), k = chunks, T = a chunk's slots,
C = its context slots, E = its exported slots.

A chunk is a contiguous DFS slot range ``[a, b)``. Every slot of it whose ancestor lies before ``a``
is in the subtree of that ancestor, which therefore is an ancestor of slot ``a``: the *context* of
the chunk, everything it needs from earlier chunks, is the root path above ``a`` (C slots, root
first). Likewise the slots of ``[a, b)`` that any later chunk needs are the ancestors of slot ``b``
inside the chunk: its *exported* slots, a root path too. A later chunk's context takes a prefix
(the shallowest slots) of each earlier chunk's exported slots. Example, capacity 3::

    trie  a ─ b ┬ c ─ d      slots        a b c | d e f     subtree_end 6 6 4 4 6 6
                └ e ─ f      chunk 0      a b c             exports a b c (the ancestors of d)
                             chunk 1      d e f             context a b c; context_mask 6 6 4 | 4 6 6
                                                            (e and f see a b, not c: c's subtree ends at d)

``[context | own slots]`` is itself a DFS pre-order tree whose interval vector is the context slots'
subtree ends and the own slots' (both clipped to the chunk's end, shifted by C): the chunk's
``context_mask``. Its depths are the global ones, so RoPE positions and sliding windows stay exact.

Backward order: chunk c's exported keys and values receive gradients from every chunk that reads
them, the chunks starting before the end of c's shallowest exported slot's subtree
(``TreeChunk.last_reader``); c's backward runs after theirs.

Memory: a chunk whose readers are still to come waits (forward done, backward not yet) with its activations, so a
long path keeps many chunks. :func:`recompute_plan` picks the waiting chunks that keep nothing but their exported
keys and values (and recurrent states): they run their forward once more right before their backward
(``TreeChunk.recompute``; ``recompute_uniform`` in expert parallel's order), so the waiting chunks keep at most
``max_kept`` slots of activations at any time.

Recurrent layers (Gated DeltaNet) read no keys but a state at the parent of each slot whose parent lies in
an earlier chunk. Those parents are exported slots of their chunk (``TreeChunk.state_exports``: in the
example, c is the parent of d and b of e, so chunk 0 keeps its state at b and c), and each chunk lists the
ones its own slots hang from (``TreeChunk.carried``: chunk 1 carries chunk 0's b and c). The states there
are read by chunks that read the context anyway, so ``last_reader`` orders their backwards too.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megatron_tree.core.masks import tree_parents
from megatron_tree.core.microbatch import TreeChunk, TreeMicroBatch
from megatron_tree.core.tree import TokenForest, build_forest, chain_forest

def ancestors_before(forest: TokenForest, a: int) -> np.ndarray:
    """The ancestors of slot ``a`` (the root path above it), ascending: int64 ``[depth[a]]``; a walk up the nodes."""
    u = int(np.searchsorted(forest.node_start, a, side="right")) - 1
    parts = [np.arange(int(forest.node_start[u]), a)]
    v = int(forest.node_parent[u])
    while v >= 0:
        parts.append(np.arange(int(forest.node_start[v]), int(forest.node_start[v] + forest.node_len[v])))
        v = int(forest.node_parent[v])
    return np.concatenate(parts[::-1])


def chunk_bounds(forest: TokenForest, capacity: int) -> np.ndarray:
    """Chunk boundaries ``[0, b_1, ..., G]`` (int64 ``[k + 1]``), each chunk at most ``capacity`` slots.

    A cut ``b`` (chunk ``[a, b)``) is *free* where the chunk exports nothing (no slot of it is an ancestor of
    ``b``: a new subtree hangs from an earlier chunk there, the next sample of a prompt), so no later chunk keeps
    the chunk waiting: its backward runs right after its forward. Each cut is the last free one in
    ``a + ceil(capacity / 2) .. a + capacity``; else the last free one before (a short chunk that brings the cuts
    back onto the subtrees); else ``a + capacity`` (inside one long sequence nothing is free).
    """
    g = forest.num_tokens
    bounds = [0]
    while g - bounds[-1] > capacity:
        a = bounds[-1]
        above = np.sort(forest.subtree_end[ancestors_before(forest, a)])  # ends of a's ancestors
        cuts = np.arange(a + 1, a + capacity + 1)
        shared = above.shape[0] - np.searchsorted(above, cuts, side="right")  # ancestors of a still open at b
        free = cuts[forest.depth[cuts] == shared]  # none of b's ancestors inside [a, b)
        full = free[free >= a + -(-capacity // 2)]
        bounds.append(int(full[-1]) if full.size else int(free[-1]) if free.size else a + capacity)
    bounds.append(g)
    return np.asarray(bounds, np.int64)


def released_after(last_reader: np.ndarray, uniform: bool = False) -> np.ndarray:
    """The forward after which each chunk's backward runs: int64 ``[k]`` (``k`` or more: after every forward).

    last_reader  int ``[k]`` (``TreeChunk.last_reader``).
    uniform      expert parallel's order: every forward, then every backward in reverse.

    The chunk driver (``megatron_tree.mcore.chunk_schedule``) runs the chunks as a stack: after chunk c's forward
    it runs the backward of every chunk on top whose last reader has run; chunk 0's comes after all. So chunk i
    keeps its graph through the forwards of chunks ``i+1 .. released_after[i]`` (uniform: through all of them).
    """
    k = last_reader.shape[0]
    if uniform:
        return 2 * k - np.arange(k)  # the backwards in reverse after the last forward, chunk 0's last
    release = np.full(k, k, np.int64)  # chunk 0's backward runs after every forward
    stack: list[int] = []
    for c in range(k):
        stack.append(c)
        while len(stack) > 1 and last_reader[stack[-1]] <= c:
            release[stack.pop()] = c
    return release


def recompute_plan(slots: np.ndarray, last_reader: np.ndarray, max_kept: int, uniform: bool = False) -> np.ndarray:
    """Which chunks of a tree recompute their forward right before their backward: bool ``[k]``.

    slots        int ``[k]``: each chunk's own slots; last_reader: int ``[k]`` (``TreeChunk.last_reader``).
    max_kept     the most slots of activations the waiting chunks may keep during any chunk's forward.
    uniform      plan for expert parallel's order: every forward, then every backward in reverse.

    Chunk i waits through the forwards of chunks ``i+1 .. released_after[i]`` (:func:`released_after`). Greedy in
    forward order: where the waiting chunks that keep their activations exceed ``max_kept`` slots, the one released
    last (it would hold them longest) is recomputed instead, until the rest fit. In the stack order a chunk that
    nobody reads never waits and is never recomputed. Cost: in a chain (one long sequence) the chunk released last
    is the one nearest the root, whose forward (attention over its ancestors only) is the cheapest per slot; on the
    benchmark batches the plan's extra forward FLOPs equal the fewest that keep the budget
    (``benchmarks/chunk_memory.py``, by exhaustive search).
    """
    k = slots.shape[0]
    release = released_after(last_reader, uniform)
    recompute = np.zeros(k, bool)
    index = np.arange(k)
    for c in range(1, k):
        waiting = np.flatnonzero((index < c) & (release >= c) & ~recompute)
        waiting = waiting[np.lexsort((-slots[waiting], -release[waiting]))]  # released last first
        kept = slots[waiting].sum()
        if kept > max_kept:
            kept_after = kept - np.cumsum(slots[waiting])  # kept once the first j + 1 are recomputed
            recompute[waiting[: int(np.argmax(kept_after <= max_kept)) + 1]] = True
    return recompute


def build_chunks(
    seqs: list[np.ndarray],
    ids: list[int],
    capacity: int,
    group: int,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    share_prefixes: bool = True,
    max_kept: int | None = None,
) -> list[TreeMicroBatch]:
    """The chunk micro-batches of the forest of ``seqs[i] for i in ids`` (``ids`` ascending), tree ``group`` of
    the pack, each at most ``capacity`` slots (module docstring); the waiting chunks keep at most ``max_kept``
    slots of activations (:func:`recompute_plan`; None: ``capacity``). Each chunk holds the parts of the sequences
    that pass through its slots (``target_starts``, ``sequence_ends``); a part's targets are those its slots
    predict. ``share_prefixes=False`` lays each sequence out as its own chain first."""
    forest = (build_forest if share_prefixes else chain_forest)([seqs[i] for i in ids])
    end, depth, tokens = forest.subtree_end, forest.depth, forest.tokens
    bounds = chunk_bounds(forest, capacity)
    k = bounds.shape[0] - 1
    starts = bounds[:-1]

    # Every sequence's root path, as entries (sequence, depth) -> slot, with its label (next token).
    lens = forest.seq_len
    paths = forest.path_slots(range(len(ids)))  # [sum L]
    seq_of = np.repeat(np.arange(len(ids)), lens)
    pos = depth[paths]
    is_last = pos == np.repeat(lens - 1, lens)
    flat = np.concatenate([seqs[i] for i in ids])
    labels = np.roll(flat, -1)  # valid where not is_last
    chunk_of_entry = np.searchsorted(starts, paths, side="right") - 1

    # Parents of slots in a later chunk (ascending): what recurrent layers carry across chunks.
    parent = tree_parents(torch.from_numpy(end)).numpy()
    chunk_of_slot = np.searchsorted(starts, np.arange(forest.num_tokens), side="right") - 1
    has_parent = parent >= 0
    crossing = has_parent & (chunk_of_slot[np.maximum(parent, 0)] != chunk_of_slot)
    carried_slots = np.unique(parent[crossing])
    first_carried = np.searchsorted(carried_slots, bounds)  # chunk c's are carried_slots[first[c]:first[c + 1]]

    exports: list[np.ndarray] = []
    out = []
    for c in range(k):
        a, b = int(bounds[c]), int(bounds[c + 1])
        ctx = ancestors_before(forest, a)  # the context: root first
        exp = a + np.flatnonzero(end[a:b] > b)  # ancestors of slot b inside the chunk
        src = np.searchsorted(starts, ctx, side="right") - 1
        chunk_ids, counts = np.unique(src, return_counts=True)
        for s_id, n in zip(chunk_ids.tolist(), counts.tolist()):
            assert np.array_equal(ctx[src == s_id], exports[s_id][:n]), "context must be a prefix of exports"
        exports.append(exp)
        last_reader = c if exp.size == 0 else int(np.searchsorted(starts, end[exp[0]], side="left")) - 1
        own_end = np.minimum(end[a:b], b) - a
        ctx_end = np.minimum(end[ctx], b) - a
        hung_from = np.unique(parent[a:b][(parent[a:b] < a) & has_parent[a:b]])  # root first
        from_chunk = chunk_of_slot[hung_from]
        row = np.searchsorted(carried_slots, hung_from) - first_carried[from_chunk]
        chunk = TreeChunk(group=group, index=c, size=k, last_reader=last_reader,
                          sources=tuple(zip(chunk_ids.tolist(), counts.tolist())),
                          state_exports=tuple((carried_slots[first_carried[c] : first_carried[c + 1]] - a).tolist()),
                          carried=tuple(zip(from_chunk.tolist(), row.tolist())))
        sel = chunk_of_entry == c
        out.append(_chunk_micro_batch(
            ids, tokens[a:b], depth[a:b], own_end, ctx.size + np.concatenate([ctx_end, own_end]), exp - a, chunk,
            seq_of[sel], pos[sel], paths[sel] - a, is_last[sel], labels[sel], pad_to_multiple_of, pad_token_id,
        ))  # fmt: skip
    plan = (np.diff(bounds), np.array([mb.chunk.last_reader for mb in out]), capacity if max_kept is None else max_kept)
    flags = zip(recompute_plan(*plan).tolist(), recompute_plan(*plan, uniform=True).tolist())
    return [dataclasses.replace(mb, chunk=dataclasses.replace(mb.chunk, recompute=stack, recompute_uniform=uniform))
            for mb, (stack, uniform) in zip(out, flags)]


def _chunk_micro_batch(ids, tokens, depth, own_end, context_end, export, chunk, seq_of, pos, slots, is_last, labels,
                       pad_to_multiple_of, pad_token_id) -> TreeMicroBatch:
    """One chunk from its slots and the path entries ``(seq_of, pos) -> slots`` that lie in it (grouped by
    sequence, ascending depth)."""
    t_real = tokens.shape[0]
    t = -(-t_real // pad_to_multiple_of) * pad_to_multiple_of
    pad = t - t_real
    held = np.flatnonzero(np.diff(seq_of, prepend=-1))  # first entry of each held sequence's part
    last = np.append(held[1:], seq_of.shape[0]) - 1
    counts = last - held + 1
    ends = is_last[last]
    targets = ~is_last
    cu = np.zeros(held.shape[0] + 1, np.int64)
    np.cumsum(counts - ends, out=cu[1:])
    pad_end = np.arange(t_real + 1, t + 1, dtype=np.int64)
    c = context_end.shape[0] - t_real
    return TreeMicroBatch(
        input_ids=torch.from_numpy(np.concatenate([tokens, np.full(pad, pad_token_id, np.int64)]))[None],
        position_ids=torch.from_numpy(np.concatenate([depth, np.zeros(pad, np.int64)]))[None],
        attention_mask=torch.from_numpy(np.concatenate([own_end, pad_end]).astype(np.int32))[None],
        cu_targets=torch.from_numpy(cu.astype(np.int32)),
        logprob_slots=torch.from_numpy(slots[targets]),
        logprob_labels=torch.from_numpy(labels[targets]),
        multiplicity=torch.from_numpy(np.bincount(slots, minlength=t))[None],
        last_slots=torch.from_numpy(slots[last]),
        sequence_ids=[ids[s] for s in seq_of[held].tolist()],
        seq_lens=counts.tolist(),
        num_tokens=t_real,
        context_mask=torch.from_numpy(np.concatenate([context_end, c + pad_end]).astype(np.int32))[None],
        export_slots=torch.from_numpy(export) if export.size else None,
        chunk=chunk,
        target_starts=pos[held].tolist(),
        sequence_ends=ends.tolist(),
    )

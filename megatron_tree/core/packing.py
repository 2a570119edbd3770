"""Pack a batch of sequences into tree micro-batches (no Megatron import).

Plan on the global prefix forest, then build each micro-batch's own forest:

1. Items. A root tree whose cost (its unique tokens) fits ``max_tokens_per_mb`` is one item:
   its sequences stay together and keep all their sharing. A tree that does not fit is
   split at its first node with several children: each child subtree becomes a piece that
   carries a copy of the path above it, and the pieces are re-merged under that path into
   as many groups as first-fit decreasing needs, balanced by least load where that fits,
   so siblings keep sharing it wherever they fit together. Recurse as needed.
2. Granularity: items holding sequences of the same run of ``granularity`` inputs are merged.
3. Bins. The count is FFD's minimum, raised to ``n_mbs``, rounded up to a multiple of
   ``n_mbs_divisor`` and, with a data-parallel group, the maximum over its ranks. Items
   are then placed by "ffd" (decreasing, each into the least-loaded bin with room; plain
   first-fit if that gets stuck) or "kk" (Karmarkar–Karp differencing, used only when no
   bin overflows, else "ffd"). An item's cost counts its shared path once per item, so a
   bin's real size never exceeds its planned load. Documented margin, property-tested:
   "kk"'s spread (max - min load) never exceeds "ffd"'s by more than the largest item.
4. Each bin becomes a :class:`TreeMicroBatch` built from its own forest (bins left empty
   become one-slot padding micro-batches that hold no sequence).

With ``chunk_trees`` nothing is split at branch points: every root tree is an item, and an item
larger than ``max_tokens_per_mb`` (a tree, or the trees one granule keeps together) becomes a run
of *chunks* (:func:`build_chunks`): its DFS slot range cut into contiguous ranges of half to all of the
capacity where they export the fewest keys and values to later chunks, each a micro-batch whose queries
also attend to its context, the ancestors of its first slot computed by earlier chunks. No token is
computed twice, except the forwards of chunks that wait for later readers beyond ``max_kept_tokens``
(:func:`~megatron_tree.core.chunks.recompute_plan`), run once more right before their backward.
The chunks of a tree follow the bins' micro-batches, consecutively, and count as one micro-batch
(one step of Megatron's schedule) for ``n_mbs``, ``n_mbs_divisor`` and the data-parallel count.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np
import torch

from megatron_tree.core.chunks import build_chunks
from megatron_tree.core.microbatch import TreeMicroBatch
from megatron_tree.core.microbatch_spec import MicroBatchSpec
from megatron_tree.core.tree import TokenForest, as_sequences, build_forest, chain_forest


def pack_trees(
    sequences: Sequence | torch.Tensor,
    spec: MicroBatchSpec,
    *,
    attention_mask: torch.Tensor | None = None,
    dp_group: "torch.distributed.ProcessGroup | None" = None,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    share_prefixes: bool = True,
) -> list[TreeMicroBatch]:
    """Pack ``sequences`` into micro-batches of prefix trees.

    sequences       list of 1-D int sequences, or a padded ``input_ids`` [B, S] together with
                    ``attention_mask`` [B, S] (left or right padding).
    spec            capacity, micro-batch count constraints, granularity and algorithm.
    dp_group        data-parallel process group: every rank gets the same micro-batch count
                    (one all-reduce); extra micro-batches hold no sequence.
    pad_to_multiple_of  each micro-batch's slot count T is padded up to a multiple of this.
    share_prefixes  False packs every sequence as its own chain (block-diagonal causal
                    attention): the flat baseline, with the same capacity and count rules.

    Returns the micro-batches; every input sequence is in exactly one of them
    (``mb.sequence_ids``), in ascending input order within a micro-batch.
    """
    if not isinstance(spec, MicroBatchSpec):
        raise TypeError(f"spec must be a MicroBatchSpec, got {type(spec).__name__}")
    if pad_to_multiple_of <= 0:
        raise ValueError(f"pad_to_multiple_of must be positive, got {pad_to_multiple_of}")
    # An empty batch is allowed (a data-parallel rank with no sequences this step).
    seqs = as_sequences(sequences, attention_mask) if len(sequences) else []
    cap = spec.max_tokens_per_mb
    lens = np.fromiter((s.shape[0] for s in seqs), np.int64, len(seqs))
    too_long = np.flatnonzero(lens > cap)
    if too_long.size and not spec.chunk_trees:
        i = int(too_long[0])
        raise ValueError(
            f"sequence {i} has {int(lens[i])} tokens, more than max_tokens_per_mb={cap} "
            f"({too_long.size} sequence(s) too long in all); pack with MicroBatchSpec(chunk_trees=True) (the launcher's "
            f"--chunk-trees: chunks that read their ancestors' keys and values or recurrent states; not under "
            f"pipeline or context parallel), raise max_tokens_per_mb to at least "
            f"{int(lens.max())}, or truncate those sequences"
        )
    plan_cap = np.iinfo(np.int64).max if spec.chunk_trees else cap  # chunking: whole root trees are the items
    if not share_prefixes:
        items, costs = [np.array([i]) for i in range(len(seqs))], lens.tolist()
    else:
        items, costs = plan_items(build_forest(seqs), plan_cap) if seqs else ([], [])
    if spec.granularity > 1:
        items, costs = _merge_granules(items, costs, seqs, spec.granularity, cap, spec.chunk_trees, share_prefixes)
    big = [i for i, c in enumerate(costs) if c > cap]  # only with chunk_trees
    small = [i for i, c in enumerate(costs) if c <= cap]
    k = _bin_count([costs[i] for i in small], spec, cap, dp_group, len(big))
    bins = assign_bins([costs[i] for i in small], k, cap, spec.packing_algorithm)
    out = []
    for members in bins:
        ids = sorted(int(s) for it in members for s in items[small[it]])
        out.append(build_micro_batch(seqs, ids, pad_to_multiple_of, pad_token_id, share_prefixes))
    for group, it in enumerate(big):
        ids = sorted(int(s) for s in items[it])
        out.extend(build_chunks(seqs, ids, cap, group, pad_to_multiple_of, pad_token_id, share_prefixes,
                                spec.max_kept_tokens))
    return out


def plan_items(forest: TokenForest, capacity: int) -> tuple[list[np.ndarray], list[int]]:
    """Split the forest into groups of sequences (input indices) that each fit ``capacity``.

    Returns ``(items, costs)``: ``items[i]`` the sequence indices of item i, ``costs[i]`` an
    upper bound of its unique tokens (exact for whole root trees).
    """
    node_end = forest.subtree_end[forest.node_start]
    size = node_end - forest.node_start
    prefix = forest.depth[forest.node_start]  # tokens above the node, copied into each split piece
    by_rank = np.argsort(forest.seq_rank)  # input index of each DFS-ordered sequence
    term_start = forest.node_start[forest.seq_node[by_rank]]  # nondecreasing
    children: dict[int, list[int]] = {}
    for u, p in enumerate(forest.node_parent.tolist()):
        children.setdefault(p, []).append(u)

    def seqs_in(lo: int, hi: int) -> np.ndarray:
        a, b = np.searchsorted(term_start, [lo, hi])
        return by_rank[a:b]

    def split(u: int) -> list[tuple[np.ndarray, int]]:
        """Items covering node u's subtree, each fitting capacity (u's path counted in each)."""
        done: list[tuple[np.ndarray, int]] = []  # items from children that had to be split
        path = int(prefix[u] + forest.node_len[u])
        start = int(forest.node_start[u])
        pieces: list[tuple[np.ndarray, int]] = []  # (sequences, tokens below u)
        own = seqs_in(start, start + 1)  # sequences ending inside node u
        if own.size:
            pieces.append((own, 0))
        for v in children.get(u, []):
            if path + size[v] <= capacity:
                pieces.append((seqs_in(int(forest.node_start[v]), int(node_end[v])), int(size[v])))
            else:
                done.extend(split(v))
        # First-fit decreasing of the pieces under u's path sets the group count; the pieces
        # are then spread over that many groups by least load where that fits too, so a split
        # tree gives balanced parts (a smaller largest micro-batch) at the same cost.
        pieces.sort(key=lambda p: -p[1])
        loads: list[int] = []
        groups: list[list[np.ndarray]] = []
        for members, tok in pieces:
            for b in range(len(loads)):
                if path + loads[b] + tok <= capacity:
                    loads[b] += tok
                    groups[b].append(members)
                    break
            else:
                loads.append(tok)
                groups.append([members])
        even_loads, even_groups = [0] * len(loads), [[] for _ in loads]
        for members, tok in pieces:
            b = int(np.argmin(even_loads))
            even_loads[b] += tok
            even_groups[b].append(members)
        if path + max(even_loads, default=0) <= capacity:
            loads, groups = even_loads, even_groups
        return done + [(np.concatenate(g), path + ld) for g, ld in zip(groups, loads)]

    items: list[np.ndarray] = []
    costs: list[int] = []
    for root in children.get(-1, []):
        if size[root] <= capacity:
            items.append(seqs_in(int(forest.node_start[root]), int(node_end[root])))
            costs.append(int(size[root]))
            continue
        for members, cost in split(root):
            items.append(members)
            costs.append(cost)
    return items, costs


def _merge_granules(
    items: list[np.ndarray], costs: list[int], seqs: list[np.ndarray], g: int, capacity: int, chunk: bool = False,
    share: bool = True,
) -> tuple[list[np.ndarray], list[int]]:
    """Merge items that hold sequences of the same granule (inputs ``[k*g, (k+1)*g)``); ``chunk``: a merged
    item may exceed ``capacity`` (it becomes chunks); ``share=False``: items are chains, their costs add up."""
    parent = list(range(len(items)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[int, int] = {}
    for it, members in enumerate(items):
        for granule in np.unique(members // g).tolist():
            if granule in owner:
                parent[find(it)] = find(owner[granule])
            else:
                owner[granule] = it
    merged: dict[int, list[int]] = {}
    for it in range(len(items)):
        merged.setdefault(find(it), []).append(it)
    out_items, out_costs = [], []
    for group in merged.values():
        members = np.concatenate([items[i] for i in group])
        cost = sum(costs[i] for i in group)
        if cost > capacity and share:  # the merged items may share prefixes across them
            cost = build_forest([seqs[i] for i in members.tolist()]).num_tokens
        if cost > capacity and not chunk:
            raise ValueError(
                f"granularity={g} keeps sequences {sorted(members.tolist())[:8]}... together, but "
                f"they hold {cost} {'unique ' if share else ''}tokens, more than max_tokens_per_mb={capacity}; lower "
                f"granularity, raise max_tokens_per_mb or pack with MicroBatchSpec(chunk_trees=True)"
            )
        out_items.append(members)
        out_costs.append(int(cost))
    return out_items, out_costs


def _first_fit_decreasing(costs: Sequence[int], capacity: int, n_bins: int | None = None) -> list[list[int]]:
    """Plain FFD: items by decreasing cost into the first bin with room (opening bins as needed,
    or among exactly ``n_bins`` bins, which must suffice)."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads: list[int] = [0] * (n_bins or 0)
    bins: list[list[int]] = [[] for _ in loads]
    for i in order:
        for b in range(len(loads)):
            if loads[b] + costs[i] <= capacity:
                loads[b] += costs[i]
                bins[b].append(i)
                break
        else:
            if n_bins is not None:
                raise AssertionError("FFD ran out of bins it was promised")
            loads.append(costs[i])
            bins.append([i])
    return bins


def _bin_count(costs: list[int], spec: MicroBatchSpec, capacity: int, dp_group, chunked: int = 0) -> int:
    """Bins for the items ``costs``, besides ``chunked`` chunked trees (each one step of the schedule): the
    step count ``bins + chunked`` is at least ``n_mbs``, a multiple of ``n_mbs_divisor``, the same on every
    rank of ``dp_group``."""
    k = max(len(_first_fit_decreasing(costs, capacity)) + chunked, spec.n_mbs)
    k = -(-k // spec.n_mbs_divisor) * spec.n_mbs_divisor
    if dp_group is not None:
        import torch.distributed as dist

        device = "cuda" if dist.get_backend(dp_group) == "nccl" else "cpu"
        t = torch.tensor([k], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        k = int(t.item())  # a max of multiples of the divisor is one too
    return k - chunked


def assign_bins(costs: Sequence[int], k: int, capacity: int, algorithm: str) -> list[list[int]]:
    """Place items (by cost) into exactly ``k`` bins of ``capacity``; returns item indices per bin.

    ``k`` must be at least FFD's bin count. "ffd": decreasing cost, each item into the
    least-loaded bin that has room (plain first-fit if none has). "kk": Karmarkar–Karp
    k-way differencing, replaced by "ffd" if any of its bins overflows.
    """
    if algorithm == "kk":
        bins = _karmarkar_karp(costs, k)
        if all(sum(costs[i] for i in b) <= capacity for b in bins):
            return bins
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [0] * k
    bins = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k)]  # (load, bin)
    for i in order:
        stash = []
        while heap and heap[0][0] + costs[i] > capacity:
            stash.append(heapq.heappop(heap))
        if not heap:  # least-loaded placement got stuck: FFD into k bins always fits
            return _first_fit_decreasing(costs, capacity, k)
        load, b = heapq.heappop(heap)
        loads[b] = load + costs[i]
        bins[b].append(i)
        heapq.heappush(heap, (loads[b], b))
        for entry in stash:
            heapq.heappush(heap, entry)
    return bins


def _karmarkar_karp(costs: Sequence[int], k: int) -> list[list[int]]:
    """Largest differencing method for a k-way partition (unbounded bins)."""
    heap = []
    for i, c in enumerate(costs):
        sums = [c] + [0] * (k - 1)
        members = [[i]] + [[] for _ in range(k - 1)]
        heapq.heappush(heap, (-c, i, sums, members))  # key: -(max - min)
    if not heap:
        return [[] for _ in range(k)]
    tie = len(costs)
    while len(heap) > 1:
        _, _, sa, ma = heapq.heappop(heap)
        _, _, sb, mb = heapq.heappop(heap)
        ia = sorted(range(k), key=lambda j: -sa[j])  # largest of A with smallest of B
        ib = sorted(range(k), key=lambda j: sb[j])
        sums = [sa[x] + sb[y] for x, y in zip(ia, ib)]
        members = [ma[x] + mb[y] for x, y in zip(ia, ib)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tie, sums, members))
        tie += 1
    _, _, sums, members = heap[0]
    order = sorted(range(k), key=lambda j: -sums[j])
    return [sorted(members[j]) for j in order]


def build_micro_batch(
    seqs: list[np.ndarray],
    ids: list[int],
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    share_prefixes: bool = True,
) -> TreeMicroBatch:
    """The micro-batch holding sequences ``seqs[i] for i in ids`` (may be empty: one padding slot);
    ``share_prefixes=False`` lays each sequence out as its own chain."""
    if ids:
        forest = (build_forest if share_prefixes else chain_forest)([seqs[i] for i in ids])
        lens = forest.seq_len
        paths = forest.path_slots(range(len(ids)))  # [sum L]
        last = np.cumsum(lens) - 1
        not_last = np.ones(paths.shape[0], bool)
        not_last[last] = False
        slots = paths[not_last]
        last_slots = paths[last]
        labels = np.concatenate([seqs[i][1:] for i in ids])
        tokens, depth, end = forest.tokens, forest.depth, forest.subtree_end
    else:
        lens = np.zeros(0, np.int64)
        paths = slots = last_slots = labels = tokens = depth = end = np.zeros(0, np.int64)
    t_real = tokens.shape[0]
    t = max(-(-max(t_real, 1) // pad_to_multiple_of) * pad_to_multiple_of, 1)
    pad = t - t_real
    input_ids = np.concatenate([tokens, np.full(pad, pad_token_id, np.int64)])
    position_ids = np.concatenate([depth, np.zeros(pad, np.int64)])
    subtree_end = np.concatenate([end, np.arange(t_real + 1, t + 1, dtype=np.int64)])
    multiplicity = np.bincount(paths, minlength=t)  # sequences through each slot; 0 on padding
    cu = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(lens - 1, out=cu[1:])
    return TreeMicroBatch(
        input_ids=torch.from_numpy(input_ids)[None],
        position_ids=torch.from_numpy(position_ids)[None],
        attention_mask=torch.from_numpy(subtree_end.astype(np.int32))[None],
        cu_targets=torch.from_numpy(cu.astype(np.int32)),
        logprob_slots=torch.from_numpy(slots),
        logprob_labels=torch.from_numpy(labels),
        multiplicity=torch.from_numpy(multiplicity)[None],
        last_slots=torch.from_numpy(last_slots),
        sequence_ids=list(ids),
        seq_lens=lens.tolist(),
        num_tokens=t_real,
    )

"""pack_trees(chunk_trees=True): trees larger than a micro-batch in chunks that read their ancestors' context."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forests import any_batch
from megatron_tree import MicroBatchSpec, build_forest, pack_trees
from megatron_tree.core.chunks import recompute_plan
from megatron_tree.core.masks import dense_tree_mask
from megatron_tree.core.metrics import PackingStats
from megatron_tree.core.tree import as_sequences


def steps(mbs):
    """Schedule steps: a micro-batch of whole trees, or all the chunks of one tree."""
    return sum(mb.chunk is None or mb.chunk.index == 0 for mb in mbs)


def check_chunked(seqs, mbs, spec):
    seqs = as_sequences(seqs)
    cap = spec.max_tokens_per_mb
    assert steps(mbs) >= spec.n_mbs and steps(mbs) % spec.n_mbs_divisor == 0
    parts = {i: [] for i in range(len(seqs))}
    groups = {}
    for mb in mbs:
        assert mb.num_tokens <= cap
        cu = mb.cu_targets.tolist()
        assert cu[-1] == mb.logprob_slots.numel() == sum(mb.target_counts)
        starts = mb.target_starts or [0] * len(mb.sequence_ids)
        ends = mb.sequence_ends or [True] * len(mb.sequence_ids)
        ids, pos = mb.input_ids[0], mb.position_ids[0]
        for k, sid in enumerate(mb.sequence_ids):
            s = torch.as_tensor(seqs[sid])
            slots = mb.logprob_slots[cu[k] : cu[k + 1]]
            n = cu[k + 1] - cu[k]
            assert torch.equal(ids[slots], s[starts[k] : starts[k] + n])
            assert torch.equal(pos[slots], torch.arange(starts[k], starts[k] + n))  # RoPE position = global depth
            assert torch.equal(mb.logprob_labels[cu[k] : cu[k + 1]], s[starts[k] + 1 : starts[k] + n + 1])
            parts[sid].append((starts[k], n, ends[k], mb.seq_lens[k]))
        if mb.chunk is not None:
            groups.setdefault(mb.chunk.group, []).append(mb)
    for sid, ps in parts.items():  # every target once, in order; the last part ends the sequence
        ps.sort()
        assert [p[0] for p in ps] == list(np.cumsum([0] + [p[1] for p in ps[:-1]]))
        assert sum(p[1] for p in ps) == len(seqs[sid]) - 1 and ps[-1][2] and not any(p[2] for p in ps[:-1])
        assert sum(p[3] for p in ps) == len(seqs[sid])
    for chunks in groups.values():
        check_group(chunks)


def check_group(chunks):
    """A chunked tree's bookkeeping: indices in order, each context a prefix of earlier chunks' exports,
    ``last_reader`` the last chunk that reads any of it (its backward must come after that one's), and the recurrent
    states carried across chunks."""
    assert [c.chunk.index for c in chunks] == list(range(chunks[0].chunk.size))
    readers = {i: [] for i in range(len(chunks))}
    for i, c in enumerate(chunks):
        assert c.context_mask.shape[1] == c.chunk.context_len + c.num_slots
        for src, k in c.chunk.sources:
            assert src < i and 0 < k <= chunks[src].export_slots.numel()
            readers[src].append(i)
    for i, c in enumerate(chunks):
        assert c.chunk.last_reader == max(readers[i] + [i])
    check_recurrent(chunks)


def check_recurrent(chunks):
    """``carried``: per chunk, the distinct context slots its own slots hang from (root first), each as (source chunk,
    row of the source's ``state_exports``); every state export is an exported slot some later chunk carries."""
    carried = set()
    for c in chunks:
        info, end = c.chunk, c.context_mask[0].numpy()
        own = np.arange(info.context_len, end.shape[0])
        parent = [max((j for j in range(i) if end[j] > i), default=-1) for i in own]
        hung = sorted({p for p in parent if 0 <= p < info.context_len})  # context indices
        where = [(src, e) for src, k in info.sources for e in range(k)]  # context index -> (source, export position)
        want = [(where[p][0], int(chunks[where[p][0]].export_slots[where[p][1]])) for p in hung]
        assert [(src, chunks[src].chunk.state_exports[row]) for src, row in info.carried] == want
        carried |= set(want)
    exported = {(i, s) for i, c in enumerate(chunks) for s in c.chunk.state_exports}
    assert exported == carried
    assert all(set(c.chunk.state_exports) <= set(c.export_slots.tolist()) for c in chunks if c.chunk.state_exports)


@settings(max_examples=80, deadline=None)
@given(any_batch, st.integers(2, 9), st.integers(1, 4), st.integers(1, 3))
def test_chunks_cover_every_sequence_and_compute_each_token_once(seqs, cap, n_mbs, divisor):
    spec = MicroBatchSpec(max_tokens_per_mb=cap, n_mbs=n_mbs, n_mbs_divisor=divisor, chunk_trees=True)
    mbs = pack_trees(seqs, spec)
    check_chunked(seqs, mbs, spec)
    stats = PackingStats.of(mbs, cap)
    assert stats.tree_tokens == build_forest(as_sequences(seqs)).num_tokens  # nothing recomputed
    assert stats.original_tokens == sum(map(len, seqs))
    assert stats.num_sequences == len(seqs)  # a sequence through several chunks counts once


@settings(max_examples=60, deadline=None)
@given(any_batch, st.integers(2, 9))
def test_context_masks_give_each_query_its_ancestors(seqs, cap):
    """Per chunk, ``[context | own slots]`` visibility equals the whole forest's on those slots."""
    forest = build_forest(as_sequences(seqs))
    whole = dense_tree_mask(torch.from_numpy(forest.subtree_end))
    mbs = [mb for mb in pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=cap, chunk_trees=True)) if mb.chunk]
    if not mbs:
        return
    # The chunked trees are whole root trees of the forest, in DFS order: map each to its forest slots.
    roots = np.flatnonzero(forest.node_parent == -1)
    sizes = {}
    for r in roots.tolist():
        a = int(forest.node_start[r])
        sizes[a] = int(forest.subtree_end[a]) - a
    by_group = {}
    for mb in mbs:
        by_group.setdefault(mb.chunk.group, []).append(mb)
    for chunks in by_group.values():
        total = sum(c.num_tokens for c in chunks)
        tokens = torch.cat([c.input_ids[0, : c.num_tokens] for c in chunks])
        base = next(a for a, n in sizes.items() if n == total and torch.equal(
            torch.from_numpy(forest.tokens[a : a + n]), tokens))
        starts = base + np.cumsum([0] + [c.num_tokens for c in chunks])
        exported = [[] if c.export_slots is None else (starts[i] + c.export_slots.numpy()).tolist()
                    for i, c in enumerate(chunks)]
        for i, c in enumerate(chunks):
            ctx = [s for src, k in c.chunk.sources for s in exported[src][:k]]
            glob = torch.as_tensor(ctx + list(range(starts[i], starts[i + 1])), dtype=torch.long)
            got = dense_tree_mask(c.context_mask[0, : glob.numel()], torch.arange(len(ctx), glob.numel()))
            assert torch.equal(got, whole[glob[len(ctx) :]][:, glob])
            # nothing outside the context is an ancestor of the chunk's slots
            before = torch.arange(starts[0], starts[i])
            outside = before[~torch.isin(before, glob)]
            assert not bool(whole[glob[len(ctx) :]][:, outside].any())
            assert torch.equal(c.position_ids[0, : c.num_tokens], torch.from_numpy(forest.depth[starts[i] : starts[i + 1]]))


def test_recurrent_states_of_the_docstring_example():
    """``a b c | d e f`` (``megatron_tree.core.chunks``): chunk 0 keeps its states at b and c, chunk 1 carries both."""
    seqs = [np.array([1, 2, 3, 4]), np.array([1, 2, 5, 6])]
    first, second = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=3, chunk_trees=True))
    assert first.chunk.state_exports == (1, 2) and first.chunk.carried == ()
    assert second.chunk.state_exports == () and second.chunk.carried == ((0, 0), (0, 1))


def test_a_sequence_longer_than_a_micro_batch_is_refused_without_chunks():
    with pytest.raises(ValueError, match="more than max_tokens_per_mb=4.*MicroBatchSpec\\(chunk_trees=True\\)"):
        pack_trees([list(range(9))], MicroBatchSpec(max_tokens_per_mb=4))
    mbs = pack_trees([list(range(9))], MicroBatchSpec(max_tokens_per_mb=4, chunk_trees=True))
    assert [mb.num_tokens for mb in mbs] == [4, 4, 1] and [mb.chunk.context_len for mb in mbs] == [0, 4, 8]


def test_trees_that_fit_are_packed_as_before():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [7, 8, 9]]
    spec = MicroBatchSpec(max_tokens_per_mb=8)
    before, after = pack_trees(seqs, spec), pack_trees(seqs, MicroBatchSpec.new(spec, chunk_trees=True))
    assert [mb.sequence_ids for mb in before] == [mb.sequence_ids for mb in after]
    assert all(torch.equal(a.attention_mask, b.attention_mask) and b.chunk is None for a, b in zip(before, after))


@settings(max_examples=40, deadline=None)
@given(any_batch, st.integers(2, 9), st.integers(2, 4), st.booleans())
def test_granules_and_chains_larger_than_a_micro_batch_run_in_chunks(seqs, cap, granularity, share):
    """Granules kept together beyond the capacity, and the flat layout (each sequence a chain), become chunks."""
    spec = MicroBatchSpec(max_tokens_per_mb=cap, granularity=granularity, chunk_trees=True)
    mbs = pack_trees(seqs, spec, share_prefixes=share)
    check_chunked(seqs, mbs, spec)
    for mb in mbs:  # a granule's sequences share one micro-batch or one chunked tree
        step = (mb.chunk.group, -1) if mb.chunk else (-1, id(mb))
        for sid in mb.sequence_ids:
            assert step == next((m.chunk.group, -1) if m.chunk else (-1, id(m)) for m in mbs
                                if any(s // granularity == sid // granularity for s in m.sequence_ids))


def test_recompute_plan_recomputes_the_chunks_released_last_until_the_rest_fit():
    """Chunk 0 is read by every later chunk, chunks 1 and 2 by chunk 3: during chunk 3's forward chunks 0-2 wait
    (5 + 10 + 16 slots). With 20 kept slots, chunk 0 (released last) and then chunk 2 (the larger of the two
    released next) run again; chunk 3, read by nobody, never waits."""
    slots, last_reader = np.array([5, 10, 16, 4]), np.array([3, 3, 3, 3])
    assert recompute_plan(slots, last_reader, 20).tolist() == [True, False, True, False]
    assert recompute_plan(slots, last_reader, 31).tolist() == [False] * 4
    assert recompute_plan(slots, last_reader, 0).tolist() == [True, True, True, False]
    # expert parallel's order: every chunk waits until the last forward, then chunk 3's backward runs first, chunk 0's
    # last: chunks 0 and 1 run again (5 + 10 recomputed slots leave 16 kept)
    assert recompute_plan(slots, last_reader, 20, uniform=True).tolist() == [True, True, False, False]
    assert recompute_plan(slots, last_reader, 0, uniform=True).tolist() == [True, True, True, False]


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_bad_max_kept_tokens_is_refused(value):
    with pytest.raises(ValueError, match="max_kept_tokens must be None or an int >= 0"):
        MicroBatchSpec(max_tokens_per_mb=8, chunk_trees=True, max_kept_tokens=value)


def test_max_kept_tokens_without_chunk_trees_is_refused():
    with pytest.raises(ValueError, match="max_kept_tokens=8 bounds what the chunks .* but chunk_trees is False; set "
                                         "chunk_trees=True or drop max_kept_tokens"):
        MicroBatchSpec(max_tokens_per_mb=8, max_kept_tokens=8)

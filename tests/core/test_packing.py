"""pack_trees: recovery of every sequence, capacity, counts, coverage, balance, errors."""

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from forests import any_batch
from megatron_tree import MicroBatchSpec, build_forest, pack_trees
from megatron_tree.core.masks import dense_tree_mask
from megatron_tree.core.metrics import PackingStats
from megatron_tree.core.packing import _first_fit_decreasing, assign_bins, plan_items
from megatron_tree.core.tree import as_sequences


def check_micro_batches(seqs, mbs, spec):
    """Every invariant a consumer relies on; returns nothing, asserts everything."""
    seen = [sid for mb in mbs for sid in mb.sequence_ids]
    assert sorted(seen) == list(range(len(seqs))), "each sequence exactly once"
    assert len(mbs) >= spec.n_mbs and len(mbs) % spec.n_mbs_divisor == 0
    for mb in mbs:
        assert mb.num_tokens <= spec.max_tokens_per_mb
        assert mb.input_ids.shape == mb.position_ids.shape == mb.attention_mask.shape
        assert mb.attention_mask.dtype == torch.int32
        mask = dense_tree_mask(mb.attention_mask)
        ids, pos = mb.input_ids[0], mb.position_ids[0]
        cu = mb.cu_targets.tolist()
        assert cu[-1] == mb.logprob_slots.numel() == mb.logprob_labels.numel()
        assert mb.multiplicity.shape == mb.input_ids.shape and mb.last_slots.shape == (len(mb.sequence_ids),)
        # sequence k is the root path to its last slot: slots j with j <= last < subtree_end[j]
        slot = torch.arange(mb.num_slots)
        on_path = (slot <= mb.last_slots[:, None]) & (mb.last_slots[:, None] < mb.attention_mask)  # [n, T]
        assert torch.equal(mb.multiplicity[0], on_path.sum(0))
        for k, sid in enumerate(mb.sequence_ids):
            s = torch.as_tensor(seqs[sid])
            assert mb.seq_lens[k] == len(s)
            assert torch.equal(ids[on_path[k]], s) and torch.equal(pos[on_path[k]], torch.arange(len(s)))
            slots = mb.logprob_slots[cu[k] : cu[k + 1]]
            assert torch.equal(mb.logprob_labels[cu[k] : cu[k + 1]], s[1:])
            assert torch.equal(ids[slots], s[:-1])
            assert torch.equal(pos[slots], torch.arange(len(s) - 1))
            # each step is a child of the one before (visible, one deeper)
            assert bool(mask[slots[1:], slots[:-1]].all())
            # and the last token exists as a child of the last predicting slot
            cand = (ids == s[-1]) & (pos == len(s) - 1)
            if len(s) > 1:
                cand &= mask[:, slots[-1]]
            cand[mb.num_tokens :] = False
            assert bool(cand.any()), f"last token of sequence {sid} missing"
        # padding slots see only themselves
        for j in range(mb.num_tokens, mb.num_slots):
            assert mask[j].nonzero().flatten().tolist() == [j]


specs = st.builds(
    MicroBatchSpec,
    max_tokens_per_mb=st.integers(12, 60),
    n_mbs=st.integers(1, 5),
    n_mbs_divisor=st.integers(1, 3),
    granularity=st.sampled_from([1, 1, 2, 3]),
    packing_algorithm=st.sampled_from(["ffd", "kk"]),
)


@settings(max_examples=150, deadline=None)
@given(any_batch, specs, st.integers(1, 4))
def test_pack_trees_invariants(seqs, spec, pad_multiple):
    assume(max(map(len, seqs)) <= spec.max_tokens_per_mb)
    try:
        mbs = pack_trees(seqs, spec, pad_to_multiple_of=pad_multiple)
    except ValueError as e:  # only granularity may make a batch infeasible
        assert "granularity" in str(e)
        return
    check_micro_batches(seqs, mbs, spec)
    for mb in mbs:
        assert mb.num_slots % pad_multiple == 0


@settings(max_examples=60, deadline=None)
@given(any_batch, specs)
def test_flat_packing_invariants(seqs, spec):
    assume(max(map(len, seqs)) <= spec.max_tokens_per_mb)
    spec = MicroBatchSpec.new(spec, granularity=1)
    mbs = pack_trees(seqs, spec, share_prefixes=False)
    check_micro_batches(seqs, mbs, spec)
    for mb in mbs:
        assert mb.num_tokens == mb.num_original_tokens  # nothing shared


@settings(max_examples=150, deadline=None)
@given(any_batch, st.integers(12, 60), st.integers(1, 6))
def test_kk_spread_within_margin_of_ffd(seqs, cap, n_mbs):
    """Documented margin: KK's spread never exceeds FFD's by more than the largest item."""
    assume(max(map(len, seqs)) <= cap)
    items, costs = plan_items(build_forest(as_sequences(seqs)), cap)
    k = max(n_mbs, len(_first_fit_decreasing(costs, cap)))

    def spread(bins):
        loads = [sum(costs[i] for i in b) for b in bins]
        assert max(loads) <= cap
        return max(loads) - min(loads)

    assert spread(assign_bins(costs, k, cap, "kk")) <= spread(assign_bins(costs, k, cap, "ffd")) + max(costs)


def test_groups_that_fit_stay_whole():
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(6):
        prompt = rng.integers(0, 1000, 30).tolist()
        seqs += [prompt + rng.integers(0, 1000, rng.integers(1, 20)).tolist() for _ in range(8)]
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=400, n_mbs=2))
    for mb in mbs:
        groups = {sid // 8 for sid in mb.sequence_ids}
        for g in groups:
            assert set(range(8 * g, 8 * g + 8)) <= set(mb.sequence_ids)
    stats = PackingStats.of(mbs, 400)
    assert stats.tree_tokens == build_forest(as_sequences(seqs)).num_tokens


def test_big_tree_is_split_and_siblings_keep_sharing_where_they_fit():
    prompt = list(range(100))
    seqs = [prompt + [200 + i] * 30 for i in range(6)]  # 100 + 6*30 = 280 unique tokens
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=170))
    assert [len(mb.sequence_ids) for mb in mbs] == [2, 2, 2]
    assert all(mb.num_tokens == 160 for mb in mbs)


def test_split_tree_parts_are_balanced():
    """8 branches of 10 under a 10-token prompt, capacity 60: first-fit would give parts of 60
    and 40 tokens; the split keeps its 2 parts and balances them at 50 each."""
    seqs = [list(range(10)) + [100 + i] * 10 for i in range(8)]
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=60))
    assert sorted(mb.num_tokens for mb in mbs) == [50, 50]


def test_empty_micro_batches_pad_the_count():
    mbs = pack_trees([[1, 2, 3]], MicroBatchSpec(max_tokens_per_mb=8, n_mbs=3, n_mbs_divisor=2))
    assert len(mbs) == 4
    assert sorted(len(mb.sequence_ids) for mb in mbs) == [0, 0, 0, 1]
    empty = next(mb for mb in mbs if not mb.sequence_ids)
    assert empty.num_tokens == 0 and empty.num_slots == 1 and empty.cu_targets.tolist() == [0]


def test_empty_batch_gives_padding_micro_batches():
    mbs = pack_trees([], MicroBatchSpec(max_tokens_per_mb=8, n_mbs=2))
    assert [mb.sequence_ids for mb in mbs] == [[], []]


def test_padded_form_gives_the_same_micro_batches():
    seqs = [[5, 6, 7, 8], [5, 6, 9], [1]]
    ids = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, 5 - len(s) :] = torch.tensor(s)
        mask[b, 5 - len(s) :] = 1
    a = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=8))
    b = pack_trees(ids, MicroBatchSpec(max_tokens_per_mb=8), attention_mask=mask)
    assert [m.sequence_ids for m in a] == [m.sequence_ids for m in b]
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.attention_mask, y.attention_mask)


def test_bad_input_errors():
    spec = MicroBatchSpec(max_tokens_per_mb=4)
    with pytest.raises(ValueError, match=r"sequence 1 has 5 tokens, more than max_tokens_per_mb=4"):
        pack_trees([[1], [1, 2, 3, 4, 5]], spec)
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        pack_trees([[]], spec)
    with pytest.raises(ValueError, match=r"packing_algorithm must be one of \('ffd', 'kk'\)"):
        MicroBatchSpec(max_tokens_per_mb=4, packing_algorithm="greedy")
    for field in ("max_tokens_per_mb", "n_mbs", "n_mbs_divisor", "granularity"):
        kwargs = {"max_tokens_per_mb": 4, field: 0}
        with pytest.raises(ValueError, match=f"{field} must be a positive int"):
            MicroBatchSpec(**kwargs)
    with pytest.raises(ValueError, match="unknown MicroBatchSpec field"):
        MicroBatchSpec.new(spec, n_mb=2)
    assert MicroBatchSpec.new(spec, n_mbs=3).n_mbs == 3
    with pytest.raises(ValueError, match="granularity=2 keeps sequences"):
        pack_trees([[1, 2, 3], [4, 5, 6]], MicroBatchSpec(max_tokens_per_mb=4, granularity=2))
    with pytest.raises(TypeError, match="MicroBatchSpec"):
        pack_trees([[1]], {"max_tokens_per_mb": 4})

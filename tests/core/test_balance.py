"""balance_across_ranks: coverage, determinism, whole groups, balance vs round robin."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forests import any_batch
import torch

from megatron_tree import MicroBatchSpec, balance_across_ranks, build_forest, pack_trees
from megatron_tree.core.balance import rank_costs
from megatron_tree.core.metrics import BalanceStats
from megatron_tree.core.synthetic import grpo_batch
from megatron_tree.core.packing import assign_bins
from megatron_tree.core.tree import as_sequences


def _group(prompt_start, prompt_len, n, response_len):
    """n samples of one prompt: ``prompt_len`` shared tokens, then distinct responses."""
    prompt = list(range(prompt_start, prompt_start + prompt_len))
    return [prompt + [prompt_start + 1000 * (k + 1) + j for j in range(response_len)] for k in range(n)]


@settings(max_examples=100, deadline=None)
@given(any_batch, st.integers(1, 5), st.sampled_from(["kk", "ffd", "round_robin"]))
def test_every_sequence_once_and_deterministic(seqs, world, algo):
    a = balance_across_ranks(seqs, world, algorithm=algo)
    b = balance_across_ranks(seqs, world, algorithm=algo)
    assert len(a) == world
    assert sorted(np.concatenate(a).tolist()) == list(range(len(seqs)))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@settings(max_examples=100, deadline=None)
@given(any_batch, st.integers(1, 5), st.sampled_from(["kk", "ffd"]))
def test_groups_that_fit_a_fair_share_stay_on_one_rank(seqs, world, algo):
    forest = build_forest(as_sequences(seqs))
    fair = -(-forest.num_tokens // world)
    rank_of = {}
    for r, idx in enumerate(balance_across_ranks(seqs, world, algorithm=algo)):
        rank_of.update({int(i): r for i in idx})
    roots = {}
    for i, s in enumerate(seqs):
        roots.setdefault(s[0], []).append(i)
    for members in roots.values():
        if build_forest(as_sequences([seqs[i] for i in members])).num_tokens <= max(fair, max(map(len, seqs))):
            assert len({rank_of[i] for i in members}) == 1


def test_kk_balances_tree_cost_and_keeps_sharing():
    rng = np.random.default_rng(1)
    seqs = grpo_batch(rng, n_prompts=32, samples=(4, 16), prompt_len=(50, 800), response_len=(10, 300), vocab=5000)
    orig = sum(map(len, seqs))
    ideal = build_forest(as_sequences(seqs)).num_tokens
    imb, kept = {}, {}
    for algo in ("kk", "ffd", "round_robin"):
        assignment = balance_across_ranks(seqs, 8, algorithm=algo)
        imb[algo] = BalanceStats.of(rank_costs(seqs, assignment)).imbalance
        tokens = sum(build_forest(as_sequences([seqs[i] for i in idx])).num_tokens for idx in assignment)
        kept[algo] = (orig - tokens) / (orig - ideal)
    assert imb["kk"] <= imb["ffd"] + 1e-9
    assert imb["kk"] < 1.05
    assert kept["kk"] >= 0.95 and kept["ffd"] >= 0.95
    assert kept["round_robin"] < 0.9


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        balance_across_ranks([[1]], 0)
    with pytest.raises(ValueError, match=r"algorithm must be one of \('kk', 'ffd', 'round_robin'\)"):
        balance_across_ranks([[1]], 2, algorithm="lpt")


@pytest.mark.parametrize("algo", ["kk", "ffd"])
def test_groups_stay_whole_when_splitting_does_not_lower_the_busiest_rank(algo):
    # 60 and 40 tree tokens over 2 ranks: the 60-group exceeds the fair share of 50, but splitting
    # it duplicates its prompt (50 + 50, one piece beside the 40-group: 90 / 50).
    seqs = _group(10_000, 40, 2, 10) + _group(20_000, 20, 2, 10)
    assignment = balance_across_ranks(seqs, 2, algorithm=algo)
    assert sorted(map(sorted, (a.tolist() for a in assignment))) == [[0, 1], [2, 3]]
    assert sorted(rank_costs(seqs, assignment, attention_weight=0)) == [40.0, 60.0]


@pytest.mark.parametrize("algo", ["kk", "ffd"])
def test_a_group_is_split_when_that_lowers_the_busiest_rank(algo):
    # One group of 10 + 4 x 40 = 170 tokens over 2 ranks: whole it is 170 / 0, split 90 / 90.
    seqs = _group(10_000, 10, 4, 40)
    assert sorted(rank_costs(seqs, balance_across_ranks(seqs, 2, algorithm=algo), attention_weight=0)) == [90, 90]
    # Two groups of 100 over 4 ranks: splitting one alone leaves 100 on a rank, splitting both gives 60s.
    seqs = _group(10_000, 20, 2, 40) + _group(20_000, 20, 2, 40)
    assert max(rank_costs(seqs, balance_across_ranks(seqs, 4, algorithm=algo), attention_weight=0)) == 60


@settings(max_examples=100, deadline=None)
@given(any_batch, st.integers(1, 5), st.sampled_from(["kk", "ffd"]))
def test_busiest_rank_never_costs_more_than_with_whole_groups(seqs, world, algo):
    roots = {}
    for i, s in enumerate(seqs):
        roots.setdefault(s[0], []).append(i)
    groups = [np.array(roots[r]) for r in sorted(roots)]  # root trees in DFS order
    costs = rank_costs(seqs, groups)
    whole = assign_bins(costs, world, float("inf"), algo)
    whole = [np.concatenate([groups[i] for i in b]) if b else np.zeros(0, np.int64) for b in whole]
    assert max(rank_costs(seqs, balance_across_ranks(seqs, world, algorithm=algo))) <= max(rank_costs(seqs, whole))


@pytest.mark.parametrize("algo", ["kk", "ffd", "round_robin"])
def test_empty_batch_gives_empty_ranks_as_pack_trees_gives_empty_micro_batches(algo):
    assert [mb.sequence_ids for mb in pack_trees([], MicroBatchSpec(max_tokens_per_mb=8))] == [[]]
    ids, mask = torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5, dtype=torch.long)
    assert pack_trees(ids, MicroBatchSpec(max_tokens_per_mb=8), attention_mask=mask)[0].sequence_ids == []
    for out in (balance_across_ranks([], 3, algorithm=algo), balance_across_ranks(ids, 3, attention_mask=mask)):
        assert len(out) == 3 and all(a.dtype == np.int64 and a.shape == (0,) for a in out)

"""Context-parallel layout, shards and attention pieces (single process; the CP=2 training steps over
gloo are in tests/mcore/test_schedule.py)."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from forests import any_batch
from megatron_tree.core.context_parallel import CP_CHUNKS, context_parallel_layout, shard_micro_batch
from megatron_tree.attention.flex import classify_blocks, flex_tree_attention, flex_tree_mask, tree_block_mask
from megatron_tree.core.masks import dense_tree_mask
from megatron_tree.core.packing import build_micro_batch
from forests import pad_end, random_subtree_end

requires_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="inductor on CPU needs a C++ compiler"
)
requires_cuda = pytest.mark.gpu


def padded_mb(seqs, cp):
    mb = build_micro_batch([np.array(s) for s in seqs], list(range(len(seqs))))
    return mb.padded_to(-(-mb.num_slots // (cp * CP_CHUNKS)) * cp * CP_CHUNKS)


@settings(max_examples=60, deadline=None)
@given(seqs=any_batch, cp=st.integers(2, 4))
def test_shards_partition_the_micro_batch(seqs, cp):
    mb = padded_mb(seqs, cp)
    t, s = mb.num_slots, mb.num_slots // cp
    shards = [shard_micro_batch(mb, cp, r) for r in range(cp)]
    order = shards[0].attention_mask[0, :t].long()
    assert torch.equal(order.sort().values, torch.arange(t))  # every slot on exactly one rank
    assert torch.equal(shards[1].attention_mask, shards[0].attention_mask)
    assert torch.equal(shards[0].attention_mask[0, t:], mb.attention_mask[0])
    targets, lasts = [], []
    for r, sh in enumerate(shards):
        mine = order[r * s : (r + 1) * s]
        assert sh.num_slots == s and bool((mine[1:] > mine[:-1]).all())  # DFS order kept within a rank
        assert torch.equal(sh.input_ids[0], mb.input_ids[0, mine])
        assert torch.equal(sh.position_ids[0], mb.position_ids[0, mine])
        assert torch.equal(sh.multiplicity[0], mb.multiplicity[0, mine])
        # each target read on the rank holding its predicting slot, with the same label
        assert torch.equal(mine[sh.target_slots], mb.logprob_slots[sh.target_index])
        assert torch.equal(sh.target_labels, mb.logprob_labels[sh.target_index])
        assert torch.equal(mine[sh.last_slots], mb.last_slots[sh.last_index])
        targets.append(sh.target_index)
        lasts.append(sh.last_index)
    assert torch.equal(torch.cat(targets).sort().values, torch.arange(mb.logprob_slots.numel()))
    assert torch.equal(torch.cat(lasts).sort().values, torch.arange(len(mb.sequence_ids)))
    depth = mb.position_ids[0].clone()
    work = depth + 1
    work[mb.num_tokens :] = 1
    assert sum(shards[0].pairs) == int(work.sum())
    assert sum(shards[0].tokens) == mb.num_tokens


def test_layout_balances_attention_pairs_not_slots():
    """A GRPO-like tree (a long prompt, then 8 long responses): contiguous halves hold very
    different attention work; the layout's ranks are within 2%."""
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(0, 50, 300))
    seqs = [prompt + list(rng.integers(0, 50, 200)) for _ in range(8)]
    mb = padded_mb(seqs, 4)
    work = mb.position_ids[0] + 1
    half = mb.num_slots // 2
    contiguous = [int(work[:half].sum()), int(work[half:].sum())]
    assert max(contiguous) / (sum(contiguous) / 2) > 1.1
    _, pairs = context_parallel_layout(mb.position_ids, mb.num_tokens, 2)
    assert max(pairs) / (sum(pairs) / 2) < 1.02
    _, pairs4 = context_parallel_layout(mb.position_ids, mb.num_tokens, 4)
    assert max(pairs4) / (sum(pairs4) / 4) < 1.05


def test_shard_refuses_bad_input():
    mb = build_micro_batch([np.array([1, 2, 3])], [0])
    with pytest.raises(ValueError, match="multiple of cp \\* 8 = 16"):
        shard_micro_batch(mb, 2, 0)
    with pytest.raises(ValueError, match="0 <= rank < cp"):
        shard_micro_batch(mb.padded_to(16), 2, 2)


def query_slot_sets(end: torch.Tensor, rng: random.Random, cp: int) -> list[torch.Tensor]:
    """Each rank's query slots for a random layout of ``end`` (T a multiple of cp * CP_CHUNKS)."""
    depth = torch.zeros(end.shape[0], dtype=torch.long)  # any work vector gives a valid layout
    depth[: rng.randint(0, end.shape[0])] = torch.randint(0, 50, (1,))
    order, _ = context_parallel_layout(depth[torch.randperm(end.shape[0])], end.shape[0], cp)
    return list(order.view(cp, -1))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("block_size", [4, 8, (8, 4)])
def test_classify_blocks_with_query_slots_is_sound(seed, block_size):
    """Blocks of a rank's queries: every block flagged full is all visible, every block flagged
    neither is all masked (partial blocks are masked element-wise by the mask_mod)."""
    rng = random.Random(seed)
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    cp = rng.choice([2, 3])
    t = rng.randint(1, 12) * cp * CP_CHUNKS * 2
    end = pad_end(random_subtree_end(rng, t - rng.randint(0, 10), p_extend=rng.choice([0.5, 0.9])), t)
    for slots in query_slot_sets(end, rng, cp):
        rows = -(-slots.numel() // bq) * bq
        padded = torch.cat([slots, slots.new_full((rows - slots.numel(),), -1)])
        partial, full = classify_blocks(end, block_size, padded)
        dense = torch.zeros(rows, t, dtype=torch.bool)
        dense[: slots.numel()] = dense_tree_mask(end, slots)
        tiles = dense.view(rows // bq, bq, t // bk, bk).permute(0, 2, 1, 3)
        assert bool(tiles.all(dim=(2, 3))[full].all())
        assert not bool(tiles.any(dim=(2, 3))[~(partial | full)].any())


def rect_block_mask_to_dense(block_mask) -> torch.Tensor:
    """Element mask bool [Tqp, Tp] a (rectangular) BlockMask encodes: full blocks, plus mask_mod in partial ones."""
    bq, bk = block_mask.BLOCK_SIZE
    q_len, k_len = block_mask.seq_lengths
    blocks = []
    for num, idx in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                     (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):  # fmt: skip
        out = torch.zeros(q_len // bq, k_len // bk, dtype=torch.bool)
        for qb in range(q_len // bq):
            out[qb, idx[0, 0, qb, : num[0, 0, qb]].long()] = True
        blocks.append(out.repeat_interleave(bq, 0).repeat_interleave(bk, 1))
    partial, full = blocks
    mod = block_mask.mask_mod(0, 0, torch.arange(q_len)[:, None], torch.arange(k_len)[None, :])
    return full | (partial & mod)


@pytest.mark.parametrize("seed", range(4))
def test_block_mask_with_query_slots_encodes_the_dense_rows(seed):
    rng = random.Random(50 + seed)
    end = pad_end(random_subtree_end(rng, 190), 192)
    for slots in query_slot_sets(end, rng, 2):
        block_mask = tree_block_mask(end, 16, query_slots=slots)
        assert block_mask.seq_lengths == (96, 192)
        got = rect_block_mask_to_dense(block_mask)
        assert torch.equal(got[:, :192], dense_tree_mask(end, slots))


def _cp_dense_reference(q, k, v, end, slots, scale):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_tree_mask(end, slots), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


@requires_cxx
def test_flex_forward_with_query_slots_matches_dense_cpu():
    rng = random.Random(7)
    t = 256
    end = pad_end(random_subtree_end(rng, 240), t)
    k, v = torch.randn(1, 2, t, 32), torch.randn(1, 2, t, 32)
    for slots in query_slot_sets(end, rng, 2):
        q = torch.randn(1, 4, slots.numel(), 32)
        out = flex_tree_attention(q, k, v, flex_tree_mask(end, query_slots=slots), softmax_scale=0.3)
        ref = _cp_dense_reference(q.double(), k.double(), v.double(), end, slots, 0.3)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@requires_cuda
def test_flex_with_query_slots_matches_dense_cuda_fp32():
    rng = random.Random(8)
    t = 1024
    end = pad_end(random_subtree_end(rng, 1000), t).cuda()
    for slots in query_slot_sets(end.cpu(), rng, 2):
        slots = slots.cuda()
        q = torch.randn(1, 8, slots.numel(), 64, device="cuda", requires_grad=True)
        k = torch.randn(1, 2, t, 64, device="cuda", requires_grad=True)
        v = torch.randn(1, 2, t, 64, device="cuda", requires_grad=True)
        g = torch.randn(1, 8, slots.numel(), 64, device="cuda")
        grads = []
        for fn in (
            lambda: flex_tree_attention(q, k, v, flex_tree_mask(end, query_slots=slots)),
            lambda: _cp_dense_reference(q.double(), k.double(), v.double(), end, slots, None),
        ):
            out = fn()
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
            grads.append((out, dq, dk, dv))
        for x, r in zip(*grads):
            assert ((x.double() - r.double()).norm() / r.double().norm()).item() < 1e-5

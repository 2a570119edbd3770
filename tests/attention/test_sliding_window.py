"""Sliding-window tree attention: key j visible to query i iff j is an ancestor-or-self of i and
depth(i) - depth(j) < window (Hugging Face's ``sliding_window``; megatron-core's ``window_size=(window - 1, 0)``).

CPU: the window starts and the dense mask against the definition (depths counted from the dense tree
mask), FlexAttention's block tables and block mask against the dense windowed mask (blocks before every
query's window skipped; exact band on a chain), FlexAttention's CPU forward, the core attention against
sliding-window causal attention on each root-to-leaf path (values and gradients, fp64), the routing
(``auto`` / dense run windowed calls, FA4 refuses them, flex refuses them until a GPU proves them) and
the per-window mask cache. ``gpu``: flex's windowed forward and backward against the dense fp64
reference (what would prove it), and ``auto`` on windowed bf16 calls.
"""

from __future__ import annotations

import math
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from forests import dfs_layout, random_subtree_end

from megatron_tree.attention import (
    PREPARED_MASKS,
    AttentionShape,
    TreeAttentionBackend,
    get_tree_attention_backend,
    register_tree_attention_backend,
    tree_attention,
)
from megatron_tree.attention import dispatch
from megatron_tree.attention import fa4 as fa4_attention
from megatron_tree.attention.conformance import accept, forward_backward, relative_errors
from megatron_tree.attention import flex as flex_attention
from megatron_tree.attention.flex import classify_blocks, flex_tree_attention, flex_tree_mask, row_window_starts
from megatron_tree.core.masks import dense_tree_mask, tree_depths, window_starts
from megatron_tree.mcore.core_attention import TreeCoreAttention, layer_window

requires_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="inductor on CPU needs a C++ compiler"
)

# Branches longer than the windows used below, laid out after shorter siblings.
FOREST = [[1, 2, 3, 4], [1, 2, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 13], [14, 15], [1, 16, 17, 18, 19, 20, 21],
          [14, 15, 22, 23, 24, 25, 26, 27]]




def windowed_by_definition(end: torch.Tensor, window: int, query_slots: torch.Tensor | None = None) -> torch.Tensor:
    """bool [Tq, T]: the tree mask and ``depth(i) - depth(j) < window``, depths counted as ancestors in the tree mask."""
    tree = dense_tree_mask(end)
    depth = tree.sum(dim=1) - 1  # ancestors-or-self of each slot, minus itself
    q = torch.arange(end.shape[0]) if query_slots is None else query_slots.long()
    return tree[q] & ((depth[q][:, None] - depth[None, :]) < window)


def tree_of(seqs: list[list[int]]):
    """(subtree_end int32 [T], depth int64 [T], each sequence's slots) of the trie of ``seqs`` in DFS pre-order; the
    depths read off the sequences' slot paths (slot k of a path is at depth k), not from ``subtree_end``."""
    end, paths = dfs_layout(seqs)
    depth = torch.empty(end.shape[0], dtype=torch.long)
    for path in paths:
        depth[path] = torch.arange(len(path))
    return end, depth, paths


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [1, 2, 3, 7, 1000])
def test_dense_mask_matches_the_definition(seed, window):
    rng = random.Random(seed)
    end = random_subtree_end(rng, 150, num_pad=5, p_extend=0.7 + 0.05 * seed)
    assert torch.equal(dense_tree_mask(end, window=window), windowed_by_definition(end, window))
    slots = torch.randperm(end.shape[0], generator=torch.Generator().manual_seed(seed))[:60]
    assert torch.equal(dense_tree_mask(end, slots, window), windowed_by_definition(end, window, slots))


def test_depths_are_the_positions_and_window_one_is_the_diagonal():
    end, depth, _ = tree_of(FOREST)
    assert torch.equal(tree_depths(end), depth)
    assert torch.equal(dense_tree_mask(end, window=1), torch.eye(end.shape[0], dtype=torch.bool))
    assert torch.equal(dense_tree_mask(end, window=int(depth.max()) + 1), dense_tree_mask(end))
    starts = window_starts(end, 3)
    # each slot's window starts at its ancestor two levels up (or its root)
    assert torch.equal(depth[starts], (depth - 2).clamp_min(0))
    assert (dense_tree_mask(end)[torch.arange(end.shape[0]), starts]).all()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_window_must_be_a_positive_int(bad):
    end = torch.tensor([3, 3, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="window must be None or an int >= 1"):
        dense_tree_mask(end, window=bad)
    q = torch.zeros(3, 1, 2, 4)
    with pytest.raises(ValueError, match="window must be None or an int >= 1"):
        tree_attention(q, q, q, end[None], window=bad)


# ----------------------------------------------------------------------------- flex block tables


def brute_force_blocks(mask: torch.Tensor, bq: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nonempty, full) bool [nq, nk] of a dense mask [Tq, T]."""
    tq, t = mask.shape
    tiles = mask.view(tq // bq, bq, t // bk, bk).permute(0, 2, 1, 3)
    return tiles.any(dim=(2, 3)), tiles.all(dim=(2, 3))


@pytest.mark.parametrize("block_size", [1, 4, 16, (8, 4)])
@pytest.mark.parametrize("window", [1, 3, 9, 40])
@pytest.mark.parametrize("seed", range(3))
def test_windowed_tables_are_safe_and_skip_blocks_before_every_window(seed, window, block_size):
    """Every tile with a visible pair is listed, tiles flagged full are full, and no tile lying before every
    row's window start is listed; with query slots (context parallel) too."""
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    end = random_subtree_end(random.Random(seed), 96 - 6, num_pad=6, p_extend=0.9)
    for slots in (None, torch.randperm(96, generator=torch.Generator().manual_seed(seed))[:48].to(torch.int32)):
        starts = row_window_starts(end, window, slots)
        partial, full = classify_blocks(end, (bq, bk), slots, starts)
        truth_any, truth_all = brute_force_blocks(dense_tree_mask(end, slots, window), bq, bk)
        assert not (partial & full).any()
        assert ((partial | full) >= truth_any).all(), "a tile with a visible pair is skipped"
        assert (truth_all >= full).all(), "a tile flagged full is not"
        k1 = torch.arange(bk - 1, 96, bk)[None, :]
        before_every_window = k1 < starts.reshape(-1, bq).amin(dim=1)[:, None]
        assert not ((partial | full) & before_every_window).any()


@pytest.mark.parametrize("window", [1, 5, 16, 33])
def test_windowed_tables_on_a_chain_are_the_band(window):
    """One sequence (a chain): the tables are exactly the sliding-window band's (nothing conservative)."""
    end = torch.full((128,), 128, dtype=torch.int32)
    partial, full = classify_blocks(end, 8, None, row_window_starts(end, window))
    truth_any, truth_all = brute_force_blocks(dense_tree_mask(end, window=window), 8, 8)
    assert torch.equal(partial | full, truth_any) and torch.equal(full, truth_all)


def test_windowed_block_mask_encodes_the_dense_mask_and_skips_more():
    """The BlockMask (tables + mask_mod) is the dense windowed mask; a deep tree lists fewer tiles than without window
    (measured: 115 tiles listed against 305 without; 488 against 493 with scattered query slots)."""
    end = random_subtree_end(random.Random(5), 500, num_pad=12, p_extend=0.99)
    for slots in (None, torch.randperm(512, generator=torch.Generator().manual_seed(1))[:256].to(torch.int32)):
        mask = flex_tree_mask(end, 16, slots, window=24)
        block_mask = mask.block_mask
        tq, tp = block_mask.seq_lengths
        assert (tq, tp) == ((512 if slots is None else 256), 512)
        i, j = torch.arange(tq)[:, None], torch.arange(tp)[None, :]
        dense = _encoded(block_mask, i, j)
        assert torch.equal(dense, dense_tree_mask(end, slots, 24))
        plain = flex_tree_mask(end, 16, slots).block_mask
        listed = int(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum())
        listed_plain = int(plain.kv_num_blocks.sum() + plain.full_kv_num_blocks.sum())
        # scattered query rows (context parallel) share tiles with rows of every depth: fewer tiles skipped there
        assert listed < (listed_plain / 2 if slots is None else listed_plain), (listed, listed_plain)


def _encoded(block_mask, i, j):
    """Element mask a BlockMask encodes: full tiles, plus its mask_mod inside partial tiles."""
    bq, bk = block_mask.BLOCK_SIZE
    nq, nk = i.shape[0] // bq, j.shape[1] // bk

    def listed(num, idx):
        out = torch.zeros(nq, nk, dtype=torch.bool)
        for qb in range(nq):
            out[qb, idx[0, 0, qb, : num[0, 0, qb]].long()] = True
        return out.repeat_interleave(bq, 0).repeat_interleave(bk, 1)

    partial = listed(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return full | (partial & block_mask.mask_mod(0, 0, i, j))


@requires_cxx
def test_flex_forward_cpu_matches_dense_with_a_window():
    end = random_subtree_end(random.Random(9), 280, num_pad=20, p_extend=0.9)
    q, k, v = torch.randn(1, 4, 300, 32), torch.randn(1, 2, 300, 32), torch.randn(1, 2, 300, 32)
    for window in (1, 17, 64):
        out = flex_tree_attention(q, k, v, flex_tree_mask(end, window=window), softmax_scale=0.2)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.2, enable_gqa=True,
                                             attn_mask=dense_tree_mask(end, window=window))
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5, window


# ----------------------------------------------------------------------------- the core attention


def sliding_reference(q, k, v, scale, window):
    """Sliding-window causal attention of one sequence (HF: key j seen by query i iff i - window < j <= i):
    q [L, np, hn], k/v [L, ng, hn] -> [L, np, hn]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    i, j = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None, :]
    probs = scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("backend", ["auto", "dense"])
@pytest.mark.parametrize("window", [1, 3, 5])
def test_core_attention_matches_sliding_window_per_sequence(window, backend):
    """Values and q / k / v gradients of the tree equal sliding-window causal attention on each sequence (fp64)."""
    end, _, paths = tree_of(FOREST)
    assert max(map(len, paths)) > window + 3  # branches longer than the window
    t, (np_, ng, hn) = end.shape[0], (4, 2, 8)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, 1, h, hn, generator=gen, dtype=torch.float64).requires_grad_() for h in (np_, ng, ng))
    config = TransformerConfig(num_layers=1, hidden_size=np_ * hn, num_attention_heads=np_, num_query_groups=ng,
                               kv_channels=hn, use_cpu_initialization=True, attention_dropout=0.0,
                               window_size=(window - 1, 0))
    core = TreeCoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.arbitrary,
                             attention_type="self", backend=backend)
    core.positions_from_ids = True
    assert core.window == window
    out = core(q, k, v, end[None]).view(t, np_, hn)
    weights = [torch.randn(len(p), np_, hn, generator=gen, dtype=torch.float64) for p in paths]
    tree_grads = torch.autograd.grad(sum((w * out[p]).sum() for w, p in zip(weights, paths)), (q, k, v))
    ref_loss = 0.0
    scale = 1.0 / math.sqrt(hn)
    for w, p in zip(weights, paths):
        ref = sliding_reference(q[p, 0], k[p, 0], v[p, 0], scale, window)
        torch.testing.assert_close(out[p], ref, atol=1e-12, rtol=1e-12)
        ref_loss = ref_loss + (w * ref).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    for name, got, want in zip("qkv", tree_grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12, msg=f"d{name}")
    # the window matters here: plain tree attention differs
    assert not torch.allclose(out, tree_attention(q, k, v, end[None]).view(t, np_, hn))


def test_layer_window_follows_megatron_config():
    base = dict(num_layers=4, hidden_size=8, num_attention_heads=2)
    assert layer_window(TransformerConfig(**base), 1) is None
    assert layer_window(TransformerConfig(**base, window_size=(7, 0)), 3) == 8
    assert layer_window(TransformerConfig(**base, window_size=(-1, 0)), 1) is None  # no limit
    every_second_full = TransformerConfig(**base, window_size=(3, 0), window_attn_skip_freq=2)
    assert [layer_window(every_second_full, n) for n in (1, 2, 3, 4)] == [4, None, 4, None]
    listed = TransformerConfig(**base, window_size=(3, 0), window_attn_skip_freq=[0, 0, 1, 1])
    assert [layer_window(listed, n) for n in (1, 2, 3, 4)] == [None, None, 4, 4]


def test_right_window_refused():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, window_size=(8, 2))
    with pytest.raises(ValueError, match=r"window_size=\(8, 2\) \(a right window > 0"):
        TreeCoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.arbitrary, attention_type="self")


# ----------------------------------------------------------------------------- routing and refusals


def test_fa4_refuses_windowed_calls_with_the_reason():
    shape = AttentionShape(128, 128, 2, torch.bfloat16, "sm90", windowed=True)
    assert fa4_attention.refusal(shape, batch=1, dropout_p=0.0) == fa4_attention.WINDOW_REFUSAL
    end = torch.tensor([[4, 4, 4, 4]], dtype=torch.int32)
    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="no sliding-window mask"):
        tree_attention(q, q, q, end, backend="fa4", window=2)


def test_flex_windowed_table_holds_only_what_a_gpu_compared():
    """PROVEN_WINDOWED holds the shapes the H200 runs compared (head dim 64 at GQA 1/2/4 in every dtype, 128 at 2:1
    bf16); the plain table never proves a windowed call, nor the windowed table a plain one; an unproven windowed
    shape is refused with the reason (``auto`` runs it dense)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for ratio in (1, 2, 4):
            windowed = AttentionShape(64, 64, ratio, dtype, "sm90", windowed=True)
            assert flex_attention.PROVEN_WINDOWED.proves(windowed)
            assert not flex_attention.PROVEN.proves(windowed)
            assert flex_attention.refusal(windowed, batch=1, dropout_p=0.0) is None
    assert flex_attention.PROVEN_WINDOWED.proves(AttentionShape(128, 128, 2, torch.bfloat16, "sm90", windowed=True))
    assert not flex_attention.PROVEN_WINDOWED.proves(AttentionShape(64, 64, 1, torch.float32, "sm90"))
    for unproven in (AttentionShape(128, 128, 1, torch.float32, "sm90", windowed=True),
                     AttentionShape(64, 64, 8, torch.bfloat16, "sm90", windowed=True),
                     AttentionShape(64, 64, 1, torch.bfloat16, "sm100", windowed=True)):
        reason = flex_attention.refusal(unproven, batch=1, dropout_p=0.0)
        assert reason is not None and "sliding window on" in reason, unproven


def test_auto_and_dense_run_windowed_calls_on_cpu_and_cache_per_window(monkeypatch):
    end, _, _ = tree_of(FOREST)
    t = end.shape[0]
    q, k, v = (torch.randn(t, 1, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    mask = end[None].clone()
    calls = []
    real = dispatch.dense_attention.dense_tree_mask
    monkeypatch.setattr(dispatch.dense_attention, "dense_tree_mask",
                        lambda e, s=None, w=None: calls.append(w) or real(e, s, w))
    PREPARED_MASKS.clear()
    ref = {w: tree_attention(q, k, v, mask, backend="dense", window=w) for w in (None, 3)}
    for _ in range(2):  # two layers of each kind
        for w in (None, 3):
            torch.testing.assert_close(tree_attention(q, k, v, mask, window=w), ref[w], atol=0, rtol=0)
    assert sorted(calls, key=str) == [3, 3, None, None]  # once per (backend, window)
    assert not torch.allclose(ref[None], ref[3])


@pytest.mark.parametrize("backend", ["dense", "auto"])
def test_context_parallel_prepare_takes_the_window(backend):
    """Under context parallel each rank's query rows get the windowed rows of its slots (the CP mask ``[1, 2T]``)."""
    end, _, _ = tree_of(FOREST)
    t, size = end.shape[0], 2
    end = end[: t - t % size].clamp(max=t - t % size)
    t = end.shape[0]
    order = torch.randperm(t, generator=torch.Generator().manual_seed(0))
    cp_mask = torch.cat([order.to(torch.int32), end])[None]
    impl = get_tree_attention_backend(backend)
    for rank in range(size):
        prepared, inverse = dispatch._prepare_context_parallel(impl, cp_mask, rank, size, window=3)
        dense = prepared if backend == "dense" else dispatch.dense_attention.prepare(*prepared["masks"], window=3)
        assert torch.equal(dense[0, 0], dense_tree_mask(end, order[rank * t // size:(rank + 1) * t // size], 3))
        assert torch.equal(order[inverse], torch.arange(t))


def test_a_backend_without_window_refuses_windowed_calls():
    dense = get_tree_attention_backend("dense")
    name = "no_window_test_backend"
    if name not in dispatch._BACKENDS:
        register_tree_attention_backend(TreeAttentionBackend(name, dense.prepare, dense.attend, dense.refusal))
    q = torch.zeros(4, 1, 2, 8)
    end = torch.tensor([[4, 4, 4, 4]], dtype=torch.int32)
    tree_attention(q, q, q, end, backend=name)
    with pytest.raises(ValueError, match="takes no sliding window"):
        tree_attention(q, q, q, end, backend=name, window=2)


# ----------------------------------------------------------------------------- GPU (what would prove flex windowed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,ratio", [(torch.float32, 64, 1), (torch.float32, 64, 4), (torch.bfloat16, 128, 2),
                                           (torch.bfloat16, 64, 4)])
@pytest.mark.parametrize("query_slots", [False, True])
def test_cuda_flex_windowed_forward_backward_match_dense(dtype, d, ratio, query_slots):
    """The raw flex kernel with a window: fp32 within 1e-5 of the dense fp64 reference, bf16 within 2x dense bf16's
    error (FlashAttention's rule), with and without context-parallel query slots. Passing here is the evidence to add
    the shape to ``flex.PROVEN_WINDOWED``."""
    end = random_subtree_end(random.Random(4), 3000 - 41, num_pad=41, p_extend=0.97).cuda()
    t, heads = end.shape[0], 8
    slots = torch.randperm(t, generator=torch.Generator().manual_seed(2))[: t // 2].cuda() if query_slots else None
    tq = t if slots is None else slots.numel()
    gen = torch.Generator(device="cuda").manual_seed(d + ratio)
    base = [torch.randn(s, device="cuda", generator=gen).bfloat16().double() * 0.5
            for s in ((1, heads, tq, d), (1, heads // ratio, t, d), (1, heads // ratio, t, d), (1, heads, tq, d))]
    for window in (7, 300):
        dense_mask = dense_tree_mask(end, slots, window)
        mask = flex_tree_mask(end, query_slots=slots, window=window)

        def dense(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, enable_gqa=True)

        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            ref = forward_backward(dense, base, torch.float64)
        got = relative_errors(forward_backward(lambda q, k, v: flex_tree_attention(q, k, v, mask), base, dtype), ref)
        if dtype == torch.float32:
            assert max(got.values()) < 1e-5, (window, got)
        else:
            plain = relative_errors(forward_backward(dense, base, dtype), ref)
            assert not accept(got, plain, dtype), (window, accept(got, plain, dtype))


@pytest.mark.gpu
def test_cuda_auto_runs_unproven_windowed_calls_exactly():
    """``auto`` on the GPU: a windowed bf16 call that FA4 refuses and flex's windowed table does not hold (head dim 128,
    MHA) equals the dense reference."""
    end = random_subtree_end(random.Random(6), 900, num_pad=11).cuda()
    t = end.shape[0]
    q, k, v = (torch.randn(t, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    PREPARED_MASKS.clear()
    got = tree_attention(q, k, v, end[None], window=33)
    want = tree_attention(q, k, v, end[None], window=33, backend="dense")
    torch.testing.assert_close(got, want, atol=0, rtol=0)

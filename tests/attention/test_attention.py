"""TreeCoreAttention against plain per-sequence causal attention (values and input grads).

Each case lays a forest out in DFS pre-order with a tiny local trie (independent of
``megatron_tree.core.tree``), runs tree attention once over all slots, and compares every slot with
causal attention computed separately on each root-to-leaf path that holds it.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from forests import dfs_layout

from megatron_tree.attention import PREPARED_MASKS, get_tree_attention_backend, tree_attention
from megatron_tree.attention import dense as dense_attention
from megatron_tree.mcore.core_attention import TreeCoreAttention

FORESTS = {
    "branching": [[1, 2, 3, 4], [1, 2, 5, 6, 7, 8, 9], [1, 2, 3, 10], [11, 12], [1, 13]],
    "single_node": [[7]],
    "chain": [[1, 2, 3, 4, 5, 6]],
    "wide_star": [[0, i] for i in range(1, 10)],
    "duplicates": [[1, 2, 3], [1, 2, 3], [1, 2], [4], [4]],
}
HEADS = [(4, 2, 8), (3, 3, 5), (6, 1, 7)]  # (np, ng, hn): GQA 2:1, MHA with odd hn, MQA
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])




def causal_reference(q, k, v, scale):
    """Plain causal attention of one sequence: q [L, np, hn], k/v [L, ng, hn] -> [L, np, hn]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    length = q.shape[0]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_core(np_: int, ng: int, hn: int, **config_overrides) -> TreeCoreAttention:
    config_overrides.setdefault("attention_dropout", 0.0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=np_ * hn,
        num_attention_heads=np_,
        num_query_groups=ng,
        kv_channels=hn,
        use_cpu_initialization=True,
        **config_overrides,
    )
    core = TreeCoreAttention(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.arbitrary,
        attention_type="self",
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    )
    core.positions_from_ids = True
    return core


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "np{}-ng{}-hn{}".format(*h))
@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_matches_per_sequence_causal_attention(forest, heads, device):
    np_, ng, hn = heads
    seqs = FORESTS[forest]
    ends, paths = dfs_layout(seqs, padding=2)
    t = ends.shape[0]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(t, 1, h, hn, generator=gen, dtype=torch.float64).requires_grad_()
        for h in (np_, ng, ng)
    )
    core = make_core(np_, ng, hn)
    q32, k32, v32 = (x.to(device, torch.float32) for x in (q, k, v))
    out = core(q32, k32, v32, ends[None].to(device), attn_mask_type=AttnMaskType.arbitrary)
    assert out.shape == (t, 1, np_ * hn) and out.device.type == device
    out = out.view(t, np_, hn).cpu()

    weights = [torch.randn(len(p), np_, hn, generator=gen, dtype=torch.float64) for p in paths]
    scale = 1.0 / math.sqrt(hn)
    tree_loss = sum((w * out[p]).sum() for w, p in zip(weights, paths))
    tree_grads = torch.autograd.grad(tree_loss, (q, k, v))
    ref_loss = 0.0
    for w, p in zip(weights, paths):
        ref = causal_reference(q[p, 0], k[p, 0], v[p, 0], scale)
        torch.testing.assert_close(out[p].double(), ref, atol=1e-5, rtol=1e-5)
        ref_loss = ref_loss + (w * ref).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    for name, got, want in zip("qkv", tree_grads, ref_grads):
        used = sorted({s for p in paths for s in p})  # padding slots get no reference gradient
        torch.testing.assert_close(got[used], want[used], atol=1e-5, rtol=1e-5, msg=f"d{name}")


def test_batch_of_two_forests_and_softmax_scale():
    ends_a, paths_a = dfs_layout(FORESTS["branching"])
    ends_b, paths_b = dfs_layout(FORESTS["wide_star"])
    t = max(ends_a.shape[0], ends_b.shape[0])
    pad = lambda e: torch.cat([e, torch.arange(e.shape[0] + 1, t + 1, dtype=e.dtype)])  # noqa: E731
    ends = torch.stack([pad(ends_a), pad(ends_b)])
    q, k, v = (torch.randn(t, 2, h, 4, dtype=torch.float64) for h in (4, 2, 2))
    out = tree_attention(q, k, v, ends, scale=0.3).view(t, 2, 4, 4)
    for b, paths in ((0, paths_a), (1, paths_b)):
        for p in paths:
            ref = causal_reference(q[p, b], k[p, b], v[p, b], 0.3)
            torch.testing.assert_close(out[p, b], ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_error_is_a_small_multiple_of_plain_path(dtype, device):
    ends, paths = dfs_layout(FORESTS["branching"])
    t = ends.shape[0]
    q, k, v = (torch.randn(t, 1, h, 16, dtype=torch.float64) for h in (4, 2, 2))
    exact = tree_attention(q, k, v, ends[None]).view(t, 4, 16)
    ql, kl, vl = (x.to(device, dtype) for x in (q, k, v))
    low = tree_attention(ql, kl, vl, ends[None].to(device)).view(t, 4, 16)
    assert low.dtype == dtype
    tree_err = (low.double().cpu() - exact).abs().max()
    plain_err = max(
        (causal_reference(ql[p, 0], kl[p, 0], vl[p, 0], 0.25).double().cpu() - exact[p]).abs().max()
        for p in paths
    )
    assert tree_err <= 4 * plain_err + 1e-7, (tree_err, plain_err)


def test_mask_prepared_once_per_micro_batch_and_shared_by_recompute(monkeypatch):
    calls = []
    real = dense_attention.dense_tree_mask
    monkeypatch.setattr(dense_attention, "dense_tree_mask", lambda e, q=None, w=None: calls.append(1) or real(e, q, w))
    PREPARED_MASKS.clear()
    ends, _ = dfs_layout(FORESTS["branching"])
    mask = ends[None].clone()
    q, k, v = (torch.randn(mask.shape[1], 1, 2, 4) for _ in range(3))
    for _ in range(3):  # three layers
        tree_attention(q, k, v, mask)
    tree_attention(q, k, v, mask.detach())  # what activation recompute hands the layer
    assert len(calls) == 1
    mask[0, -1] = mask[0, -1]  # an in-place edit invalidates the entry
    tree_attention(q, k, v, mask)
    assert len(calls) == 2
    dense = get_tree_attention_backend("dense")
    assert PREPARED_MASKS.get(dense, mask) is PREPARED_MASKS.get(dense, mask.detach())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lookup", "hold", "release"]), st.integers(0, 5)), max_size=40))
def test_held_masks_keep_their_entries_and_the_rest_stay_within_capacity(ops):
    """The mask cache against a model of it: a held mask's entry is never evicted (a lookup finds it without preparing
    again) and goes when its last hold is released; at most ``capacity`` entries of masks nobody holds stay, the
    least recently used go first."""
    from megatron_tree.attention.dispatch import _PreparedMaskCache

    cache, masks = _PreparedMaskCache(capacity=2), [torch.arange(1, 5, dtype=torch.int32)[None] + i for i in range(6)]
    held, loose, prepared = [0] * 6, [], {}  # hold counts, unheld cached masks (least recent first), made objects
    for op, i in ops:
        if op == "hold":
            cache.hold([masks[i]])
            if not held[i] and i in loose:
                loose.remove(i)
            held[i] += 1
        elif op == "release" and held[i]:
            cache.release([masks[i]])
            held[i] -= 1
            if not held[i]:
                prepared.pop(i, None)
        elif op == "lookup":
            made = []
            got = cache.lookup(masks[i], ("t",), lambda: made.append(object()) or made[-1])
            assert bool(made) == (i not in prepared), (op, i)  # prepared again exactly when not cached
            prepared[i] = got
            if not held[i]:
                loose = [j for j in loose if j != i] + [i]
                for j in loose[: max(0, len(loose) - 2)]:
                    prepared.pop(j)
                loose = loose[-2:]
        cached = {j for j in range(6) if any((k[1], k[2]) == ("cpu", masks[j].data_ptr()) for k in cache._entries)}
        assert cached == set(prepared), (ops, cached, set(prepared))


def test_dropout_only_in_training():
    ends, _ = dfs_layout(FORESTS["branching"])
    t = ends.shape[0]
    q, k, v = (torch.randn(t, 1, 2, 4) for _ in range(3))
    core = make_core(2, 2, 4, attention_dropout=0.5)
    core.config.sequence_parallel = True  # plain torch RNG: no Megatron RNG tracker needed here
    core.eval()
    torch.testing.assert_close(core(q, k, v, ends[None]), tree_attention(q, k, v, ends[None]))
    core.train()
    assert not torch.allclose(core(q, k, v, ends[None]), tree_attention(q, k, v, ends[None]))


# ----------------------------------------------------------------------------- refusals


def test_context_parallel_needs_its_group():
    with pytest.raises(ValueError, match="context_parallel_size=2 but there is no context-parallel group"):
        make_core(2, 2, 4, context_parallel_size=2)


def test_refuses_right_window_and_non_self_attention():
    with pytest.raises(ValueError, match="window_size"):
        make_core(2, 2, 4, window_size=(8, 1))
    assert make_core(2, 2, 4, window_size=(8, 0)).window == 9  # sliding window: tests/attention/test_sliding_window.py
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match="attention_type='cross'"):
        TreeCoreAttention(
            config=config, layer_number=1, attn_mask_type=AttnMaskType.arbitrary,
            attention_type="cross",
        )
    with pytest.raises(ValueError, match="AttnMaskType.arbitrary"):
        TreeCoreAttention(
            config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
            attention_type="self",
        )
    with pytest.raises(ValueError, match="unknown tree attention backend 'nope'"):
        TreeCoreAttention(
            config=config, layer_number=1, attn_mask_type=AttnMaskType.arbitrary,
            attention_type="self", backend="nope",
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where the kernels cannot run")
@pytest.mark.parametrize("backend", ["flex", "fa4"])
def test_a_named_backend_refuses_at_build_time_what_it_cannot_run(backend):
    """A model built with a named backend that cannot compute its attention here is refused when it is built,
    with the reason, not at the first step; auto and dense build."""
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match=f"backend '{backend}' cannot run this model's attention .*Use backend='auto'"):
        TreeCoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.arbitrary,
                          attention_type="self", backend=backend)
    for ok in ("auto", "dense"):
        TreeCoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.arbitrary,
                          attention_type="self", backend=ok)


def test_refuses_bad_call_arguments():
    core = make_core(2, 2, 4)
    ends, _ = dfs_layout(FORESTS["branching"])
    t = ends.shape[0]
    q = k = v = torch.randn(t, 1, 2, 4)
    with pytest.raises(ValueError, match="packed_seq_params"):
        core(q, k, v, ends[None], packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="attention_bias"):
        core(q, k, v, ends[None], attention_bias=torch.zeros(1, 2, t, t))
    with pytest.raises(TypeError, match="int32/int64"):
        core(q, k, v, torch.ones(1, 1, t, t, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expected \[b, s\] = \[1, %d\]" % t):
        core(q, k, v, ends[None, :-1])
    bad = ends.clone()
    bad[3] = 3  # slot 3 would not see itself
    with pytest.raises(ValueError, match="not an interval vector"):
        core(q, k, v, bad[None])
    with pytest.raises(ValueError, match="needs attention_mask"):
        core(q, k, v, None)
    core.positions_from_ids = False
    with pytest.raises(RuntimeError, match="convert_to_tree_model"):
        core(q, k, v, ends[None])


def test_auto_backend_picks_dense_on_cpu_and_matches_it():
    torch.manual_seed(0)
    end = torch.tensor([[5, 5, 3, 5, 5]], dtype=torch.int32)
    q, k, v = torch.randn(5, 1, 4, 8), torch.randn(5, 1, 2, 8), torch.randn(5, 1, 2, 8)
    auto = tree_attention(q, k, v, end, backend="auto")
    dense = tree_attention(q, k, v, end, backend="dense")
    assert torch.equal(auto, dense)


@pytest.mark.gpu  # FlexAttention backward needs CUDA
def test_flex_backend_matches_dense_on_cuda():
    torch.manual_seed(0)
    end = torch.tensor([[5, 5, 3, 5, 5]], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(5, 1, h, 16, device="cuda", requires_grad=True) for h in (4, 2, 2))
    flex = tree_attention(q, k, v, end, backend="flex")
    grads = torch.autograd.grad(flex.square().sum(), (q, k, v))
    dense = tree_attention(q, k, v, end, backend="dense")
    ref = torch.autograd.grad(dense.square().sum(), (q, k, v))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chain_segments_finds_chain_forests_only():
    from megatron_tree.attention.te_chains import chain_segments

    # two chains of 3 and 2 slots, then 2 padding slots (each its own subtree)
    chains = torch.tensor([[3, 3, 3, 5, 5, 6, 7]], dtype=torch.int32)
    assert chain_segments(chains).tolist() == [0, 3, 5, 6, 7]
    # a prompt of 2 slots with two children of 1 and 2 slots: a branch
    branching = torch.tensor([[5, 5, 3, 5, 5]], dtype=torch.int32)
    assert chain_segments(branching) is None
    assert chain_segments(torch.tensor([[1]], dtype=torch.int32)).tolist() == [0, 1]


@pytest.mark.gpu  # Transformer Engine's fused attention needs CUDA
def test_chain_forest_through_te_matches_dense_bf16(monkeypatch):
    """A micro-batch without a branch runs on TE's cuDNN varlen kernel under ``auto`` (when TE is
    installed and FA4 is not, which ``auto`` prefers) and stays within the dense bf16 path's own
    error of the fp32 reference."""
    pytest.importorskip("transformer_engine")
    from megatron_tree.attention import fa4 as fa4_attention
    from megatron_tree.attention import te_chains as chain_attention

    monkeypatch.setattr(fa4_attention, "fa4_available", lambda device=None: False)

    torch.manual_seed(0)
    lens = [37, 300, 5, 128]
    end = torch.cat([torch.full((n,), sum(lens[: i + 1])) for i, n in enumerate(lens)]).int()[None].cuda()
    s = end.shape[1]
    q = torch.randn(s, 1, 8, 64, device="cuda", requires_grad=True)
    k = torch.randn(s, 1, 2, 64, device="cuda", requires_grad=True)
    v = torch.randn(s, 1, 2, 64, device="cuda", requires_grad=True)
    calls = []
    real = chain_attention.te_chain_attention
    chain_attention.te_chain_attention = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        def run(backend, dtype):
            args = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out = tree_attention(*args, end, backend=backend)
            out.float().square().sum().backward()
            return [out.float()] + [a.grad.float() for a in args]

        ref = run("dense", torch.float32)
        auto = run("auto", torch.bfloat16)
        dense = run("dense", torch.bfloat16)
    finally:
        chain_attention.te_chain_attention = real
    assert calls, "auto did not take the TE chain path"
    for got, base, want in zip(auto, dense, ref):
        assert (got - want).abs().max() <= 2 * (base - want).abs().max() + 1e-3

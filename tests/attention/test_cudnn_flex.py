"""The cudnn_flex tree attention backend: the interval encoding of the tree mask (any machine) and, on a
Hopper / Blackwell GPU with nvidia-cudnn-frontend, the kernels against the dense reference.

The encoding is checked exactly: the intervals' dense mask equals :func:`dense_tree_mask` on random forests
(chains, bushes, several trees, padding slots), with and without context-parallel query slots, and every row's
endpoints are what the kernel accepts (in ``[0, T]``, nondecreasing); so is the varlen encoding (one sequence per
tree, each row's endpoints local to its sequence and within it). The GPU tests judge the kernels as a
dense bf16 kernel is judged (within twice SDPA's own bf16 error of the fp32 reference on the same inputs).
"""

import random

import numpy as np
import pytest
import torch
from forests import random_subtree_end

from kernel_reference import (
    bf16_inputs,
    dense_attention,
    frontend_flex,
    fwd_bwd,
    gpu_tree,
    rel_errors,
    tree_micro_batch,
)
from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.attention import tree_attention
from megatron_tree.attention.cudnn_flex import (
    _flex,
    _run_start_parents,
    cudnn_flex_available,
    cudnn_flex_tree_mask,
    cudnn_flex_unavailable_reason,
    intervals_to_mask,
    segment_intervals,
    tree_intervals,
    tree_segments,
)
from megatron_tree.core.masks import dense_tree_mask, tree_depths, tree_parents
from megatron_tree.core.platform import have_transformer_engine
from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch

have_transformer_engine()  # TE loads the system cuDNN: before SDPA's cuDNN backend


def _check_encoding(end: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
    intervals = tree_intervals(end, slots)
    t = end.shape[-1]
    assert intervals.dtype == torch.int32 and intervals.dim() == 3 and intervals.shape[0] == 1
    assert intervals.shape[1] % 2 == 1 and intervals.shape[2] == (t if slots is None else slots.numel())
    f = intervals[0].long()
    assert (f >= 0).all() and (f <= t).all(), "endpoints outside [0, T]"
    assert (f[1:] >= f[:-1]).all(), "endpoints not nondecreasing along a row"
    assert torch.equal(intervals_to_mask(intervals, t), dense_tree_mask(end, slots))
    return intervals


@pytest.mark.parametrize("p_extend", [0.3, 0.85, 0.99])
def test_intervals_are_the_tree_mask_on_random_forests(p_extend):
    for seed in range(25):
        rng = random.Random(seed)
        end = random_subtree_end(rng, rng.randint(1, 250), rng.randint(0, 4), p_extend)
        t = end.shape[0]
        _check_encoding(end, None)
        slots = torch.randperm(t, generator=torch.Generator().manual_seed(seed))[: max(1, t // 3)]
        _check_encoding(end, slots)


@pytest.mark.parametrize("p_extend", [0.3, 0.85, 0.99])
def test_run_start_parents_are_the_tree_parents(p_extend):
    """The intervals read parents at run starts only, found among the branch slots: equal to tree_parents' search
    over every slot, on random forests with padding (one-slot forests and single chains among them)."""
    for seed in range(100):
        rng = random.Random(seed)
        end = random_subtree_end(rng, rng.randint(1, 200), rng.randint(0, 4), p_extend).reshape(-1).long()
        slot = torch.arange(end.shape[0])
        parent = tree_parents(end)
        first = slot[(parent != slot - 1) | (slot == 0)]
        assert torch.equal(_run_start_parents(end, tree_depths(end), first), parent[first])


def test_interval_counts_follow_branches_off_the_first_child_path():
    """A prompt (slots 0-2) with three samples: the first sample continues the prompt's run (one interval), each
    later sample adds one. A second tree (root 9, children 10 and 11) whose row 11 has the most runs but does not
    start at slot 0 needs an empty leading interval [0, 0)."""
    #                    prompt     s1    s2    s3    tree 2
    end = torch.tensor([9, 9, 9, 5, 5, 7, 7, 9, 9, 12, 11, 12], dtype=torch.int32)
    f = _check_encoding(end, None)[0]
    assert f.shape[0] == 5  # two runs at most, plus the leading empty interval
    assert f[:, 4].tolist() == [0, 0, 0, 0, 5]  # slot 4 (s1): [0, 5)
    assert f[:, 6].tolist() == [0, 0, 3, 5, 7]  # slot 6 (s2): [0, 3) U [5, 7)
    assert f[:, 10].tolist() == [0, 0, 0, 9, 11]  # slot 10: [9, 11)
    assert f[:, 11].tolist() == [0, 9, 10, 11, 12]  # slot 11: [9, 10) U [11, 12)
    assert _check_encoding(end[:9], None).shape[1] == 3  # tree 1 alone: no leading interval


def test_encoding_of_packed_micro_batches():
    """Real micro-batches of the packer (GRPO, deep multi-turn trees, padding), with chunk-context query slots."""
    rng = np.random.default_rng(3)
    batches = [grpo_batch(rng, n_prompts=3, samples=(2, 6), prompt_len=(20, 80), response_len=(1, 40), vocab=50),
               multi_turn_batch(rng, n_conversations=3, turns=(3, 8), turn_len=(2, 20), fork_prob=0.4,
                                system_len=10, vocab=50)]
    for seqs in batches:
        for mb in pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=512), pad_to_multiple_of=64):
            end = mb.attention_mask[0]
            _check_encoding(end, None)
            _check_encoding(end, torch.arange(end.shape[0] // 2, end.shape[0]))  # a chunk's queries behind context


def _check_segments(end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = end.shape[0]
    cu = tree_segments(end)
    roots = set(torch.nonzero(tree_parents(end) < 0).reshape(-1).tolist())
    trees = {r for r in roots if end[r] - r > 1}  # one-slot trees (the padding among them) may share a segment
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == t and (cu.diff() > 0).all()
    assert trees <= set(cu[:-1].tolist()) <= roots
    local = segment_intervals(end, cu)
    lengths = cu.diff().long()
    length = torch.repeat_interleave(lengths, lengths)
    f = local[0].long()
    assert local.dtype == torch.int32 and local.shape == tree_intervals(end).shape
    assert (f >= 0).all() and (f <= length).all() and (f.diff(dim=0) >= 0).all(), "endpoints not sorted in the segment"
    assert torch.equal(intervals_to_mask(local, t, cu), dense_tree_mask(end))
    return cu, local


@pytest.mark.parametrize("p_extend", [0.3, 0.9])
def test_one_varlen_sequence_per_tree_is_the_tree_mask(p_extend):
    """The varlen encoding (the backend's for a whole micro-batch): a sequence starts at every tree of more than one
    slot, a run of one-slot trees (the padding) shares one, and the local intervals give exactly the tree mask."""
    for seed in range(20):
        rng = random.Random(seed)
        end = random_subtree_end(rng, rng.randint(1, 250), rng.randint(0, 9), p_extend)
        _check_segments(end)
    rng = np.random.default_rng(5)
    seqs = grpo_batch(rng, n_prompts=3, samples=(2, 6), prompt_len=(20, 80), response_len=(1, 40), vocab=50)
    for mb in pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=512), pad_to_multiple_of=64):
        _check_segments(mb.attention_mask[0])


def test_varlen_sequences_by_hand():
    """A prompt with three samples (slots 0-8), a second tree (9-11), two padding slots: three sequences; tree 2's
    rows see keys counted from its own slot 9; the padding rows see themselves."""
    end = torch.tensor([9, 9, 9, 5, 5, 7, 7, 9, 9, 12, 11, 12, 13, 14], dtype=torch.int32)
    cu, local = _check_segments(end)
    assert cu.tolist() == [0, 9, 12, 14]
    f = local[0]
    assert f[:, 6].tolist() == [0, 0, 3, 5, 7]  # slot 6: [0, 3) U [5, 7)
    assert f[:, 11].tolist() == [0, 0, 1, 2, 3]  # slot 11: [0, 1) U [2, 3) of its sequence (slots 9, 11)
    assert f[:, 13].tolist() == [0, 0, 0, 1, 2]  # slot 13: [1, 2) of its sequence (slots 12, 13)
    mask = cudnn_flex_tree_mask(end)
    assert torch.equal(mask.cu_seqlens, cu) and mask.max_seqlen == 9 and torch.equal(mask.intervals, local)
    assert mask.cu_seqlens is not None and cudnn_flex_tree_mask(end, torch.arange(7, 14)).cu_seqlens is None


def test_a_wrong_varlen_encoding_is_seen():
    """The comparison can fail: the whole micro-batch's intervals (not made local) read per sequence hide tree 2's
    keys; a sequence cut inside a tree hides the keys before the cut."""
    end = torch.tensor([9, 9, 9, 5, 5, 7, 7, 9, 9, 12, 11, 12, 13, 14], dtype=torch.int32)
    cu = tree_segments(end)
    assert not torch.equal(intervals_to_mask(tree_intervals(end), 14, cu), dense_tree_mask(end))
    cut = torch.tensor([0, 5, 12, 14], dtype=torch.int32)
    assert not torch.equal(intervals_to_mask(segment_intervals(end, cut), 14, cut), dense_tree_mask(end))


def test_a_wrong_encoding_is_seen():
    """The comparison can fail: dropping a row's outer run leaves its prompt invisible."""
    end = torch.tensor([9, 9, 9, 5, 5, 7, 7, 9, 9], dtype=torch.int32)
    intervals = tree_intervals(end).clone()
    intervals[0, 0, 6] = 0  # slot 6 loses [0, 3)
    assert not torch.equal(intervals_to_mask(intervals, 9), dense_tree_mask(end))


def test_mask_plans_are_built_once_per_shape_and_kind(monkeypatch):
    """One cuDNN mask plan per (heads, head dims, dtype) and micro-batch, shared by the layers: a forward-only plan is
    built when no backward is needed (activation recompute's first forward, log-prob passes), one with backward
    payloads when it is, and that one then serves forward-only calls too. A whole micro-batch's plan is the varlen
    one (THD tensors, one sequence per tree); query slots' is one BSHD sequence."""
    import sys
    import types

    built = []

    def create_mask_plan(intervals, q, k, v, *, build_backward, **varlen):
        built.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), build_backward, varlen))
        return f"plan{len(built)}"

    fake = types.ModuleType("cudnn.flex_attention")
    fake.create_mask_plan = create_mask_plan
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    monkeypatch.setitem(sys.modules, "cudnn.flex_attention", fake)
    end = torch.tensor([9, 9, 9, 5, 5, 7, 7, 9, 9], dtype=torch.int32)
    mask = cudnn_flex_tree_mask(end)
    q, k, v = torch.zeros(1, 9, 8, 64), torch.zeros(1, 9, 2, 64), torch.zeros(1, 9, 2, 64)
    assert [mask.plan(q, k, v, False) for _ in range(3)] == ["plan1"] * 3
    assert [mask.plan(q, k, v, True) for _ in range(2)] == ["plan2"] * 2
    assert mask.plan(q, k, v, False) == "plan2"
    assert mask.plan(q[..., :4, :], k[..., :1, :], v[..., :1, :], True) == "plan3"  # another head layout
    assert mask.plan(q.bfloat16(), k.bfloat16(), v.bfloat16(), False) == "plan4"
    assert [b[3] for b in built] == [False, True, True, False]
    assert built[0][:3] == ((9, 8, 64), (9, 2, 64), (9, 2, 64))  # THD
    assert built[0][4]["cu_seqlens_q"].tolist() == [0, 9] and built[0][4]["max_seqlen_k"] == 9
    chunk = cudnn_flex_tree_mask(end, torch.arange(4, 9))
    assert chunk.plan(q[:, 4:], k, v, True) == "plan5" and built[-1][0] == (1, 5, 8, 64) and built[-1][4] == {}


def test_the_tensors_a_plan_holds_are_all_found():
    """What the side stream's build hands over to the compute stream (``record_stream``): every tensor on the device,
    through dataclass fields, slots, named tuples, lists and dicts, cycles and shared objects once; none elsewhere."""
    import dataclasses
    from typing import NamedTuple

    from megatron_tree.attention.cudnn_flex import _device_tensors

    meta = torch.device("meta")
    a, b, c, d, e = (torch.empty(i + 1, device=meta) for i in range(5))

    class Slotted:
        __slots__ = ("x", "y")

    class Pair(NamedTuple):
        first: object
        second: object

    @dataclasses.dataclass
    class Plan:
        topology: object
        payloads: dict
        cycle: object = None

    slotted = Slotted()
    slotted.x = Pair(b, [c, torch.empty(3)])  # a CPU tensor: not held on the device
    plan = Plan(topology=slotted, payloads={"p": d, "q": (d[:1], None, 3, "s")})
    plan.cycle = plan
    found = _device_tensors((a, plan, {"e": e}), meta)
    assert sorted(x.numel() for x in found) == [1, 1, 2, 3, 4, 5] and all(x.device == meta for x in found)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refused_without_a_gpu_with_the_reason():
    assert "needs a CUDA GPU" in cudnn_flex_unavailable_reason()
    q = torch.randn(5, 1, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(5, 1, 2, 64, dtype=torch.bfloat16)
    end = torch.full((1, 5), 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="cudnn_flex.*needs a CUDA GPU.*backend='auto'"):
        tree_attention(q, k, v, end, backend="cudnn_flex")
    with pytest.raises(ValueError, match="run bf16/fp16, not torch.float32"):
        tree_attention(q.float(), k.float(), v.float(), end, backend="cudnn_flex")
    assert tree_attention(q, k, v, end, backend="auto").shape == (5, 1, 4 * 64)


_cudnn_here = pytest.mark.skipif(
    not torch.cuda.is_available() or not cudnn_flex_available(),
    reason="needs a Hopper/Blackwell GPU and nvidia-cudnn-frontend (with the CuTe DSL)",
)


def requires_cudnn_flex(test):
    """A GPU test (marker ``gpu``) that also needs the cuDNN flex kernels to run here."""
    return pytest.mark.gpu(_cudnn_here(test))







def _many_trees() -> torch.Tensor:
    """A micro-batch of eight small GRPO trees (varlen sequences of 40-300 slots, none a multiple of 128) and padding
    to a multiple of 128 (one more sequence of one-slot trees), on the GPU."""
    rng = np.random.default_rng(11)
    seqs = grpo_batch(rng, n_prompts=8, samples=(1, 4), prompt_len=(30, 150), response_len=(1, 60), vocab=1000)
    mb = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=3000), pad_to_multiple_of=128)[0]
    end = mb.attention_mask[0]
    assert len(tree_segments(end)) - 1 > 8 and end.shape[0] > mb.num_tokens
    return end.cuda()


def _tree_and_query_slots(kind: str, query_slots: bool, seed: int, share: int):
    """``subtree_end`` of a ``kind`` micro-batch on the GPU and, with ``query_slots``, a random 1 / ``share`` of its
    slots as the queries (else None: every slot)."""
    end = _many_trees() if kind == "many_trees" else gpu_tree(kind)
    if not query_slots:
        return end, None
    t = end.shape[0]
    return end, torch.randperm(t, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))[: t // share]


@requires_cudnn_flex
@pytest.mark.parametrize("kind", ["grpo", "multi_turn", "many_trees"])
@pytest.mark.parametrize("heads,kv_heads,d", [(16, 8, 128), (8, 8, 64)])
@pytest.mark.parametrize("query_slots", [False, True])
def test_cudnn_flex_matches_dense_reference(kind, heads, kv_heads, d, query_slots):
    end, slots = _tree_and_query_slots(kind, query_slots, seed=3, share=2)
    t, tq = end.shape[0], end.shape[0] if slots is None else slots.numel()
    base = bf16_inputs(t, tq, heads, kv_heads, d)
    scale = d ** -0.5
    mask = dense_tree_mask(end, slots)
    ref = fwd_bwd(dense_attention(mask, scale), base, torch.float32)
    dense_bf16 = rel_errors(fwd_bwd(dense_attention(mask, scale), base, torch.bfloat16), ref)
    prepared = cudnn_flex_tree_mask(end, slots)
    got = rel_errors(fwd_bwd(lambda q, k, v: _flex(q, k, v, prepared, scale), base, torch.bfloat16), ref)
    for name, e, e_dense in zip(("out", "dq", "dk", "dv"), got, dense_bf16):
        assert e <= 2 * e_dense + 1e-4, f"{name}: cuDNN flex rel err {e:.2e} vs dense bf16 {e_dense:.2e}"


@requires_cudnn_flex
@pytest.mark.parametrize("kind", ["grpo", "many_trees"])
@pytest.mark.parametrize("heads,kv_heads,d", [(16, 8, 128), (8, 8, 64)])
@pytest.mark.parametrize("query_slots", [False, True])
def test_cudnn_flex_launches_match_the_frontend(kind, heads, kv_heads, d, query_slots):
    """The backend's launches (cudnn_flex_kernels: the frontend's Python once per geometry) against the frontend's own
    ``flex_attn_func`` on the same plan and inputs, on the call that records a geometry and on two that launch it:
    the forward bit for bit (with and without autograd), the gradients within bf16 rounding (GQA's dK / dV, and dQ,
    are fp32 atomic sums in no fixed order; a wrong argument is off by far more)."""
    end, slots = _tree_and_query_slots(kind, query_slots, seed=5, share=3)
    t, tq = end.shape[0], end.shape[0] if slots is None else slots.numel()
    base = bf16_inputs(t, tq, heads, kv_heads, d, seed=4)
    scale = d ** -0.5
    prepared = cudnn_flex_tree_mask(end, slots)
    ref = fwd_bwd(lambda q, k, v: frontend_flex(q, k, v, prepared, scale), base, torch.bfloat16)
    for call in ("recorded", "launched", "launched again"):
        got = fwd_bwd(lambda q, k, v: _flex(q, k, v, prepared, scale), base, torch.bfloat16)
        assert torch.equal(got[0], ref[0]), f"{call} call: its forward differs from the frontend's"
        for name, e in zip(("dq", "dk", "dv"), rel_errors(got[1:], ref[1:])):
            assert e <= 4e-3, f"{call} call: {name} is {e:.2e} (relative) from the frontend's"
    assert len(prepared.launches) == 2, "one forward and one backward geometry, resolved once"
    q, k, v = (x.bfloat16() for x in base[:3])
    with torch.no_grad():
        for call in ("recorded", "launched"):
            got, want = _flex(q, k, v, prepared, scale), frontend_flex(q, k, v, prepared, scale)
            assert torch.equal(got, want), f"{call} call without autograd: its forward differs from the frontend's"


@requires_cudnn_flex
def test_cudnn_flex_wrong_mask_is_caught():
    """The comparison can fail: the tree kernel against the reference of a causal mask is far off."""
    end = gpu_tree("grpo")
    t = end.shape[0]
    base = bf16_inputs(t, t, 16, 8, 128, seed=2)
    causal = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
    ref = fwd_bwd(dense_attention(causal, 128 ** -0.5), base, torch.float32)
    prepared = cudnn_flex_tree_mask(end)
    got = rel_errors(fwd_bwd(lambda q, k, v: _flex(q, k, v, prepared, 128 ** -0.5), base, torch.bfloat16), ref)
    assert got[0] > 0.05


@requires_cudnn_flex
@pytest.mark.parametrize("kind", ["grpo", "multi_turn"])
def test_a_mask_with_its_host_copy_is_built_off_the_compute_stream(kind):
    """``TreeMicroBatch.to`` notes the attention mask's host copy; the backend builds the mask from it and plans it on
    a side stream. With the compute stream held busy, the mask and its plan are built without waiting for it; the
    attention then gives the forward of the mask built the plain way (on the compute stream, with host syncs) bit for
    bit and its gradients within bf16 rounding. Every block of GPU memory the build left allocated on the side stream
    is a tensor of the mask or the plan, which the compute stream's use was recorded on (else the allocator could hand
    it to the next build while the compute stream still reads it)."""
    from megatron_tree.attention.cudnn_flex import _device_tensors, _side_stream

    moved = tree_micro_batch(kind).to("cuda")
    end = moved.attention_mask
    t, heads, kv_heads, d = end.shape[1], 16, 8, 128
    base = bf16_inputs(t, t, heads, kv_heads, d, seed=6)
    scale = d ** -0.5
    plain = cudnn_flex_tree_mask(end[0].clone())  # a new tensor: no host copy noted
    assert plain.stream is None
    ref = fwd_bwd(lambda q, k, v: _flex(q, k, v, plain, scale), base, torch.bfloat16)  # also compiles the kernels

    side = _side_stream(end.device)

    def side_blocks() -> set[int]:
        return {block["address"] for segment in torch.cuda.memory_snapshot() if segment["stream"] == side.cuda_stream
                for block in segment["blocks"] if block["state"] == "active_allocated"}

    before = side_blocks()
    q, k, v = (x.bfloat16().transpose(1, 2).requires_grad_() for x in base[:3])
    torch.cuda._sleep(2_000_000_000)  # about a second of the compute stream
    mask = cudnn_flex_tree_mask(end)
    plan = mask.plan(q, k, v, True)
    assert mask.stream is side
    assert not torch.cuda.current_stream().query(), "the build waited for the compute stream"
    torch.cuda.synchronize()
    held = {x.untyped_storage().data_ptr() for x in _device_tensors((mask, plan), end.device)}
    left = side_blocks() - before
    assert left and left <= held, f"{len(left - held)} blocks on the side stream are no tensor of the mask or plan"
    got = fwd_bwd(lambda q, k, v: _flex(q, k, v, mask, scale), base, torch.bfloat16)
    assert torch.equal(got[0], ref[0]), "the side stream's mask gives another forward"
    for name, e in zip(("dq", "dk", "dv"), rel_errors(got[1:], ref[1:])):
        assert e <= 4e-3, f"{name} is {e:.2e} (relative) from the plain mask's"

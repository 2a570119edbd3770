"""Tree attention of a chunk behind its context (``tree_attention(..., context=C)``, the chunks of a tree larger than a
micro-batch): its queries' outputs and gradients equal those rows of attention over the whole tree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_tree import MicroBatchSpec, build_forest, pack_trees
from megatron_tree.attention import tree_attention
from megatron_tree.attention.conformance import accept, relative_errors
from megatron_tree.core.tree import as_sequences


def chunk_cases(seed: int = 0, capacity: int = 40):
    """(whole forest's subtree_end [1, T], [(chunk's context_mask [1, C+s], its global slots [C+s], C)])."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 9, 50).tolist()
    seqs = [prompt + rng.integers(0, 9, n).tolist() for n in (5, 70, 33, 90)] + [rng.integers(0, 9, 60).tolist()]
    seqs.append(seqs[3][:80] + rng.integers(0, 9, 25).tolist())
    forest = build_forest(as_sequences(seqs))
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=capacity, chunk_trees=True))
    roots = {int(forest.node_start[r]): r for r in np.flatnonzero(forest.node_parent == -1).tolist()}
    cases, exported = [], {}
    base = {}
    for mb in mbs:
        g, i = mb.chunk.group, mb.chunk.index
        if i == 0:  # find this tree's first slot in the forest by its tokens
            size = sum(m.num_tokens for m in mbs if m.chunk.group == g)
            tokens = torch.cat([m.input_ids[0, : m.num_tokens] for m in mbs if m.chunk.group == g])
            base[g] = next(a for a in roots if int(forest.subtree_end[a]) - a == size
                           and torch.equal(torch.from_numpy(forest.tokens[a : a + size]), tokens))
        start = base[g] + sum(m.num_tokens for m in mbs if m.chunk.group == g and m.chunk.index < i)
        exported[g, i] = [] if mb.export_slots is None else (start + mb.export_slots.numpy()).tolist()
        ctx = [s for src, k in mb.chunk.sources for s in exported[g, src][:k]]
        cases.append((mb.context_mask, torch.as_tensor(ctx + list(range(start, start + mb.num_slots))), len(ctx)))
    return torch.from_numpy(forest.subtree_end.astype(np.int32))[None], cases


def check_chunks_match_whole(backend: str, device: str, dtype: torch.dtype, hn: int = 32, heads=(4, 2)) -> None:
    """Every chunk's call (``backend``, ``dtype``, ``heads`` = (query, key/value) heads of dim ``hn``) against the same
    rows of dense fp64 attention over the whole forest: outputs, dQ and the chunk's dK / dV (context keys included),
    as :mod:`megatron_tree.attention.conformance` proves a kernel: inputs bf16-representable (every precision sees the
    same numbers, so the error is the kernel's, not the inputs' rounding), errors relative in norm. fp32: within 1e-5.
    bf16: :func:`~megatron_tree.attention.conformance.accept`, within 2x the dense backend's own error at that
    precision on the same chunk (FlashAttention's rule)."""
    end, cases = chunk_cases()
    t = end.shape[1]
    gen = torch.Generator().manual_seed(0)

    def draw(*shape):  # seeded: the same numbers whatever ran before
        return torch.randn(*shape, generator=gen).bfloat16().double().to(device)

    q, k, v = (draw(t, 1, n, hn).requires_grad_() for n in (heads[0], *heads[1:] * 2))
    whole = tree_attention(q, k, v, end.to(device), backend="dense")
    assert any(c for _, _, c in cases)

    def chunk_call(name, mask, slots, c, grad):
        own = slots[c:]
        parts = [x.detach()[idx].to(dtype).requires_grad_() for x, idx in ((q, own), (k, slots), (v, slots))]
        out = tree_attention(*parts, mask.to(device), backend=name, context=c)
        return [out, *torch.autograd.grad(out, parts, grad.to(dtype))]

    for mask, slots, c in cases:
        slots = slots.to(device)
        want = whole[slots[c:]]
        grad = draw(*want.shape)
        want_grads = torch.autograd.grad(want, (q, k, v), grad, retain_graph=True)
        refs = [want.detach(), want_grads[0][slots[c:]], want_grads[1][slots], want_grads[2][slots]]
        got = relative_errors(chunk_call(backend, mask, slots, c, grad), refs)
        if dtype == torch.float32:
            assert max(got.values()) < 1e-5, got
        else:
            problems = accept(got, relative_errors(chunk_call("dense", mask, slots, c, grad), refs), dtype)
            assert not problems, f"chunk of {len(slots) - c} queries behind {c} context slots, {backend}: {problems}"


def test_dense_chunk_behind_its_context_equals_the_whole_tree():
    check_chunks_match_whole("dense", "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype,hn,heads", [
    ("flex", torch.float32, 64, (4, 1)),    # flex's proven fp32 shapes: GQA 4:1 at head dim 64
    ("flex", torch.bfloat16, 128, (4, 2)),
    ("fa4", torch.bfloat16, 128, (4, 2)),   # the chunk's queries reach FA4 as query slots
    ("fa4", torch.bfloat16, 64, (4, 4)),
    ("cudnn_flex", torch.bfloat16, 128, (8, 2)),  # the chunk's queries reach cudnn_flex as query slots (one sequence)
    ("cudnn_flex", torch.bfloat16, 64, (4, 4)),
])
def test_gpu_chunk_behind_its_context_equals_the_whole_tree(backend, dtype, hn, heads):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if backend == "fa4":
        from megatron_tree.attention.fa4 import fa4_available

        if not fa4_available():
            pytest.skip("needs flash-attn-4 (benchmarks/fa4_stage.sh)")
    if backend == "cudnn_flex":
        from megatron_tree.attention.cudnn_flex import cudnn_flex_unavailable_reason

        reason = cudnn_flex_unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
    check_chunks_match_whole(backend, "cuda", dtype, hn, heads)

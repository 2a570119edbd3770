"""Tree attention of a chunk behind its context (``tree_attention(..., context=C)``, the chunks of a tree larger than a
micro-batch): its queries' outputs and gradients equal those rows of attention over the whole tree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_tree import MicroBatchSpec, build_forest, pack_trees
from megatron_tree.attention import tree_attention
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


def check_chunks_match_whole(backend: str, device: str, dtype: torch.dtype, tol: float) -> None:
    end, cases = chunk_cases()
    t = end.shape[1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, 1, n, 32, generator=gen).to(device, dtype).requires_grad_() for n in (4, 2, 2))
    whole = tree_attention(q, k, v, end.to(device), backend="dense")
    assert any(c for _, _, c in cases)
    for mask, slots, c in cases:
        slots = slots.to(device)
        own = slots[c:]
        parts = [x.detach()[idx].requires_grad_() for x, idx in ((q, own), (k, slots), (v, slots))]
        out = tree_attention(*parts, mask.to(device), backend=backend, context=c)
        want = whole[own]
        grad = torch.randn_like(want)
        got_grads = torch.autograd.grad(out, parts, grad)
        want_grads = torch.autograd.grad(want, (q, k, v), grad, retain_graph=True)
        scale = want.abs().max()
        assert float((out - want).abs().max() / scale) < tol
        assert float((got_grads[0] - want_grads[0][own]).abs().max() / want_grads[0].abs().max()) < tol
        for got, ref in zip(got_grads[1:], want_grads[1:]):  # keys and values read by the chunk's queries
            assert float((got - ref[slots]).abs().max() / ref.abs().max()) < tol


def test_dense_chunk_behind_its_context_equals_the_whole_tree():
    check_chunks_match_whole("dense", "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
def test_flex_chunk_behind_its_context_equals_the_whole_tree():
    check_chunks_match_whole("flex", "cuda", torch.float32, 1e-5)

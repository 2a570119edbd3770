"""gather_tree_values / gather_tree_scores vs per-sequence references, value_loss vs a
per-token loop, and their refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from forests import any_batch
from megatron_tree import MicroBatchSpec, gather_tree_scores, gather_tree_values, pack_trees
from megatron_tree.ops.losses import value_loss


def _prefix_value(prefix: list[int]) -> float:
    """A value that depends only on the prefix (as a causal model's does)."""
    return float(sum((d + 1) * (t + 1) ** 0.5 for d, t in enumerate(prefix)))


def _slot_values(mb) -> torch.Tensor:
    """[1, T, 1] float64: each slot's value = :func:`_prefix_value` of the root path to it."""
    ids, end = mb.input_ids[0].tolist(), mb.attention_mask[0].tolist()
    values, stack = [], []  # stack: ancestors of the current slot (DFS pre-order)
    for j in range(mb.num_slots):
        while stack and not j < end[stack[-1]]:
            stack.pop()
        stack.append(j)
        values.append(_prefix_value([ids[i] for i in stack]))
    return torch.tensor(values, dtype=torch.float64)[None, :, None]


@settings(max_examples=40, deadline=None)
@given(any_batch)
def test_values_and_scores_equal_per_sequence(seqs):
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=40))
    for mb in mbs:
        slot_values = _slot_values(mb).requires_grad_()
        values, scores = gather_tree_values(slot_values, mb), gather_tree_scores(slot_values, mb)
        cu = mb.cu_targets.tolist()
        assert values.shape == (cu[-1],) and scores.shape == (len(mb.sequence_ids),)
        for k, sid in enumerate(mb.sequence_ids):
            seq = seqs[sid]
            want = [_prefix_value(seq[: j + 1]) for j in range(len(seq) - 1)]
            assert values[cu[k] : cu[k + 1]].tolist() == pytest.approx(want, rel=1e-12)
            assert scores[k].item() == pytest.approx(_prefix_value(seq), rel=1e-12)
        # A shared slot's gradient sums over the sequences (targets) that read it.
        (values.sum() + scores.sum()).backward()
        reads = torch.bincount(torch.cat([mb.logprob_slots, mb.last_slots]), minlength=mb.num_slots)
        assert torch.equal(slot_values.grad[0, :, 0], reads.double())


def test_values_refuse_bad_input():
    mb = pack_trees([[1, 2, 3], [1, 2, 4]], MicroBatchSpec(max_tokens_per_mb=8))[0]
    with pytest.raises(ValueError, match=r"\[1, T=4, 1\].*make_value_model"):
        gather_tree_values(torch.zeros(1, mb.num_slots, 160), mb)  # a language-model head
    with pytest.raises(ValueError, match=r"\[1, T=4, 1\]"):
        gather_tree_scores(torch.zeros(1, mb.num_slots + 1, 1), mb)
    with pytest.raises(TypeError, match="TreeMicroBatch"):
        gather_tree_values(torch.zeros(1, 4, 1), [mb])


def _value_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = [3, 1, 6, 2]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    old = torch.randn(sum(lens), generator=gen, dtype=torch.float64)
    new = (old + 0.3 * torch.randn(sum(lens), generator=gen, dtype=torch.float64)).requires_grad_()
    returns = torch.randn(sum(lens), generator=gen, dtype=torch.float64)
    mask = torch.rand(sum(lens), generator=gen) > 0.3
    return new, old, returns, cu, mask


@pytest.mark.parametrize("clip_eps", [0.2, None])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_value_loss_matches_loop(clip_eps, normalization):
    new, old, ret, cu, mask = _value_batch()
    loss, metrics = value_loss(new, old, ret, cu, loss_mask=mask, clip_eps=clip_eps, normalization=normalization)
    per_seq, terms, clipped = [], [], []
    for k in range(len(cu) - 1):
        seq = []
        for i in range(cu[k], cu[k + 1]):
            a = (new[i] - ret[i]) ** 2
            b = (old[i] + torch.clamp(new[i] - old[i], -clip_eps, clip_eps) - ret[i]) ** 2 if clip_eps else a
            if mask[i]:
                seq.append(0.5 * torch.maximum(a, b))
                clipped.append(float(b > a))
        terms += seq
        if seq:
            per_seq.append(torch.stack(seq).mean())
    want = torch.stack(terms).mean() if normalization == "token" else torch.stack(per_seq).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert metrics["clip_fraction"].item() == pytest.approx(sum(clipped) / len(clipped))
    assert 0 < metrics["clip_fraction"] < 1 if clip_eps else metrics["clip_fraction"] == 0
    (grad,) = torch.autograd.grad(loss, new)
    (want_grad,) = torch.autograd.grad(want, new)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    # Split over two "micro-batches" with reduction="sum": the sums give the global value.
    halves = [(0, 2), (2, 4)]
    total, count = 0.0, 0
    for a, b in halves:
        sl = slice(int(cu[a]), int(cu[b]))
        part, m = value_loss(new[sl], old[sl], ret[sl], cu[a : b + 1] - cu[a], loss_mask=mask[sl], clip_eps=clip_eps,
                             normalization=normalization, reduction="sum")  # fmt: skip
        total, count = total + part, count + m["normalizer"]
    assert (total / count).item() == pytest.approx(loss.item(), rel=1e-12)


def test_value_loss_refuses_bad_input():
    new, old, ret, cu, _ = _value_batch()
    with pytest.raises(ValueError, match="clip_eps must be a float > 0 or None"):
        value_loss(new, old, ret, cu, clip_eps=0.0)
    with pytest.raises(ValueError, match="returns must be a tensor"):
        value_loss(new, old, ret[:-1], cu)
    with pytest.raises(ValueError, match="values must be a 1-D float tensor"):
        value_loss(new[None], old, ret, cu)


def test_value_loss_refuses_non_finite_returns_and_old_values():
    new, old, ret, cu, mask = _value_batch()
    with pytest.raises(ValueError, match=r"^returns must be finite .* the first \[0\] = nan"):
        value_loss(new, old, torch.where(torch.arange(ret.numel()) == 0, float("nan"), ret), cu, loss_mask=mask)
    bad_old = old.clone()
    bad_old[3] = float("inf")
    with pytest.raises(ValueError, match=r"^old_values must be finite .* the first \[3\] = inf"):
        value_loss(new, bad_old, ret, cu)
    value_loss(new, bad_old, ret, cu, clip_eps=None)  # unclipped: old values are not used

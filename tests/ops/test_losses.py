"""ppo_clip_loss / sft_loss vs per-sequence Python-loop references: values, metrics,
gradients, splitting a batch over micro-batches with reduction="sum", validation."""

from __future__ import annotations

import pytest
import torch

from megatron_tree.ops.losses import ppo_clip_loss, sft_loss

LENS = [3, 1, 7, 4, 2]  # targets per sequence (N = 17)


def _batch(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    n_tok = sum(LENS)
    cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
    old = -torch.rand(n_tok, generator=gen, dtype=dtype) * 3
    new = (old + 0.4 * torch.randn(n_tok, generator=gen, dtype=dtype)).requires_grad_()
    adv = torch.randn(n_tok, generator=gen, dtype=dtype)
    mask = torch.rand(n_tok, generator=gen) > 0.3
    mask[cu[1] : cu[2]] = False  # one sequence without loss tokens
    return new, old, adv, cu, mask


def _ppo_reference(new, old, adv, cu, mask, eps_low, eps_high, normalization):
    """Per-sequence loop: token losses, then the chosen normalisation."""
    per_seq, tokens, clipped, kl = [], [], [], []
    for k in range(len(cu) - 1):
        terms = []
        for i in range(cu[k], cu[k + 1]):
            r = torch.exp(new[i] - old[i])
            a = -adv[i] * r
            b = -adv[i] * torch.clamp(r, 1 - eps_low, 1 + eps_high)
            if mask[i]:
                terms.append(torch.maximum(a, b))
                clipped.append(float(b > a))
                kl.append((r - 1 - torch.log(r)).item())
        tokens += terms
        if terms:
            per_seq.append(sum(terms) / len(terms))
    loss = sum(tokens) / len(tokens) if normalization == "token" else sum(per_seq) / len(per_seq)
    count = len(tokens) if normalization == "token" else len(per_seq)
    return loss, count, sum(clipped) / len(clipped), sum(kl) / len(kl)


@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_ppo_matches_reference(normalization, eps_high):
    new, old, adv, cu, mask = _batch()
    loss, metrics = ppo_clip_loss(
        new, old, adv, cu, loss_mask=mask, clip_eps=0.2, clip_eps_high=eps_high, normalization=normalization
    )
    (grad,) = torch.autograd.grad(loss, new)
    ref_in = new.detach().clone().requires_grad_()
    ref, count, clip_frac, kl = _ppo_reference(ref_in, old, adv, cu, mask, 0.2, eps_high or 0.2, normalization)
    (ref_grad,) = torch.autograd.grad(ref, ref_in)
    assert torch.allclose(loss, ref, atol=1e-12, rtol=0)
    assert torch.allclose(grad, ref_grad, atol=1e-12, rtol=0)
    assert 0 < metrics["clip_fraction"] < 1
    assert abs(metrics["clip_fraction"].item() - clip_frac) < 1e-12
    assert abs(metrics["approx_kl"].item() - kl) < 1e-12
    assert metrics["normalizer"].item() == count and metrics["normalizer"].dtype == torch.int64


def test_ppo_gradcheck():
    new, old, adv, cu, mask = _batch(seed=1)
    for normalization in ("token", "sequence"):
        fn = lambda x: ppo_clip_loss(x, old, adv, cu, loss_mask=mask, normalization=normalization)[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (new.detach().clone().requires_grad_(),))


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_sum_over_micro_batches_equals_global_mean(normalization):
    """Split the sequences over micro-batches of unequal size: sum of numerators / sum of
    normalizers (what Megatron does with calculate_per_token_loss=True) = the global mean."""
    new, old, adv, cu, mask = _batch(seed=2)
    whole, _ = ppo_clip_loss(new, old, adv, cu, loss_mask=mask, normalization=normalization)
    total, count = 0.0, 0
    for lo, hi in ((0, 1), (1, 4), (4, 5)):  # sequence ranges
        a, b = cu[lo].item(), cu[hi].item()
        part_cu = cu[lo : hi + 1] - cu[lo]
        loss, metrics = ppo_clip_loss(
            new[a:b], old[a:b], adv[a:b], part_cu, loss_mask=mask[a:b], normalization=normalization, reduction="sum"
        )
        total, count = total + loss, count + metrics["normalizer"]
    assert torch.allclose(total / count, whole, atol=1e-12, rtol=0)


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_sft_matches_reference(normalization):
    new, _, _, cu, mask = _batch(seed=3)
    loss, metrics = sft_loss(new, cu, loss_mask=mask, normalization=normalization)
    seqs = [[-new[i] for i in range(cu[k], cu[k + 1]) if mask[i]] for k in range(len(cu) - 1)]
    tokens = [t for s in seqs for t in s]
    seq_means = [sum(s) / len(s) for s in seqs if s]
    ref = sum(tokens) / len(tokens) if normalization == "token" else sum(seq_means) / len(seq_means)
    assert torch.allclose(loss, ref, atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad(loss, new)
    (ref_grad,) = torch.autograd.grad(ref, new)
    assert torch.allclose(grad, ref_grad, atol=1e-12, rtol=0)
    assert metrics["normalizer"].item() == (len(tokens) if normalization == "token" else len(seq_means))


def test_no_loss_tokens_gives_zero():
    new, old, adv, cu, _ = _batch()
    none = torch.zeros_like(new, dtype=torch.bool)
    loss, metrics = ppo_clip_loss(new, old, adv, cu, loss_mask=none, normalization="sequence")
    assert loss.item() == 0 and metrics["normalizer"].item() == 0 and metrics["approx_kl"].item() == 0


def test_bad_inputs():
    new, old, adv, cu, mask = _batch()
    with pytest.raises(ValueError, match="normalization must be one of"):
        ppo_clip_loss(new, old, adv, cu, normalization="batch")
    with pytest.raises(ValueError, match="reduction must be one of"):
        sft_loss(new, cu, reduction="none")
    with pytest.raises(ValueError, match="advantages must be a tensor \\[N=17\\]"):
        ppo_clip_loss(new, old, adv[:5], cu)
    with pytest.raises(ValueError, match="loss_mask must be a tensor"):
        sft_loss(new, cu, loss_mask=mask[:-1])
    with pytest.raises(ValueError, match="clip_eps must be a float in \\(0, 1\\)"):
        ppo_clip_loss(new, old, adv, cu, clip_eps=1.5)
    with pytest.raises(ValueError, match="clip_eps_high must be a float > 0"):
        ppo_clip_loss(new, old, adv, cu, clip_eps_high=-0.1)
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D integer tensor"):
        sft_loss(new, cu.float())
    with pytest.raises(ValueError, match="logprobs must be a 1-D float tensor"):
        sft_loss(new[None], cu)


@pytest.mark.parametrize("name, bad", [("advantages", float("nan")), ("advantages", float("inf")),
                                       ("old_logprobs", float("nan")), ("old_logprobs", float("-inf"))])
def test_non_finite_rollout_inputs_are_refused_by_name(name, bad):
    """NaN / inf in old log-probs or advantages is refused, on a masked-out target too (0 * NaN would
    make the whole loss NaN); the message names the argument and the first bad entry."""
    new, old, adv, cu, mask = _batch()
    inputs = {"old_logprobs": old.clone(), "advantages": adv.clone()}
    masked_out = int((~mask).nonzero()[0, 0])
    inputs[name][masked_out] = bad
    with pytest.raises(ValueError, match=rf"^{name} must be finite .*1 of its 17 entries are NaN or inf, the first "
                                         rf"\[{masked_out}\] = {bad}"):
        ppo_clip_loss(new, inputs["old_logprobs"], inputs["advantages"], cu, loss_mask=mask)


def test_advantages_are_checked_in_the_dtype_the_loss_uses():
    """1e39 fits float64 but is inf in float32 (logprobs' dtype), where the loss computes with it."""
    new, old, adv, cu, _ = _batch(dtype=torch.float32)
    adv = adv.double()
    adv[2] = 1e39
    with pytest.raises(ValueError, match=r"advantages must be finite \(torch.float32\).* the first \[2\] = inf"):
        ppo_clip_loss(new, old, adv, cu)

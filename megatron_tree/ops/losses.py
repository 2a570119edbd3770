"""Policy-gradient, likelihood and value losses on per-token log-probs (or values) in varlen layout.

Shape legend: n = sequences, N = next-token targets of all of them; sequence k owns
``[cu_seqlens[k], cu_seqlens[k+1])`` of every [N] tensor (the layout of
:func:`megatron_tree.gather_tree_logprobs`). ``loss_mask`` [N] (bool or 0/1) marks the
targets that count, e.g. response tokens only; default all.

The inputs that come from a rollout (old log-probs, advantages, old values, returns) must be finite
everywhere, masked-out targets included (``0 * NaN`` is NaN, so one NaN would poison the whole loss):
NaN or inf there raises ValueError naming the argument (one device sync per call). The tensors being
trained (``logprobs``, ``values``) are not checked: a non-finite loss from the model itself is the
caller's to catch (the launcher stops or skips that step before its optimizer step).

Normalisation (``normalization=``), the same whether sequences come packed as trees or flat:

- ``"token"``: sum of per-token losses / number of loss tokens. Matches flat training
  that averages over all loss tokens of the batch (DAPO, Megatron's per-token cross
  entropy). Long sequences weigh more.
- ``"sequence"``: mean over sequences of each sequence's token mean (original GRPO).
  Sequences without loss tokens are left out of the mean. A sequence split over several
  micro-batches (the parts in the chunks of a tree larger than a micro-batch,
  ``TreeMicroBatch.target_starts``) needs ``sequence_loss_tokens`` (its loss tokens over the whole
  sequence, [n]) so that each part divides by the whole count, and ``counts_sequence`` ([n] bool,
  ``mb.sequence_ends``) so that one part counts it in the normalizer: then the sum over micro-batches
  is exact.

``reduction="mean"`` returns that value for the tensors given. A global batch split over
micro-batches (and data-parallel ranks) needs ``reduction="sum"``: the returned numerator
and ``metrics["normalizer"]`` (loss tokens or loss sequences, int64) summed over all
micro-batches give the exact global value; see :func:`ppo_clip_loss` for the Megatron
wiring. Metrics are detached means over this call's loss tokens.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_NORMALIZATIONS = ("token", "sequence")
_REDUCTIONS = ("mean", "sum")


SEQUENCE_PARTS = contextvars.ContextVar("megatron_tree_sequence_parts", default=False)
"""True while a loss runs on a micro-batch that holds parts of sequences (a chunk of a tree larger than a micro-batch;
:func:`megatron_tree.mcore.schedule.tree_loss_func` sets it): ``normalization="sequence"`` then needs
``sequence_loss_tokens`` and ``counts_sequence``, and without them the losses here refuse instead of dividing each part
by its own count."""


@contextlib.contextmanager
def sequence_parts(active: bool):
    """Mark the losses called in the block as running on sequence parts (:data:`SEQUENCE_PARTS`) when ``active``."""
    token = SEQUENCE_PARTS.set(active)
    try:
        yield
    finally:
        SEQUENCE_PARTS.reset(token)


def _check_logprobs(logprobs: torch.Tensor, name: str = "logprobs") -> None:
    """ValueError unless ``logprobs`` is a 1-D float tensor [N]."""
    if not isinstance(logprobs, torch.Tensor) or not logprobs.is_floating_point() or logprobs.ndim != 1:
        shape = tuple(getattr(logprobs, "shape", ()))
        got = f"{type(logprobs).__name__} {getattr(logprobs, 'dtype', '')} shape {shape}"
        raise ValueError(f"{name} must be a 1-D float tensor [N]; got {got}.")


def _check_tokens(name: str, value: torch.Tensor, like: torch.Tensor, like_name: str = "logprobs") -> None:
    """ValueError unless ``value`` is a tensor shaped like ``like`` [N] on its device."""
    if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.device != like.device:
        got = f"{type(value).__name__} shape {tuple(getattr(value, 'shape', ()))} on {getattr(value, 'device', '-')}"
        raise ValueError(f"{name} must be a tensor [N={like.numel()}] on {like.device} like {like_name}; got {got}.")


def _check_finite(**tensors: torch.Tensor) -> None:
    """ValueError naming the first of ``tensors`` (name=tensor [N], as the loss computes with it) that holds
    NaN or inf, with its first bad entry; one device sync for all of them."""
    finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()
    for (name, t), ok in zip(tensors.items(), finite):
        if not ok:
            bad = (~torch.isfinite(t)).nonzero()[:, 0]
            raise ValueError(
                f"{name} must be finite ({t.dtype}); {bad.numel()} of its {t.numel()} entries are NaN or inf, the "
                f"first [{int(bad[0])}] = {float(t[bad[0]])}. Fix or drop the rollouts they come from (masked-out "
                f"targets count too: 0 * NaN is NaN)."
            )


def _reduce(
    per_token: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor | None,
    normalization: str,
    reduction: str,
    sequence_loss_tokens: torch.Tensor | None = None,
    counts_sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the shared arguments and reduce ``per_token`` [N] float (sequence parts: module docstring).

    Returns ``(loss scalar, normalizer int64 scalar, mask [N] float)``.
    """
    if normalization not in _NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {_NORMALIZATIONS}; got {normalization!r}.")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}; got {reduction!r}.")
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.ndim != 1
        or cu_seqlens.numel() < 1
        or cu_seqlens.is_floating_point()
    ):
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [n+1] starting at 0; got {type(cu_seqlens).__name__} "
            f"{getattr(cu_seqlens, 'dtype', '')} shape {tuple(getattr(cu_seqlens, 'shape', ()))}. Pass mb.cu_targets."
        )
    if cu_seqlens.device != per_token.device:
        raise ValueError(
            f"cu_seqlens is on {cu_seqlens.device} but logprobs on {per_token.device}; move it with .to()."
        )
    if loss_mask is None:
        mask = torch.ones_like(per_token)
    else:
        _check_tokens("loss_mask", loss_mask, per_token)
        mask = loss_mask.to(per_token.dtype)

    if normalization == "token":
        numerator = (per_token * mask).sum()
        normalizer = mask.sum()
    else:
        if SEQUENCE_PARTS.get() and (sequence_loss_tokens is None or counts_sequence is None):
            raise ValueError(
                "normalization='sequence' on a micro-batch that holds parts of sequences (a chunk of a tree larger "
                "than a micro-batch) needs sequence_loss_tokens (each sequence's loss tokens over the whole sequence, "
                "[n]) and counts_sequence=mb.sequence_ends, or each part would be divided by its own count; pass them, "
                "use normalization='token', or pack with chunk_trees=False"
            )
        num_seqs = cu_seqlens.numel() - 1
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=per_token.device), cu_seqlens.diff(), output_size=per_token.numel()
        )
        seq_sum = per_token.new_zeros(num_seqs).index_add_(0, seq_of_token, per_token * mask)
        seq_count = mask.new_zeros(num_seqs).index_add_(0, seq_of_token, mask)
        for name, value in (("sequence_loss_tokens", sequence_loss_tokens), ("counts_sequence", counts_sequence)):
            if value is not None and (not isinstance(value, torch.Tensor) or value.shape != (num_seqs,)):
                raise ValueError(f"{name} must be a tensor [n={num_seqs}] (one entry per sequence of cu_seqlens); "
                                 f"got {type(value).__name__} shape {tuple(getattr(value, 'shape', ()))}.")
        # non-blocking: host tensors reach the GPU without waiting for the kernels queued before them
        whole = seq_count if sequence_loss_tokens is None else sequence_loss_tokens.to(
            seq_count.device, seq_count.dtype, non_blocking=True)
        numerator = (seq_sum / whole.clamp(min=1)).sum()
        counted = whole > 0 if counts_sequence is None else (whole > 0) & counts_sequence.to(
            whole.device, torch.bool, non_blocking=True)
        normalizer = counted.sum()
    normalizer = normalizer.long()
    loss = numerator if reduction == "sum" else numerator / normalizer.clamp(min=1)
    return loss, normalizer, mask


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of ``values`` [N] over ``mask`` [N] (0 when the mask is empty)."""
    return ((values * mask).sum() / mask.sum().clamp(min=1)).detach()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    normalization: str = "token",
    reduction: str = "mean",
    sequence_loss_tokens: torch.Tensor | None = None,
    counts_sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO / GRPO clipped surrogate: per token ``max(-A r, -A clip(r, 1 - eps, 1 + eps_high))``.

    Args:
      logprobs:      [N] log-probs of the policy being trained (differentiable).
      old_logprobs:  [N] log-probs of the policy that sampled the tokens (no grad needed).
      advantages:    [N] per token. GRPO's per-sequence advantages ``adv [n]``:
                     ``adv.repeat_interleave(cu_seqlens.diff(), output_size=N)``.
                     ``old_logprobs`` and ``advantages`` (in logprobs' dtype) must be finite
                     everywhere, masked-out targets included: NaN / inf raises ValueError naming
                     the argument (a log-prob missing from a rollout is the caller's to fill, e.g.
                     with the current one, ratio 1, as the launcher does).
      cu_seqlens:    [n+1] int offsets of the sequences in the [N] tensors.
      loss_mask:     [N] bool/0-1, targets that count (default all).
      clip_eps:      lower clip range; ``clip_eps_high`` the upper one (default = clip_eps;
                     set it larger for DAPO's clip-higher).
      normalization: ``"token"`` or ``"sequence"`` (module docstring).
      reduction:     ``"mean"`` or ``"sum"`` (numerator only, for splitting over micro-batches).
      sequence_loss_tokens, counts_sequence: ``"sequence"`` normalisation of sequences split over micro-batches
                     (chunks of a tree larger than a micro-batch; module docstring); None: every sequence whole.

    Returns:
      ``(loss scalar, metrics)``; metrics: ``clip_fraction`` (share of loss tokens where the
      clipped term is taken), ``approx_kl`` (mean of ``r - 1 - log r``, an estimate of
      KL(old || new)), ``normalizer`` (int64: loss tokens or loss sequences).

    Megatron (megatron-core 0.16 ``forward_step``): the loss_func may return
    ``(loss, num_tokens, metrics)``. With ``TransformerConfig(calculate_per_token_loss=True)``
    Megatron leaves each ``loss`` unscaled, sums ``num_tokens`` over micro-batches and DP
    ranks and divides the gradients by that sum, so return
    ``(loss_sum, metrics["normalizer"], logged_metrics)`` from ``reduction="sum"``: exact
    global token- or sequence-normalisation whatever the packing. Without it Megatron
    divides each micro-batch's loss by its own ``num_tokens`` and by the micro-batch count
    (a mean of micro-batch means, exact only when all micro-batches weigh the same).
    """
    if isinstance(clip_eps, bool) or not isinstance(clip_eps, (int, float)) or not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be a float in (0, 1); got {clip_eps!r}.")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if isinstance(eps_high, bool) or not isinstance(eps_high, (int, float)) or not eps_high > 0:
        raise ValueError(f"clip_eps_high must be a float > 0 (or None = clip_eps); got {clip_eps_high!r}.")
    _check_logprobs(logprobs)
    _check_tokens("old_logprobs", old_logprobs, logprobs)
    _check_tokens("advantages", advantages, logprobs)

    adv = advantages.detach().to(logprobs.dtype)
    _check_finite(old_logprobs=old_logprobs, advantages=adv)

    log_ratio = logprobs - old_logprobs.detach()
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)

    loss, normalizer, mask = _reduce(per_token, cu_seqlens, loss_mask, normalization, reduction,
                                     sequence_loss_tokens, counts_sequence)
    metrics = {
        "clip_fraction": _masked_mean((clipped > unclipped).to(mask.dtype), mask),
        "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, mask),
        "normalizer": normalizer,
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    clip_eps: float | None = 0.2,
    normalization: str = "token",
    reduction: str = "mean",
    sequence_loss_tokens: torch.Tensor | None = None,
    counts_sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss: per token ``0.5 * max((v - R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2)``.

    Args:
      values:     [N] the critic's values being trained (differentiable), in the log-prob layout
                  (:func:`megatron_tree.ops.values.gather_tree_values`).
      old_values: [N] the critic's values when the rollout was scored (no grad needed).
      returns:    [N] value targets (e.g. GAE advantages + old values). ``old_values`` and
                  ``returns`` (in values' dtype; ``old_values`` only where clipping uses them) must be
                  finite everywhere, masked-out targets included: NaN / inf raises ValueError
                  naming the argument.
      cu_seqlens: [n+1] int offsets of the sequences in the [N] tensors.
      loss_mask:  [N] bool/0-1, targets that count (default all).
      clip_eps:   > 0: how far ``values`` may move from ``old_values`` before the clipped
                  term takes over; ``None``: the plain squared error ``0.5 (v - R)^2``.
      normalization, reduction: as in :func:`ppo_clip_loss` (``reduction="sum"`` with
                  ``metrics["normalizer"]`` for Megatron's ``(sum, count)``).

    Returns:
      ``(loss scalar, metrics)``; metrics: ``clip_fraction`` (share of loss tokens where the
      clipped term is the larger), ``normalizer`` (int64: loss tokens or loss sequences).
    """
    if clip_eps is not None and (isinstance(clip_eps, bool) or not isinstance(clip_eps, (int, float)) or not clip_eps > 0):
        raise ValueError(f"clip_eps must be a float > 0 or None (no clipping); got {clip_eps!r}.")
    _check_logprobs(values, "values")
    _check_tokens("old_values", old_values, values, "values")
    _check_tokens("returns", returns, values, "values")

    target, old = returns.detach().to(values.dtype), old_values.detach().to(values.dtype)
    _check_finite(returns=target, **({} if clip_eps is None else {"old_values": old}))

    unclipped = (values - target).square()
    if clip_eps is None:
        per_token, clipped_taken = unclipped, torch.zeros_like(unclipped)
    else:
        clipped = (old + (values - old).clamp(-clip_eps, clip_eps) - target).square()
        per_token, clipped_taken = torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)
    loss, normalizer, mask = _reduce(0.5 * per_token, cu_seqlens, loss_mask, normalization, reduction,
                                     sequence_loss_tokens, counts_sequence)
    return loss, {"clip_fraction": _masked_mean(clipped_taken, mask), "normalizer": normalizer}


def sft_loss(
    logprobs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    normalization: str = "token",
    reduction: str = "mean",
    sequence_loss_tokens: torch.Tensor | None = None,
    counts_sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the targets: per token ``-logprobs``.

    Args and normalisation as in :func:`ppo_clip_loss`. Returns ``(loss scalar, metrics)``;
    metrics: ``normalizer`` (int64 loss tokens or loss sequences).
    """
    _check_logprobs(logprobs)
    loss, normalizer, _ = _reduce(-logprobs, cu_seqlens, loss_mask, normalization, reduction,
                                  sequence_loss_tokens, counts_sequence)
    return loss, {"normalizer": normalizer}

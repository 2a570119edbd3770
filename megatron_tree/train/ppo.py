"""PPO in the launcher (``train.loss: ppo``): every model pass of an RL step on the same micro-batches.

Per mini-batch of a rollout batch (``train.ppo_mini_batches``; 1: the whole batch), before the rollout
batch's first update (:func:`ppo_targets`, steps 1-3), then once per epoch (``train.ppo_epochs``,
:func:`ppo_update`, step 4), on this rank's micro-batches (prefix trees, or with ``tree_training: false`` each
sequence its own chain; the numbers agree):

1. forward only (:func:`~megatron_tree.mcore.forward_only.tree_forward_only`): the actor's log-probs
   (the old policy), the reference model's, the critic's per-token values and the reward
   model's per-sequence scores;
2. per-token rewards on each sequence's loss tokens: ``-kl_coef * (old - ref)`` (a KL penalty
   to the reference), plus the sequence's score at its last loss token;
3. GAE over each sequence's loss tokens (:func:`gae`): advantages, returns = advantages + values;
4. the actor's and the critic's backward passes (PPO-clip on the advantages, clipped value loss on
   the returns), then, when both losses and gradient norms are finite, one optimizer step each (the
   launcher's ``may_update`` decides otherwise: stop the run, or skip both updates).

Models (:func:`build_ppo_models`): the reference is a frozen copy of the actor as the run starts;
the critic and the reward model are value-head models (``build_tree_model(value_head=True)``),
the critic from the actor's checkpoint, the reward model from ``train.reward_model`` or, without
one, the actor's checkpoint with a fixed-seed value head (a deterministic stand-in reward).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_tree.ops.losses import ppo_clip_loss, value_loss


@dataclasses.dataclass
class PPOModels:
    """What PPO adds to the actor: ``reference`` / ``reward`` model chunks (forward only), the
    ``critic`` chunks (DDP) and its optimizer; ``reward_hf_config`` the reward model's HF text config (the critic's
    and the reference's are the actor's)."""

    reference: list[torch.nn.Module]
    critic: list[torch.nn.Module]
    critic_optimizer: Any
    reward: list[torch.nn.Module]
    reward_hf_config: Any


def build_ppo_models(
    cfg, path: str, load: bool, actor: list[torch.nn.Module], make_optimizer, *, tree: bool
) -> PPOModels:
    """Build the reference (a copy of ``actor``'s current weights), critic (+ optimizer from
    ``make_optimizer(chunks)``) and reward model for the run ``cfg`` from the HF checkpoint ``path``;
    tree models, or with ``tree=False`` upstream ones (the THD flat baseline)."""
    from megatron_tree.mcore.bridge import build_model

    t = cfg.train
    from megatron_tree.train.trainer import make_ddp_config, model_source_args

    common = dict(tree=tree, backend=t.attention_backend, bf16=t.bf16, recompute=t.recompute, **model_source_args(cfg))

    ddp = make_ddp_config(cfg.parallel)  # the actor's: distributed optimizer, overlapped communication
    _, reference = build_model(path, load_weights=False, wrap_with_ddp=False, **common)
    with torch.no_grad():
        for ref_chunk, chunk in zip(reference, actor):
            for ref_param, param in zip(ref_chunk.parameters(), chunk.parameters(), strict=True):
                ref_param.copy_(param)
            ref_chunk.requires_grad_(False)
    _, critic = build_model(path, load_weights=load, value_head=True, wrap_with_ddp=True, ddp_config=ddp,
                                 **common)  # fmt: skip
    reward_path = t.reward_model or path
    reward_bridge, reward = build_model(reward_path, load_weights=load or bool(t.reward_model), value_head=True,
                                        wrap_with_ddp=False, **common)  # fmt: skip
    for chunk in reward:
        chunk.requires_grad_(False)
    return PPOModels(reference=reference, critic=critic, critic_optimizer=make_optimizer(critic), reward=reward,
                     reward_hf_config=reward_bridge.hf_config.get_text_config())


def gae(
    rewards: torch.Tensor, values: torch.Tensor, lengths: list[int], *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over concatenated trajectories.

    ``rewards``, ``values``: [M] float, trajectory k at ``sum(lengths[:k]) + [0, lengths[k])``
    (one entry per step; the value after a trajectory's last step is 0). Returns
    ``(advantages [M], returns [M])`` in ``values``' dtype with ``A_t = sum_j (gamma lam)^j delta_{t+j}``,
    ``delta_t = r_t + gamma V_{t+1} - V_t`` and returns ``A + V``; computed in fp64 by
    :func:`discounted_suffix_sum` (a few dozen vector ops for any trajectory length, not one per step).
    """
    n, width = len(lengths), max(lengths, default=0)
    lens = torch.tensor(lengths, device=values.device)
    valid = torch.arange(width, device=values.device)[None] < lens[:, None]  # [n, width]
    r = values.new_zeros(n, width, dtype=torch.float64).masked_scatter_(valid, rewards.to(torch.float64))
    v = values.new_zeros(n, width, dtype=torch.float64).masked_scatter_(valid, values.to(torch.float64))
    delta = r + gamma * torch.cat([v[:, 1:], v.new_zeros(n, 1)], 1) - v  # 0 past each trajectory's end
    advantages = discounted_suffix_sum(delta, gamma * lam)
    return advantages[valid].to(values.dtype), (advantages + v)[valid].to(values.dtype)


def discounted_suffix_sum(x: torch.Tensor, discount: float, block: int = 64) -> torch.Tensor:
    """``y[:, t] = sum_{j >= t} discount ** (j - t) * x[:, j]`` for ``x [n, W]`` (``discount`` in [0, 1]).

    Blocked: within each block of ``block`` steps one matmul with the ``[block, block]`` matrix of powers gives the
    block-local sums; the sums at the block starts are the same recurrence over ``W / block`` blocks with
    ``discount ** block`` (solved the same way, recursively), and each step adds its block's carry times
    ``discount ** (steps to the block's end)``. Use fp64 ``x`` (an fp32 matmul may run in TF32 on a GPU). A NaN / inf
    in a row may make any of that row's sums non-finite, not only those up to it (0 times it is NaN in the matmuls);
    other rows are unaffected, and a PPO loss over the row is non-finite either way (the launcher stops or skips
    that step)."""
    n, width = x.shape
    if width == 0:
        return x.clone()
    size = min(block, width)
    blocks = -(-width // size)
    steps = torch.arange(size, device=x.device)
    gap = steps[None, :] - steps[:, None]  # [t, j] = j - t
    base = torch.tensor(discount, dtype=x.dtype, device=x.device)
    powers = torch.where(gap >= 0, base ** gap.clamp(min=0), 0)  # [t, j] = discount^(j - t) for j >= t
    local = torch.nn.functional.pad(x, (0, blocks * size - width)).view(n, blocks, size) @ powers.T
    if blocks > 1:
        starts = discounted_suffix_sum(local[:, :, 0], discount**size, block)  # y at each block's first step
        carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # y at the next block's first step (0 past the end)
        local = local + carry[:, :, None] * base ** (size - steps)
    return local.reshape(n, blocks * size)[:, :width]


def timed(times: dict[str, float], name: str, device: torch.device, fn: Callable[[], Any]) -> Any:
    """``fn()``, its wall seconds in ``times[f"pass_{name}_s"]`` (on a GPU, synchronised before and after: the
    pass's own kernels, none of the one before)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    times[f"pass_{name}_s"] = time.perf_counter() - t0
    return out


@dataclasses.dataclass
class PPOTargets:
    """What the updates of one mini-batch train towards, computed before its rollout batch's first update; per
    sequence of this rank's share (``mb.sequence_ids`` order), on the model's device: ``old`` log-probs,
    ``old_values``, ``advantages``, ``returns`` (fp32 [L - 1]) and ``masks`` (bool [L - 1]); ``stats``: the
    mini-batch's ``score_mean`` and ``kl_mean`` (the same on every rank); ``times``: this rank's seconds per
    forward-only pass (``pass_old_s``, ``pass_reference_s``, ``pass_values_s``, ``pass_scores_s``)."""

    old: list[torch.Tensor]
    old_values: list[torch.Tensor]
    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]
    masks: list[torch.Tensor]
    stats: dict[str, float]
    times: dict[str, float]


def ppo_targets(cfg, actor, models: PPOModels, mbs, loss_masks: list[np.ndarray] | None, *, tree: bool) -> PPOTargets:
    """The forward-only passes of a PPO mini-batch on this rank's micro-batches ``mbs`` (their ``sequence_ids``
    index this rank's sequences): the actor's log-probs (old policy), the reference's, the critic's values, the
    reward model's scores; then the rewards and GAE. ``loss_masks``: per sequence bool [L] aligned with its tokens
    (entry 0 unused), or None for all tokens; ``tree=False``: upstream models on THD-packed flat micro-batches."""
    from megatron.core import parallel_state as ps

    from megatron_tree.mcore.forward_only import flat_forward_only, tree_forward_only

    t = cfg.train
    forward_only = tree_forward_only if tree else flat_forward_only
    device = next(actor[0].parameters()).device
    times: dict[str, float] = {}
    old = timed(times, "old", device, lambda: forward_only(actor, mbs))
    ref = timed(times, "reference", device, lambda: forward_only(models.reference, mbs))
    old_values = timed(times, "values", device, lambda: forward_only(models.critic, mbs, head="values"))
    scores = timed(times, "scores", device, lambda: forward_only(models.reward, mbs, head="scores"))

    masks = [torch.ones(lp.numel(), dtype=torch.bool) if loss_masks is None else torch.from_numpy(loss_masks[k][1:])
             for k, lp in enumerate(old)]  # fmt: skip
    lengths = [int(m.sum()) for m in masks]
    mask = torch.cat(masks).to(device) if masks else torch.zeros(0, dtype=torch.bool, device=device)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, device=device)  # noqa: E731
    kl = (cat(old) - cat(ref))[mask]
    rewards = -t.kl_coef * kl
    has_tokens = torch.tensor(lengths, device=device) > 0
    ends = torch.tensor(np.cumsum(lengths, dtype=np.int64) - 1, device=device)[has_tokens]
    rewards[ends] += scores[has_tokens].to(rewards)
    adv_c, ret_c = gae(rewards, cat(old_values)[mask], lengths, gamma=t.gamma, lam=t.lam)
    splits = [lp.numel() for lp in old]
    advantages = torch.zeros_like(mask, dtype=torch.float32).masked_scatter_(mask, adv_c).split(splits)
    returns = torch.zeros_like(mask, dtype=torch.float32).masked_scatter_(mask, ret_c).split(splits)
    # Per-sequence statistics over the data-parallel group (identical on TP / PP ranks).
    stats = torch.tensor([float(scores.sum()), len(old), float(kl.sum()), kl.numel()], dtype=torch.float64,
                         device=device)  # fmt: skip
    dist.all_reduce(stats, group=ps.get_data_parallel_group())
    return PPOTargets(old=old, old_values=old_values, advantages=advantages, returns=returns,
                      masks=[m.to(device) for m in masks], times=times,
                      stats=dict(score_mean=float(stats[0] / stats[1].clamp(min=1)),
                                 kl_mean=float(stats[2] / stats[3].clamp(min=1))))


def ppo_update(
    cfg, actor, actor_optimizer, models: PPOModels, mbs, targets: PPOTargets, *, tree: bool,
    may_update: Callable[[str | None], bool],
) -> dict:
    """One PPO update on this rank's micro-batches ``mbs`` towards ``targets`` (:func:`ppo_targets`): the actor's
    and the critic's backward passes (PPO-clip, clipped value loss), then, when both losses and gradient norms are
    finite, one optimizer step each. ``may_update(problem)``: given
    :func:`~megatron_tree.train.trainer.nonfinite` of both models' losses and gradient norms, whether to run the
    two optimizer steps (it may raise instead). Returns the actor's ``loss``, ``loss_tokens``, ``grad_norm`` (None
    when ``skipped``), the PPO metrics (the same on every rank) and this rank's seconds of the two forward-backward
    passes (``pass_actor_s``, ``pass_critic_s``)."""
    from megatron_tree.mcore.schedule import flat_forward_backward, tree_forward_backward
    from megatron_tree.train.trainer import loss_and_grad_norm, nonfinite

    t, g = cfg.train, targets
    train_step = tree_forward_backward if tree else flat_forward_backward
    device = next(actor[0].parameters()).device

    def actor_loss(logprobs, mb):
        if not mb.sequence_ids:
            return logprobs.sum(), 0
        gather = mb.gather_targets  # a chunk holds parts of sequences
        loss, m = ppo_clip_loss(logprobs, gather(g.old), gather(g.advantages), mb.cu_targets,
                                loss_mask=gather(g.masks), clip_eps=t.clip_eps, reduction="sum")  # fmt: skip
        return loss, m["normalizer"]

    def critic_loss(values, mb):
        if not mb.sequence_ids:
            return values.sum(), 0
        gather = mb.gather_targets
        loss, m = value_loss(values, gather(g.old_values), gather(g.returns), mb.cu_targets,
                             loss_mask=gather(g.masks), clip_eps=t.value_clip, reduction="sum")  # fmt: skip
        return loss, m["normalizer"]

    # Both backward passes first (separate models and gradient buffers), so that a non-finite loss or
    # gradient in either is found before any weight changes.
    checked, times = {}, {}
    for name, chunks, optimizer, loss_fn, head in [
        ("actor", actor, actor_optimizer, actor_loss, "logprobs"),
        ("critic", models.critic, models.critic_optimizer, critic_loss, "values"),
    ]:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = timed(times, name, device, lambda: train_step(chunks, mbs, loss_fn, head=head))
        checked[name] = loss_and_grad_norm(losses, chunks, device)
    update = may_update(nonfinite({f"{name} loss": c[0] for name, c in checked.items()},
                                  {f"{name} gradient norm": c[2] for name, c in checked.items()}))
    norms = {name: optimizer.step()[1] if update else None
             for name, optimizer in (("actor", actor_optimizer), ("critic", models.critic_optimizer))}
    return dict(
        loss=checked["actor"][0],
        loss_tokens=checked["actor"][1],
        grad_norm=norms["actor"],
        skipped=not update,
        critic_loss=checked["critic"][0],
        critic_grad_norm=float(norms["critic"]) if norms["critic"] is not None else None,
        **g.stats,
        **times,
    )

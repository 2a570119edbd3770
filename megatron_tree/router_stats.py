"""MoE router statistics on tree micro-batches: every slot counts once per sequence through it.

Shape legend: T = slots of a micro-batch, n = its sequences, E = experts.

A slot of a tree micro-batch stands for ``mb.multiplicity[0, j]`` original tokens: the held
sequences whose root path passes through it. The flat reference of a micro-batch is its own
sequences, one row each, in one micro-batch, padding masked (``GPTModel(..., padding_mask=)``).
Megatron's router statistics of that reference are the tree's statistics with every slot
weighted by its multiplicity:

* ``aux_loss``, ``global_aux_loss``: tokens per expert and summed router probabilities weighted,
  token count = original tokens (Megatron's padding-mask formulas on the weighted sums);
* ``seq_aux_loss``: the same per sequence, summed along each sequence's root path;
* z-loss: the weighted mean of logsumexp(logits)^2;
* the per-expert token counts the router keeps for aux-loss-free balancing
  (``local_tokens_per_expert``, ``moe_router_enable_expert_bias``) and for ``global_aux_loss``.

Padding slots (multiplicity 0) count nowhere, nor does a micro-batch that holds no sequence
(with ``global_aux_loss`` over several data-parallel ranks it still joins the all-reduce and
counts as one of the step's micro-batches, as in upstream). The experts compute every slot once.
Megatron's losses depend on how sequences are grouped into micro-batches (per micro-batch
statistics; ``global_aux_loss`` mixes the step's running token counts with each micro-batch's
probabilities), so the tree step equals the flat step with the same grouping.

Wiring: :func:`tree_padding_mask` makes the ``padding_mask`` a tree micro-batch is run with
and records the micro-batch's multiplicities for it; Megatron hands that mask to every router,
in the forward and in activation recompute, on every pipeline stage; the router looks its
weights up by the mask's memory (weakly: they go when the mask does, after the backward).
:func:`weigh_router_statistics` binds the weighting to the routers of a built model (called by
:func:`megatron_tree.rope.enable_tree_rope`); the bound methods live in
:func:`megatron_tree.patches.megatron_core.weighted_router_statistics`.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.router import TopKRouter

from megatron_tree.microbatch import TreeMicroBatch

__all__ = ["SlotWeights", "tree_padding_mask", "weigh_router_statistics"]


@dataclass(frozen=True, kw_only=True)
class SlotWeights:
    """How many original tokens each slot of one micro-batch stands for, and whose they are.

      multiplicity   LongTensor [T]  sequences through each slot (0 = padding).
      subtree_end    IntTensor  [T]  the interval vector (``attention_mask[0]``).
      last_slots     LongTensor [n]  each sequence's last slot; sequence k is the root path to it.
      num_tokens     int             ``multiplicity.sum()``, on the host.
      num_sequences  int             n.
    """

    multiplicity: torch.Tensor
    subtree_end: torch.Tensor
    last_slots: torch.Tensor
    num_tokens: int
    num_sequences: int

    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, E] -> [n, E]``: row k sums ``x`` over sequence k's slots (its root path).

        Slot j is on the path of every slot in ``[j, subtree_end[j])``, so the path sum at
        slot s is ``cumsum(x - y)[s]`` with ``y[e]`` = the rows whose subtree ends at e: a
        running sum that never exceeds one path's total (fp64 for floats, int64 for counts;
        returned in ``x``'s dtype, ints as int64). Differentiable in ``x``.
        """
        work = torch.float64 if x.is_floating_point() else torch.int64
        rows = x.to(work)
        ended = torch.zeros((rows.shape[0] + 1, *rows.shape[1:]), dtype=work, device=rows.device)
        ended = ended.index_add(0, self.subtree_end, rows)
        path_sums = torch.cumsum(rows - ended[:-1], dim=0)
        return path_sums[self.last_slots].to(x.dtype if x.is_floating_point() else torch.int64)


# Weights of the padding masks in flight, keyed (weakly) on each mask's storage: the mask's
# views (transpose, reshape) and detached copies in activation recompute share it.
_WEIGHTS: "weakref.WeakKeyDictionary[torch.UntypedStorage, SlotWeights]" = weakref.WeakKeyDictionary()


def tree_padding_mask(mb: TreeMicroBatch) -> torch.Tensor:
    """``padding_mask`` for running ``mb`` through a tree MoE model: ``[1, T]`` bool, True on
    padding slots (Megatron's convention), on ``mb``'s device.

    ``model(mb.input_ids, mb.position_ids, mb.attention_mask, padding_mask=tree_padding_mask(mb))``
    then weighs each slot's router statistics by ``mb.multiplicity`` (module docstring);
    :func:`megatron_tree.schedule.tree_forward_step` does this for MoE models. Make one per
    forward call; it holds the weights until it is freed.
    """
    mask = mb.multiplicity == 0
    _WEIGHTS[mask.untyped_storage()] = SlotWeights(
        multiplicity=mb.multiplicity[0],
        subtree_end=mb.attention_mask[0],
        last_slots=mb.last_slots,
        num_tokens=mb.num_original_tokens,
        num_sequences=len(mb.sequence_ids),
    )
    return mask


def _slot_weights(padding_mask: torch.Tensor | None) -> SlotWeights | None:
    return None if padding_mask is None else _WEIGHTS.get(padding_mask.untyped_storage())


def _statistics(router: TopKRouter) -> list[str]:
    """The statistics ``router`` computes in training."""
    config = router.config
    on = ["load-balancing loss"] if router.is_aux_loss_enabled() else []
    if config.moe_z_loss_coeff is not None:
        on.append("z-loss")
    if config.moe_router_enable_expert_bias:
        on.append("expert-bias token counts")
    return on


def _check_supported(router: TopKRouter) -> None:
    config = router.config
    if config.moe_expert_capacity_factor is not None:
        raise ValueError(
            f"tree training cannot drop tokens by expert capacity (moe_expert_capacity_factor="
            f"{config.moe_expert_capacity_factor}): a shared slot stands for several sequences' tokens, "
            f"so it would be kept or dropped for all of them at once, unlike in the flat step; set "
            f"moe_expert_capacity_factor=None"
        )
    types = config.moe_router_load_balancing_type
    for kind in ("sinkhorn", "quantile_balancing"):
        if kind == types or (isinstance(types, list) and kind in types):
            raise ValueError(
                f"tree training does not support moe_router_load_balancing_type={types!r}: {kind} "
                f"routing balances over the micro-batch's tokens, which a tree holds once per slot; use "
                f"'aux_loss', 'seq_aux_loss', 'global_aux_loss' or 'none'"
            )
    if (config.sequence_parallel or config.context_parallel_size > 1) and _statistics(router):
        raise ValueError(
            f"tree MoE router statistics ({', '.join(_statistics(router))}) need sequence_parallel=False and "
            f"context_parallel_size=1 (got {config.sequence_parallel} / {config.context_parallel_size}): each rank's "
            f"router would see a slice of the slots and their weights; turn sequence / context parallel "
            f"off or the statistics off (moe_aux_loss_coeff=0 / moe_z_loss_coeff=None / "
            f"moe_router_enable_expert_bias=False)"
        )


def _require_weights(gpt: GPTModel, statistics: list[str]) -> None:
    """Refuse a training forward of a tree micro-batch whose padding mask carries no weights."""
    signature = inspect.signature(gpt.forward)

    def check(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return
        bound = signature.bind(*args, **kwargs).arguments
        mask = bound.get("attention_mask")
        tree = isinstance(mask, torch.Tensor) and mask.dtype in (torch.int32, torch.int64)
        if tree and _slot_weights(bound.get("padding_mask")) is None:
            raise ValueError(
                f"this tree model's MoE routers compute {', '.join(statistics)}, which must count each "
                f"slot once per sequence through it: pass padding_mask=megatron_tree.router_stats."
                f"tree_padding_mask(mb) with the micro-batch's tensors (tree_forward_step does)"
            )

    gpt.register_forward_pre_hook(check, with_kwargs=True)


def weigh_router_statistics(gpt: GPTModel) -> None:
    """Bind multiplicity weighting to every ``TopKRouter`` of ``gpt`` (idempotent; nothing else
    changes: without a :func:`tree_padding_mask` the routers behave as upstream's).

    Raises ValueError for what a tree cannot reproduce exactly: token dropping by expert
    capacity, sinkhorn / quantile-balancing routing, and router statistics under sequence
    parallel. When the routers compute statistics, training forwards of tree micro-batches
    (integer ``attention_mask``) must pass :func:`tree_padding_mask`.
    """
    from megatron_tree.patches.megatron_core import weighted_router_statistics

    routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
    new = False
    for router in routers:
        _check_supported(router)
        for patch in weighted_router_statistics(router, _slot_weights):
            patch.apply()
            new = True
    statistics = _statistics(routers[0]) if routers else []
    if new and statistics:
        _require_weights(gpt, statistics)

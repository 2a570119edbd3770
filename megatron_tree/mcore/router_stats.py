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

Sequence and context parallel: each rank routes part of the slots (a CP rank its shard, a
sequence-parallel rank an equal consecutive part of that) and weighs them with their own
multiplicities (:func:`rank_slot_weights`). Megatron's own reductions then make the whole micro-batch's
statistics: the per-expert counts (and per-sequence counts of ``seq_aux_loss``) are all-reduced over
TP x CP (``global_aux_loss``: TP x DP x CP), each rank's loss is its slots' share and the shares add up
to the single-rank loss, each rank's expert-bias counts are its share (summed over TP x DP x CP when
the bias is updated), and the logged values are shares that the logging reduces over TP x CP. Every
loss is attached with the micro-batch's token count, so the gradients equal those of the same step
without TP / CP (megatron-core's own scaling varies with TP / CP: 0.16 scales the z-loss by the rank's
tokens, 0.19 every loss by TP x CP times its count, NVIDIA/Megatron-LM#1652 and #5047).
No collective is added to the step; the z-loss, which upstream logs per rank (its own mean), is logged
as a share with the TP x CP reduce group (one more all-reduce where the logged values are reduced).

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
:func:`megatron_tree.mcore.rope.convert_to_tree_model`); the bound methods live in
:func:`weighted_router_statistics`.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter

from megatron_tree.core.context_parallel import ContextParallelShard
from megatron_tree.core.microbatch import TreeMicroBatch
from megatron_tree.core.patching import AttrPatch

__all__ = ["SlotWeights", "rank_slot_weights", "tree_padding_mask", "weigh_router_statistics"]


# TopKRouter methods wrapped by weighted_router_statistics, with the parameters they have had
# (after self) in megatron-core 0.16-0.19. routing() calls the others through self.
_ROUTER_METHODS = {
    "routing": ("logits", "padding_mask"),
    "apply_z_loss": ("logits", "padding_mask"),
    "_apply_aux_loss": ("probs", "scores_for_aux_loss", "routing_map", "with_padding_mask"),
    "_apply_seq_aux_loss": ("probs", "scores_for_aux_loss", "routing_map", "seq_length", "bsz", "with_padding_mask"),
    "_apply_global_aux_loss": ("probs", "scores_for_aux_loss", "routing_map", "with_padding_mask"),
    "_apply_expert_bias": ("routing_map", "padding_mask"),
}


class _WeightedRouterStatistics:
    """The wrapped statistics methods of one router. ``weights`` is what ``slot_weights``
    returned for the routing call in progress, cut to the slots this rank routes (None outside
    one, or for upstream behaviour)."""

    def __init__(self, router, slot_weights):
        self.router = router
        self.slot_weights = slot_weights
        names = (*_ROUTER_METHODS, "attach_and_log_load_balancing_loss")
        self.upstream = {name: getattr(router, name) for name in names}
        self.weights = None

    def routing(self, logits, padding_mask=None):
        weights = self.slot_weights(padding_mask)
        if weights is None:
            return self.upstream["routing"](logits, padding_mask=padding_mask)
        seq, b = logits.shape[:2]
        r = self.router
        sp = (r.tp_group.rank(), r.tp_group.size()) if r.config.sequence_parallel else (0, 1)
        self.weights = weights = rank_slot_weights(weights, seq * b, *sp)
        try:
            # Upstream gets this rank's own padding mask (on later pipeline stages megatron-core hands
            # every sequence-parallel rank the whole micro-batch's).
            return self.upstream["routing"](logits, padding_mask=(weights.multiplicity == 0).view(seq, b))
        finally:
            self.weights = None

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, *args, **kwargs):
        w = self.weights
        if w is None:
            return self.upstream["attach_and_log_load_balancing_loss"](
                activation, aux_loss_coeff, aux_loss, aux_loss_name, *args, **kwargs
            )
        # Upstream logs the loss (detached, with count 0 it attaches nothing); attached here, scaled by
        # upstream's count: its reduce group's tokens (the per-expert counts it sums them from are
        # all-reduced in place), i.e. the micro-batch's whatever the TP / CP split, as at TP = CP = 1.
        # megatron-core 0.19 multiplies that by the TP x CP size on top (exact only for a count of
        # this rank's tokens: a padding mask makes it the group's).
        count = kwargs.pop("valid_token_count")
        activation = self.upstream["attach_and_log_load_balancing_loss"](
            activation, aux_loss_coeff, aux_loss.detach(), aux_loss_name, *args, valid_token_count=0, **kwargs
        )
        if self.router.calculate_per_token_loss:
            aux_loss = aux_loss * count
        return MoEAuxLossAutoScaler.apply(activation, aux_loss)

    def apply_z_loss(self, logits, padding_mask=None):
        w, r = self.weights, self.router
        if w is None or r.config.moe_z_loss_coeff is None or not (r.training and torch.is_grad_enabled()):
            return self.upstream["apply_z_loss"](logits, padding_mask=padding_mask)
        # The micro-batch's mean of logsumexp^2 over its original tokens (each slot counted multiplicity
        # times): this rank adds its slots' share; the TP x CP ranks' shares sum to it (logged with that
        # reduce group; upstream logs each rank's own mean).
        coeff = r.config.moe_z_loss_coeff
        z_loss = coeff * (torch.logsumexp(logits, dim=-1).square() * w.multiplicity).sum() / max(w.num_tokens, 1)
        group = r.tp_cp_group if r.tp_cp_group.size() > 1 else None
        return self.attach_and_log_load_balancing_loss(
            logits, coeff, z_loss, "z_loss", group, valid_token_count=w.num_tokens
        )

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        w = self.weights
        if w is None:
            return self.upstream["_apply_aux_loss"](probs, scores_for_aux_loss, routing_map, with_padding_mask)
        if w.num_tokens == 0:  # a micro-batch that holds no sequence adds nothing
            return probs
        m = w.multiplicity[:, None]
        # Upstream's padding-mask path counts the tokens from the (here weighted) routing map.
        return self.upstream["_apply_aux_loss"](probs, scores_for_aux_loss * m, routing_map * m, True)

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False):
        w = self.weights
        if w is None:
            return self.upstream["_apply_seq_aux_loss"](
                probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask
            )
        if w.num_tokens == 0:
            return probs
        # Upstream folds a [seq_length, bsz] batch into per-row sums; hand it those sums
        # directly: one "position" whose bsz = n rows are the sequences' path sums.
        per_seq_scores, per_seq_map = w.per_sequence(scores_for_aux_loss), w.per_sequence(routing_map)
        return self.upstream["_apply_seq_aux_loss"](probs, per_seq_scores, per_seq_map, 1, w.num_sequences, True)

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        w = self.weights
        if w is None:
            return self.upstream["_apply_global_aux_loss"](probs, scores_for_aux_loss, routing_map, with_padding_mask)
        if w.num_tokens == 0 and self.router.tp_dp_cp_group.size() == 1:
            return probs
        m = w.multiplicity[:, None]
        out = self.upstream["_apply_global_aux_loss"](probs, scores_for_aux_loss * m, routing_map * m, True)
        # A micro-batch with no sequence on this rank still joins the all-reduce of the counts
        # but adds no gradient (its loss is 0/0 where no rank holds a token at this position).
        return probs if w.num_tokens == 0 else out

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        w = self.weights
        if w is None:
            return self.upstream["_apply_expert_bias"](routing_map, padding_mask=padding_mask)
        return self.upstream["_apply_expert_bias"](routing_map * w.multiplicity[:, None], padding_mask=None)


def weighted_router_statistics(router, slot_weights) -> list[AttrPatch]:
    """Patches that make ``router`` (a megatron-core ``TopKRouter``) count token t as
    ``multiplicity[t]`` tokens in its training statistics; apply them to bind the wrappers to
    this instance for its whole life (nothing is patched on the class). Empty if already bound.

    ``slot_weights(padding_mask)`` is called once per ``routing`` call with its ``padding_mask``
    (``[S, b]`` bool or None) and returns None (upstream behaviour) or an object with
      multiplicity   LongTensor [S*b]  original tokens each routed token stands for (0 = none);
      num_tokens     int               their sum (host side);
      num_sequences  int               n;
      per_sequence(x [S*b, E]) -> [n, E]  sums of x over each sequence's tokens (ints stay ints).
    Weighted: ``aux_loss`` and ``global_aux_loss`` (tokens per expert, summed probabilities,
    token count), ``seq_aux_loss`` (the same per sequence), z-loss (weighted mean) and the
    expert-bias token counts (``local_tokens_per_expert``). The aux losses stay upstream's
    code, fed the weighted statistics through its padding-mask path (token count = the
    weighted routing map's sum / topk).

    Needed by tree training, whose slots stand for several sequences' tokens. Written for
    megatron-core 0.16-0.19 (the wrapped methods kept their parameters there); raises
    RuntimeError naming the method where the installed version differs.
    """
    import inspect

    from megatron.core import package_info

    if isinstance(getattr(router.routing, "__self__", None), _WeightedRouterStatistics):
        return []
    for name, params in _ROUTER_METHODS.items():
        got = tuple(inspect.signature(getattr(router, name)).parameters)
        if got != params:
            raise RuntimeError(
                f"megatron-core {package_info.__version__}: TopKRouter.{name} takes {got}, expected "
                f"{params}; weighted router statistics (tree training with MoE) support megatron-core 0.16-0.19"
            )
    attach = tuple(inspect.signature(router.attach_and_log_load_balancing_loss).parameters)
    if attach[:5] != ("activation", "aux_loss_coeff", "aux_loss", "aux_loss_name", "reduce_group") or (
        "valid_token_count" not in attach
    ):
        raise RuntimeError(
            f"megatron-core {package_info.__version__}: TopKRouter.attach_and_log_load_balancing_loss takes "
            f"{attach}; weighted router statistics (tree training with MoE) support megatron-core 0.16-0.19"
        )
    wrapped = _WeightedRouterStatistics(router, slot_weights)
    why = "tree training: router statistics count each slot once per sequence through it"
    names = (*_ROUTER_METHODS, "attach_and_log_load_balancing_loss")
    return [AttrPatch(router, name, getattr(wrapped, name), why) for name in names]



@dataclass(frozen=True, kw_only=True)
class SlotWeights:
    """How many original tokens the slots a rank holds stand for, and whose they are: all T slots of
    one micro-batch, or a context-parallel rank's shard of them, or a sequence-parallel rank's part.

      multiplicity   LongTensor [s]         sequences through each held slot (0 = padding).
      slots          LongTensor [s] | None  the micro-batch slot of each held slot (None: all T, in order).
      subtree_end    IntTensor  [T]         the micro-batch's interval vector.
      last_slots     LongTensor [n]         each sequence's last slot; sequence k is the root path to it.
      num_tokens     int                    the micro-batch's original tokens (all ranks), on the host.
      num_sequences  int                    n.
    """

    multiplicity: torch.Tensor
    slots: torch.Tensor | None = None
    subtree_end: torch.Tensor
    last_slots: torch.Tensor
    num_tokens: int
    num_sequences: int

    def rows(self, start: int, stop: int) -> "SlotWeights":
        """The weights of held slots ``[start, stop)`` (a sequence-parallel rank's part)."""
        if self.slots is None:
            held = torch.arange(start, stop, device=self.multiplicity.device)
        else:
            held = self.slots[start:stop]
        return dataclasses.replace(self, multiplicity=self.multiplicity[start:stop], slots=held)

    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, E] -> [n, E]``: row k sums ``x`` over sequence k's held slots (its root path's, where all
        are held; summed over the ranks that hold the micro-batch's slots, the whole path's).

        Slot j is on the path of every slot in ``[j, subtree_end[j])``, so the path sum at
        slot i is ``cumsum(x - y)[i]`` with ``y[e]`` = the rows whose subtree ends at e: a
        running sum that never exceeds one path's total (fp64 for floats, int64 for counts;
        returned in ``x``'s dtype, ints as int64). Differentiable in ``x``.
        """
        work = torch.float64 if x.is_floating_point() else torch.int64
        rows = x.to(work)
        if self.slots is not None:  # held slots into their micro-batch places, zeros elsewhere
            rows = rows.new_zeros((self.subtree_end.shape[0], *rows.shape[1:])).index_put((self.slots,), rows)
        ended = torch.zeros((rows.shape[0] + 1, *rows.shape[1:]), dtype=work, device=rows.device)
        ended = ended.index_add(0, self.subtree_end, rows)
        path_sums = torch.cumsum(rows - ended[:-1], dim=0)
        return path_sums[self.last_slots].to(x.dtype if x.is_floating_point() else torch.int64)


def rank_slot_weights(weights: SlotWeights, tokens: int, sp_rank: int = 0, sp_size: int = 1) -> SlotWeights:
    """The part of ``weights`` that a router routing ``tokens`` tokens holds: all of them, or, under
    sequence parallel over ``sp_size`` ranks (megatron-core splits the slots into equal consecutive
    parts, in tensor-parallel rank order), rank ``sp_rank``'s part. ValueError when neither fits."""
    held = weights.multiplicity.shape[0]
    if held == tokens:
        return weights
    if sp_size > 1 and held == tokens * sp_size:
        return weights.rows(sp_rank * tokens, (sp_rank + 1) * tokens)
    raise ValueError(
        f"the router got {tokens} tokens but its padding mask stands for {held} slots"
        f"{f' (sequence parallel over {sp_size} ranks would give each {held / sp_size:g})' if sp_size > 1 else ''}; "
        f"pass the padding mask of the micro-batch (or context-parallel shard) the model runs"
    )


# Weights of the padding masks in flight, keyed (weakly) on each mask's storage: the mask's
# views (transpose, reshape, a sequence-parallel rank's part of a [1, T] mask) and detached copies in
# activation recompute share it.
_WEIGHTS: "weakref.WeakKeyDictionary[torch.UntypedStorage, SlotWeights]" = weakref.WeakKeyDictionary()


def tree_padding_mask(mb: TreeMicroBatch, shard: ContextParallelShard | None = None) -> torch.Tensor:
    """``padding_mask`` for running ``mb`` (or, under context parallel, this rank's ``shard`` of it)
    through a tree MoE model: ``[1, T]`` (``[1, s]``) bool, True on padding slots (Megatron's
    convention), on ``mb``'s (``shard``'s) device.

    ``model(mb.input_ids, mb.position_ids, mb.attention_mask, padding_mask=tree_padding_mask(mb))``
    then weighs each slot's router statistics by ``mb.multiplicity`` (module docstring);
    :func:`megatron_tree.mcore.schedule.tree_forward_step` does this for MoE models. Make one per
    forward call; it holds the weights until it is freed.
    """
    common = dict(
        subtree_end=mb.attention_mask[0],
        last_slots=mb.last_slots,
        num_tokens=mb.num_original_tokens,
        num_sequences=len(mb.sequence_ids),
    )
    if shard is None:
        mask = mb.multiplicity == 0
        weights = SlotWeights(multiplicity=mb.multiplicity[0], **common)
    else:
        s = shard.num_slots
        mask = shard.multiplicity == 0
        slots = shard.attention_mask[0, shard.rank * s : (shard.rank + 1) * s].to(torch.int64)  # slot_order
        weights = SlotWeights(multiplicity=shard.multiplicity[0], slots=slots, **common)
    _WEIGHTS[mask.untyped_storage()] = weights
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


def _require_weights(gpt: GPTModel, statistics: list[str]) -> None:
    """Refuse a training forward of a tree micro-batch whose padding mask carries no weights."""
    signature = inspect.signature(gpt.forward)
    # a subclass's forward (the vision-language model's) passes GPTModel's keywords on through **kwargs
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def check(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return
        bound = signature.bind(*args, **kwargs).arguments
        bound = {**bound.pop(var_keyword, {}), **bound}
        mask = bound.get("attention_mask")
        tree = isinstance(mask, torch.Tensor) and mask.dtype in (torch.int32, torch.int64)
        if tree and _slot_weights(bound.get("padding_mask")) is None:
            raise ValueError(
                f"this tree model's MoE routers compute {', '.join(statistics)}, which must count each "
                f"slot once per sequence through it: pass padding_mask=megatron_tree.mcore.router_stats."
                f"tree_padding_mask(mb) with the micro-batch's tensors (tree_forward_step does)"
            )

    gpt.register_forward_pre_hook(check, with_kwargs=True)


def weigh_router_statistics(gpt: GPTModel) -> None:
    """Bind multiplicity weighting to every ``TopKRouter`` of ``gpt`` (idempotent; nothing else
    changes: without a :func:`tree_padding_mask` the routers behave as upstream's).

    Raises ValueError for what a tree cannot reproduce exactly: token dropping by expert
    capacity, sinkhorn / quantile-balancing routing.
    When the routers compute statistics, training forwards of tree micro-batches
    (integer ``attention_mask``) must pass :func:`tree_padding_mask`.
    """

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

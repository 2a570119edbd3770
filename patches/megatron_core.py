"""Patches for megatron-core internals (``megatron.core``), one function per problem.

Each function returns the :class:`~megatron_tree.patches._attr.AttrPatch` list its problem needs in
this process (empty when the installed version or hardware does not have the problem);
nothing is applied here. Entry points: :func:`megatron_tree.patches.apply_compat_patches` (the
lasting fixes) and :func:`megatron_tree.testing.cpu_mode` (the CPU pieces).
"""

from __future__ import annotations

import torch

from ._attr import AttrPatch


def moe_te_general_gemm() -> list[AttrPatch]:
    """Define ``moe_utils.te_general_gemm = None`` when Transformer Engine is absent.

    Needed by megatron-core 0.16.x without Transformer Engine: ``moe/moe_utils.py`` imports
    ``te_general_gemm`` only inside its ``try: import transformer_engine`` block but the
    router GEMM (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None``
    unconditionally, so every MoE forward raises ``NameError``. ``None`` selects the
    plain-PyTorch path that is already there. No-op where the name is defined.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return []
    return [
        AttrPatch(moe_utils, "te_general_gemm", None, "megatron-core without TE: router GEMM NameError")
    ]


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
    returned for the routing call in progress (None outside one, or for upstream behaviour)."""

    def __init__(self, router, slot_weights):
        self.router = router
        self.slot_weights = slot_weights
        self.upstream = {name: getattr(router, name) for name in _ROUTER_METHODS}
        self.weights = None

    def routing(self, logits, padding_mask=None):
        weights = self.slot_weights(padding_mask)
        tokens = logits.shape[0] * logits.shape[1]
        if weights is not None and weights.multiplicity.shape[0] != tokens and self.router.config.sequence_parallel:
            # This rank routes its sequence-parallel slice of the slots. Binding refused routers
            # with statistics under sequence parallel, so there is nothing to weigh.
            weights = None
        if weights is not None and weights.multiplicity.shape[0] != tokens:
            raise ValueError(
                f"the router got {tokens} tokens but its padding mask stands for a micro-batch of "
                f"{weights.multiplicity.shape[0]} slots (sequence parallel splits the slots over tensor-"
                f"parallel ranks); weighted router statistics need sequence_parallel=False"
            )
        self.weights = weights
        try:
            return self.upstream["routing"](logits, padding_mask=padding_mask)
        finally:
            self.weights = None

    def apply_z_loss(self, logits, padding_mask=None):
        w, r = self.weights, self.router
        if w is None or r.config.moe_z_loss_coeff is None or not (r.training and torch.is_grad_enabled()):
            return self.upstream["apply_z_loss"](logits, padding_mask=padding_mask)
        # Upstream's z-loss (mean of logsumexp^2 over tokens, coefficient split over TP x CP),
        # each token counted multiplicity times; attached and logged through the router's own
        # method, whose per-token-loss scaling is upstream z-loss's in every version.
        coeff = r.config.moe_z_loss_coeff / r.tp_cp_group.size()
        z_loss = coeff * (torch.logsumexp(logits, dim=-1).square() * w.multiplicity).sum() / max(w.num_tokens, 1)
        return r.attach_and_log_load_balancing_loss(logits, coeff, z_loss, "z_loss", None, valid_token_count=w.num_tokens)

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
    return [AttrPatch(router, name, getattr(wrapped, name), why) for name in _ROUTER_METHODS]


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in for ``tensor_parallel.random._get_cuda_rng_state``: the CPU generator state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    """CPU stand-in for ``tensor_parallel.random._set_cuda_rng_state``: sets the CPU generator state."""
    torch.set_rng_state(new_state)


def cpu_rng_state() -> list[AttrPatch]:
    """Route megatron-core's private CUDA RNG-state helpers to the CPU generator (no CUDA only).

    Needed on machines without CUDA, every megatron-core version up to at least 0.19:
    the RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``)
    and activation recompute save/restore state through
    ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which index
    ``torch.cuda.default_generators``. On CPU, dropout and init draw from the CPU generator,
    so tracking that generator keeps the tracker's fork/restore semantics.
    """
    if torch.cuda.is_available():
        return []
    from megatron.core.tensor_parallel import random as tp_random

    why = "no CUDA: RNG tracker state lives in the CPU generator"
    return [
        AttrPatch(tp_random, "_get_cuda_rng_state", _cpu_get_rng_state, why),
        AttrPatch(tp_random, "_set_cuda_rng_state", _cpu_set_rng_state, why),
    ]


def lasting_fixes() -> list[AttrPatch]:
    """Fixes of upstream bugs (a missing name) that this process needs and models rely on for
    their whole life: :func:`megatron_tree.patches.apply_compat_patches` applies them once and
    never reverts them."""
    return moe_te_general_gemm()

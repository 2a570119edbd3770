"""``TransformerConfig`` overrides for models that mbridge builds on this machine.

mbridge turns on fused CUDA kernels, sequence parallel and Transformer-Engine-only options
by default; these dictionaries (for ``bridge.set_extra_args(**...)``) turn off what the
machine at hand cannot run and set what tree training needs. :func:`tree_training_overrides`
combines them for a run; :func:`megatron_tree.bridge.build_tree_model` applies it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = ["cpu_transformer_overrides", "local_spec_overrides", "recompute_overrides", "tree_training_overrides"]


def local_spec_overrides() -> dict[str, Any]:
    """``TransformerConfig`` overrides for megatron-core's local (non-Transformer-Engine) spec on GPUs.

    Its torch norms refuse ``persist_layer_norm`` and sequence parallel, and gradient-
    accumulation fusion needs apex or TE; mbridge turns these on by default (sequence
    parallel whenever TP > 1). Empty when Transformer Engine is installed.
    """
    if importlib.util.find_spec("transformer_engine") is not None:
        return {}
    return {"persist_layer_norm": False, "sequence_parallel": False, "gradient_accumulation_fusion": False}


def recompute_overrides(mode: str) -> dict[str, Any]:
    """``TransformerConfig`` overrides for activation recompute ``mode``: "none", "full" (every
    layer, uniform) or "selective" (core attention)."""
    modes = {
        "none": {},
        "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    }
    if mode not in modes:
        raise ValueError(f"recompute mode must be one of {sorted(modes)}, got {mode!r}")
    return dict(modes[mode])


def tree_training_overrides(*, moe: bool, recompute: str = "none") -> dict[str, Any]:
    """``TransformerConfig`` overrides of a tree-training run built by mbridge on this machine.

    ``calculate_per_token_loss=True`` (tree and flat steps then normalise alike), the CPU
    overrides without CUDA, else the local-spec ones, and on GPUs MoE with the all-to-all
    dispatcher (variable micro-batch lengths), plus :func:`recompute_overrides`.
    """
    extra: dict[str, Any] = dict(calculate_per_token_loss=True)
    if not torch.cuda.is_available():
        extra.update(cpu_transformer_overrides(moe=moe))
    else:
        extra.update(local_spec_overrides())
        if moe:
            extra.update(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, variable_seq_lengths=True)
    extra.update(recompute_overrides(recompute))
    return extra


def cpu_transformer_overrides(moe: bool) -> dict[str, Any]:
    """``TransformerConfig`` overrides that make an mbridge-built model run on CPU (``bridge.set_extra_args(**...)``).

    Turns off every fused CUDA kernel (softmax, bias-activation, bias-dropout, RoPE,
    gradient-accumulation, persistent layer norm), initialises on CPU, and disables
    sequence parallel (the local, non-TE spec cannot do it). For MoE (``moe=True``) also
    uses the per-expert local MLPs instead of grouped GEMM, the ``allgather`` token
    dispatcher, and fixed sequence lengths.
    """
    overrides: dict[str, Any] = {
        "use_cpu_initialization": True,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "sequence_parallel": False,
    }
    if moe:
        overrides.update(
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            variable_seq_lengths=False,
        )
    return overrides

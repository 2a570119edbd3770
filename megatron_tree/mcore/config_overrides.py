"""``TransformerConfig`` overrides for models that mbridge builds on this machine.

mbridge turns on fused CUDA kernels, sequence parallel and Transformer-Engine-only options
by default; these dictionaries (for ``bridge.set_extra_args(**...)``) turn off what the
machine at hand cannot run and set what tree training needs. :func:`tree_training_overrides`
combines them for a run; :func:`megatron_tree.mcore.bridge.build_tree_model` applies it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from megatron_tree.core.platform import have_transformer_engine

__all__ = [
    "cpu_transformer_overrides",
    "local_spec_overrides",
    "recompute_overrides",
    "te_overrides",
    "tree_training_overrides",
]


def local_spec_overrides() -> dict[str, Any]:
    """``TransformerConfig`` overrides for megatron-core's local (non-Transformer-Engine) spec on GPUs.

    Its torch norms refuse ``persist_layer_norm`` and sequence parallel, and gradient-
    accumulation fusion needs apex or TE; mbridge turns these on by default (sequence
    parallel whenever TP > 1).
    """
    return {"persist_layer_norm": False, "sequence_parallel": False, "gradient_accumulation_fusion": False}


def te_overrides(*, moe: bool, wrap_with_ddp: bool) -> dict[str, Any]:
    """``TransformerConfig`` overrides for the Transformer Engine spec on GPUs: the fused paths
    Megatron's training scripts turn on by default, but one.

    Fused RoPE (TE's sbhd kernel takes the per-token table tree RoPE gathers, batch 1),
    bias-activation fusion (one compiled SwiGLU kernel each way instead of several), gradient-accumulation
    fusion when the model is wrapped in Megatron's DDP (it writes into ``param.main_grad``, which only DDP
    allocates) and apex's ``fused_weight_gradient_mlp_cuda`` is installed (megatron-core's output layer needs it);
    for MoE TE's grouped-GEMM experts (``TEGroupedMLP``, whose weights mbridge maps), the
    all-to-all dispatcher with fused permutation and variable micro-batch lengths. mbridge
    keeps sequence parallel on whenever TP > 1; the schedule pads micro-batches to a multiple
    of TP for it.

    Bias-dropout fusion stays off: megatron-core's fused bias-dropout-add is a ``torch.compile`` d function, and
    every call pays Dynamo's guards and AOT autograd's wrappers on the host (``benchmarks/bias_dropout_host.py`` on a
    CPU: 191 us a forward call against 23 us eager, 421 / 137 us forward + backward) for what the eager path also runs
    as one add kernel: the
    models mbridge builds have no output-projection biases (``add_bias_linear=False``) and RL training no hidden
    dropout (``F.dropout`` with p = 0 returns its input). A layer calls it twice (attention and MLP residuals), four
    times with full recompute, so a step of many small calls (micro-batches of a few thousand tokens, the chunks of
    trees larger than a micro-batch) waits on the host for it.
    """
    extra: dict[str, Any] = dict(
        apply_rope_fusion=True,
        bias_activation_fusion=True,
        bias_dropout_fusion=False,
        # megatron-core's own linears (the output layer) need apex's CUDA extension for it.
        gradient_accumulation_fusion=wrap_with_ddp and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
    )
    if moe:
        extra.update(
            moe_grouped_gemm=True,
            moe_token_dispatcher_type="alltoall",
            moe_permute_fusion=True,
            variable_seq_lengths=True,
        )
    return extra


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


def tree_training_overrides(*, moe: bool, recompute: str = "none", wrap_with_ddp: bool = False) -> dict[str, Any]:
    """``TransformerConfig`` overrides of a tree-training run built by mbridge on this machine.

    ``calculate_per_token_loss=True`` (tree and flat steps then normalise alike); without CUDA
    :func:`cpu_transformer_overrides`; on GPUs with Transformer Engine :func:`te_overrides`,
    without it :func:`local_spec_overrides` and MoE with the all-to-all dispatcher (variable
    micro-batch lengths, per-expert MLPs: megatron-core >= 0.17 has no non-TE grouped MLP);
    plus :func:`recompute_overrides`. ``wrap_with_ddp``: the model will be wrapped in
    Megatron's DDP (allows gradient-accumulation fusion under TE).
    """
    extra: dict[str, Any] = dict(calculate_per_token_loss=True)
    if not torch.cuda.is_available():
        extra.update(cpu_transformer_overrides(moe=moe))
    elif have_transformer_engine():
        extra.update(te_overrides(moe=moe, wrap_with_ddp=wrap_with_ddp))
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
    dispatcher, fixed sequence lengths, and no shared-expert overlap.
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
            # megatron-core overlaps the shared expert only with alltoall (mbridge's Qwen2-MoE turns it on).
            moe_shared_expert_overlap=False,
        )
    return overrides

"""Decoder block spec of Gemma 3 text models: sandwich norms, qk-norm, and local layers with their own RoPE base.

Every layer is a :class:`~megatron_tree.mcore.sandwich_norm.SandwichNormTransformerLayer` (norms before and after
the attention and the MLP) with q / k norms; a local layer's attention is a
:class:`~megatron_tree.mcore.layer_rope.LayerRopeSelfAttention` rotating with the local base, a global layer's a
plain ``SelfAttention`` (the model's table). The sliding window is the config's (``window_size`` /
``window_attn_skip_freq``), read by the core attention.

- Transformer Engine: megatron-core's TE layer spec (input norm fused into ``linear_qkv``, pre-MLP norm into
  ``linear_fc1``, ``TENorm`` q / k norms) with ``TENorm`` output norms: the parameter names mbridge's TE tables and
  Megatron-Bridge use.
- Local (no TE): megatron-core's local layer spec with every norm :class:`~megatron_tree.mcore.rms_norm.RMSNorm`
  (Gemma's norms are zero-centred, ``x / rms * (1 + w)``, which megatron-core's local norm refuses).

Attention layers keep megatron-core's core attention here; :func:`megatron_tree.tree_layer_spec` swaps it for tree
attention in a tree model.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tree.mcore.layer_rope import LayerRopeSelfAttention
from megatron_tree.mcore.rms_norm import RMSNorm
from megatron_tree.mcore.sandwich_norm import sandwich_norm_layer
from megatron_tree.mcore.stage_layers import stage_layer_ids

__all__ = ["gemma3_block_spec"]


def _layer_spec(use_transformer_engine: bool) -> tuple[ModuleSpec, type]:
    """A global layer's spec and the norm class of this implementation."""
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm

        norm, base = TENorm, get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
        sub = base.submodules
    else:
        norm, base = RMSNorm, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        attn = base.submodules.self_attention
        attn = dataclasses.replace(
            attn, submodules=dataclasses.replace(attn.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm)
        )
        sub = dataclasses.replace(base.submodules, input_layernorm=RMSNorm, self_attention=attn,
                                  pre_mlp_layernorm=RMSNorm)
    return sandwich_norm_layer(dataclasses.replace(base, submodules=sub), norm), norm


def _local_rope(layer: ModuleSpec, rotary_base: float) -> ModuleSpec:
    attn = layer.submodules.self_attention
    attn = dataclasses.replace(attn, module=LayerRopeSelfAttention, params={**attn.params, "rotary_base": rotary_base})
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))


def gemma3_block_spec(
    config: TransformerConfig,
    *,
    local_rope: Sequence[bool],
    local_rotary_base: float,
    use_transformer_engine: bool,
    vp_stage: int | None = None,
) -> TransformerBlockSubmodules:
    """The decoder block spec (layers of this pipeline / virtual stage) of a Gemma 3 text model.

    ``local_rope``: per layer of the whole model, True where it rotates with ``local_rotary_base`` (Hugging Face's
    ``sliding_attention`` layers), False where with the model's RoPE (``full_attention``). ``config`` needs
    ``normalization="RMSNorm"``, ``qk_layernorm`` and ``layernorm_zero_centered_gamma``.
    """
    if len(local_rope) != config.num_layers:
        raise ValueError(f"local_rope has {len(local_rope)} entries for {config.num_layers} layers: give one per layer")
    problems = [f"{k}={getattr(config, k)!r}" for k, want in
                (("normalization", "RMSNorm"), ("qk_layernorm", True), ("layernorm_zero_centered_gamma", True))
                if getattr(config, k) != want]
    if problems:
        raise ValueError(f"gemma3_block_spec builds zero-centred RMSNorm layers with q / k norms, but the config has "
                         f"{', '.join(problems)}")
    layer, norm = _layer_spec(use_transformer_engine)
    specs = [_local_rope(layer, local_rotary_base) if local else layer for local in local_rope]
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in stage_layer_ids(config, vp_stage)],
                                      layer_norm=norm)

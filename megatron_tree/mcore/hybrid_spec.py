"""Decoder block specs of hybrid Gated DeltaNet / full-attention models (Qwen3-Next, Qwen3.5).

:func:`hybrid_block_spec` builds one layer spec per layer of this pipeline stage: a
:class:`~megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet` where ``config.linear_attention_freq`` marks
linear attention, else megatron-core's ``SelfAttention`` (output gate and q/k norms from the config); an MoE
where ``config.moe_layer_freq`` marks one, else a dense MLP.

- Transformer Engine: megatron-core's own hybrid spec
  (``get_transformer_block_with_experimental_attention_variant_spec``: TE linears with the input norm fused into
  ``linear_qkv`` / ``in_proj``, ``TENorm`` elsewhere) with its ``GatedDeltaNet`` swapped for ours: the
  parameter names mbridge's TE tables and Megatron-Bridge use.
- Local (no TE): the same layers from megatron-core's local modules, with separate ``input_layernorm`` /
  ``pre_mlp_layernorm`` and :class:`~megatron_tree.mcore.rms_norm.RMSNorm` for every norm (megatron-core's local
  norm refuses zero-centred gamma).

Attention layers keep megatron-core's core attention here; :func:`megatron_tree.tree_layer_spec` swaps it for
tree attention in a tree model.
"""

from __future__ import annotations

import dataclasses

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_tree.mcore.gated_delta_net import TreeGatedDeltaNet
from megatron_tree.mcore.rms_norm import RMSNorm
from megatron_tree.mcore.stage_layers import stage_layer_ids

__all__ = ["hybrid_block_spec", "linear_attention_pattern", "swap_gated_delta_net"]


def linear_attention_pattern(config: TransformerConfig) -> list[int]:
    """Per layer of the whole model: 1 = Gated DeltaNet, 0 = full attention (``config.linear_attention_freq``:
    an int N = every N-th layer full attention, or a list)."""
    freq = config.linear_attention_freq
    if isinstance(freq, int) and freq >= 1:
        return [0 if (i + 1) % freq == 0 else 1 for i in range(config.num_layers)]
    if isinstance(freq, list) and len(freq) == config.num_layers and set(freq) <= {0, 1}:
        return list(freq)
    raise ValueError(
        f"linear_attention_freq={freq!r}: give an int N >= 1 (every N-th layer is full attention) or a list of "
        f"{config.num_layers} entries, 1 = Gated DeltaNet and 0 = full attention"
    )


def _moe_pattern(config: TransformerConfig) -> list[int]:
    if config.num_moe_experts is None:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if len(freq) != config.num_layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {config.num_layers} layers: give one per layer")
    return list(freq)


def swap_gated_delta_net(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a layer's ``self_attention``) with megatron-core's ``GatedDeltaNet`` replaced by
    :class:`TreeGatedDeltaNet` (same submodules and parameters); any other spec unchanged."""
    if isinstance(spec, ModuleSpec) and spec.module is GatedDeltaNet:
        return dataclasses.replace(spec, module=TreeGatedDeltaNet)
    return spec


def _local_layer_specs(config: TransformerConfig) -> list[ModuleSpec]:
    gdn = ModuleSpec(
        module=TreeGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear),
    )
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=RMSNorm if config.qk_layernorm else None,
            k_layernorm=RMSNorm if config.qk_layernorm else None,
        ),
    )
    dense = get_mlp_module_spec(use_te=False, num_experts=None)
    moe = get_mlp_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False) \
        if config.num_moe_experts else None
    return [
        ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=RMSNorm,
                self_attention=gdn if linear else attention,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=RMSNorm,
                mlp=moe if is_moe else dense,
                mlp_bda=get_bias_dropout_add,
            ),
        )
        for linear, is_moe in zip(linear_attention_pattern(config), _moe_pattern(config))
    ]


def hybrid_block_spec(
    config: TransformerConfig, *, use_transformer_engine: bool, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """The decoder block spec (layers of this pipeline / virtual stage) of a hybrid Gated DeltaNet model.

    ``config`` needs ``experimental_attention_variant="gated_delta_net"``, ``linear_attention_freq`` and the
    ``linear_*`` head sizes; ``normalization="RMSNorm"``. ``use_transformer_engine`` picks the TE or the local
    spec (module docstring).
    """
    if config.experimental_attention_variant != "gated_delta_net":
        raise ValueError(
            f"hybrid_block_spec builds Gated DeltaNet hybrids, but the config has experimental_attention_variant="
            f"{config.experimental_attention_variant!r}; set it to 'gated_delta_net' with linear_attention_freq"
        )
    if config.normalization != "RMSNorm":
        raise ValueError(f"hybrid_block_spec builds RMSNorm models, got normalization={config.normalization!r}")
    linear_attention_pattern(config)  # validate before building anything
    if use_transformer_engine:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        block = get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
        layers = [
            dataclasses.replace(
                layer,
                submodules=dataclasses.replace(
                    layer.submodules, self_attention=swap_gated_delta_net(layer.submodules.self_attention)
                ),
            )
            for layer in block.layer_specs
        ]
        return dataclasses.replace(block, layer_specs=layers)
    specs = _local_layer_specs(config)
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in stage_layer_ids(config, vp_stage)],
                                      layer_norm=RMSNorm)

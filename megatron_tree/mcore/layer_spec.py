"""Turn an upstream GPT layer spec into a tree-attention one.

Only the self-attention's ``core_attention`` (-> :class:`~megatron_tree.attention.TreeCoreAttention`;
:class:`~megatron_tree.attention.TreeCoreAttentionTE` where it was Transformer Engine's)
and its ``attn_mask_type`` (-> ``AttnMaskType.arbitrary``; with the default causal type, the
stock fused softmax silently ignores a user mask) change; every other submodule — QKV/proj
linears, q/k norms, MLP or MoE, layer norms — is kept as the upstream spec built it.
Gated DeltaNet layers (hybrid models): megatron-core's ``GatedDeltaNet`` becomes
:class:`~megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet` (same submodules), ours stays.
"""

from __future__ import annotations

import dataclasses

from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, get_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_tree.attention import get_tree_attention_backend
from megatron_tree.mcore.core_attention import TreeCoreAttention, TreeCoreAttentionTE, check_tree_attention_config
from megatron_tree.mcore.gated_delta_net import TreeGatedDeltaNet, check_gated_delta_net_config
from megatron_tree.mcore.hybrid_spec import swap_gated_delta_net

__all__ = ["tree_layer_spec"]

# Self-attentions (and their subclasses, e.g. LayerRopeSelfAttention) whose core attention is swapped (multi-latent
# attention computes its own q / k / v, RoPE included, and hands them to core_attention like SelfAttention;
# megatron_tree.mcore.rope feeds its RoPE depths).
_CONVERTIBLE = {(SelfAttention, SelfAttentionSubmodules), (MLASelfAttention, MLASelfAttentionSubmodules)}


def _module_name(spec) -> str:
    module = get_module(spec) if isinstance(spec, ModuleSpec) else spec
    return getattr(module, "__qualname__", repr(module))


def _tree_core_attention(upstream) -> type[TreeCoreAttention]:
    """:class:`TreeCoreAttentionTE` in place of Transformer Engine's core attention (its checkpoints
    carry ``core_attention._extra_state``), :class:`TreeCoreAttention` elsewhere."""
    module = get_module(upstream) if isinstance(upstream, ModuleSpec) else upstream
    te = isinstance(module, type) and any(c.__name__ == "TEDotProductAttention" for c in module.__mro__)
    return TreeCoreAttentionTE if te else TreeCoreAttention


def _tree_layer(layer: ModuleSpec, index: int, backend: str) -> ModuleSpec:
    where = f"layer spec {index}"
    if not isinstance(layer, ModuleSpec) or not isinstance(
        layer.submodules, TransformerLayerSubmodules
    ):
        raise TypeError(
            f"{where}: expected a ModuleSpec of a TransformerLayer (submodules = "
            f"TransformerLayerSubmodules), got {type(layer).__name__} with submodules "
            f"{type(getattr(layer, 'submodules', None)).__name__}"
        )
    attn = layer.submodules.self_attention
    if isinstance(attn, ModuleSpec) and get_module(attn) in (GatedDeltaNet, TreeGatedDeltaNet):
        return dataclasses.replace(
            layer, submodules=dataclasses.replace(layer.submodules, self_attention=swap_gated_delta_net(attn))
        )
    if not (
        isinstance(attn, ModuleSpec)
        and isinstance(get_module(attn), type)
        and any(issubclass(get_module(attn), cls) and isinstance(attn.submodules, sub) for cls, sub in _CONVERTIBLE)
    ):
        raise ValueError(
            f"{where}: tree attention replaces the core attention of a standard SelfAttention or a "
            f"multi-latent MLASelfAttention (and runs Gated DeltaNet layers on the tree), but this layer's "
            f"self_attention is {_module_name(attn)} (other linear-attention, state-space and custom mixers cannot "
            f"be converted); use a model with standard, multi-latent or Gated DeltaNet token mixers"
        )
    tree_attn = dataclasses.replace(
        attn,
        params={**attn.params, "attn_mask_type": AttnMaskType.arbitrary},
        submodules=dataclasses.replace(
            attn.submodules,
            core_attention=ModuleSpec(module=_tree_core_attention(attn.submodules.core_attention), params={"backend": backend}),
        ),
    )
    return dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, self_attention=tree_attn)
    )


def tree_layer_spec(
    spec: ModuleSpec | TransformerBlockSubmodules,
    *,
    backend: str = "auto",
    config: TransformerConfig | None = None,
) -> ModuleSpec | TransformerBlockSubmodules:
    """The same spec with every layer's core attention replaced by tree attention.

    spec     a TransformerLayer ``ModuleSpec`` (``get_gpt_layer_local_spec`` /
             ``..._with_transformer_engine_spec``) or a ``TransformerBlockSubmodules``
             (``get_gpt_decoder_block_spec``, heterogeneous/MoE models).
    backend  name of a registered tree attention backend (``"auto"``, ``"dense"``, ``"flex"``).
    config   optional: also check the model config now (sliding window,
             softmax type, ...) instead of when the model is built.

    Gated DeltaNet layers get :class:`~megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet`. Raises (never
    skips) for a layer whose token mixer is none of ``SelfAttention``, multi-latent attention (``MLASelfAttention``)
    and Gated DeltaNet.
    The input spec is not modified.
    """
    get_tree_attention_backend(backend)
    if config is not None:
        check_tree_attention_config(config)
        if config.experimental_attention_variant == "gated_delta_net":
            check_gated_delta_net_config(config)
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(
            spec,
            layer_specs=[_tree_layer(layer, i, backend) for i, layer in enumerate(spec.layer_specs)],
        )
    return _tree_layer(spec, 0, backend)

"""tree_layer_spec: swaps only core_attention and attn_mask_type; refuses what it cannot convert."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tree.mcore.core_attention import TreeCoreAttention
from megatron_tree.mcore.layer_spec import tree_layer_spec




def config(**overrides) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, **overrides)


def assert_converted(before, after):
    attn_before = before.submodules.self_attention
    attn_after = after.submodules.self_attention
    assert attn_after.params["attn_mask_type"] == AttnMaskType.arbitrary
    assert attn_after.submodules.core_attention.module is TreeCoreAttention
    assert attn_after.submodules.core_attention.params == {"backend": "auto"}
    # Everything else is the upstream spec, untouched.
    assert attn_after.module is attn_before.module
    for field in dataclasses.fields(attn_before.submodules):
        if field.name != "core_attention":
            assert getattr(attn_after.submodules, field.name) is getattr(attn_before.submodules, field.name)
    for field in dataclasses.fields(before.submodules):
        if field.name != "self_attention":
            assert getattr(after.submodules, field.name) is getattr(before.submodules, field.name)
    assert after.module is before.module


def test_layer_spec_is_converted_and_input_untouched():
    spec = get_gpt_layer_local_spec(qk_layernorm=True)
    converted = tree_layer_spec(spec)
    assert_converted(spec, converted)
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert spec.submodules.self_attention.params["attn_mask_type"] == AttnMaskType.causal
    assert_converted(spec, tree_layer_spec(converted))  # idempotent


def test_block_spec_every_layer_converted(cpu_megatron):
    moe = config(num_moe_experts=4, moe_layer_freq=[1, 0])  # one MoE layer, one dense layer
    block = get_gpt_decoder_block_spec(moe, use_transformer_engine=False, normalization="RMSNorm")
    converted = tree_layer_spec(block)
    assert len(converted.layer_specs) == len(block.layer_specs) == 2
    for before, after in zip(block.layer_specs, converted.layer_specs):
        assert_converted(before, after)
    assert converted.layer_norm is block.layer_norm


def test_mla_core_attention_converted():
    """Multi-latent attention keeps its projections, norms and RoPE; only its core attention changes."""
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    assert_converted(spec, tree_layer_spec(spec))


def test_refuses_non_self_attention_layers():
    spec = get_gpt_layer_local_spec()
    no_attn = dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=IdentityOp)
    )
    with pytest.raises(ValueError, match="IdentityOp"):
        tree_layer_spec(no_attn)
    with pytest.raises(TypeError, match="TransformerLayer"):
        tree_layer_spec(spec.submodules.self_attention)


def test_refuses_unconvertible_configs():
    spec = get_gpt_layer_local_spec()
    with pytest.raises(ValueError, match="window_size"):
        tree_layer_spec(spec, config=config(window_size=(4, 1)))  # a right window; (4, 0) is a sliding window
    tree_layer_spec(spec, config=config(window_size=(4, 0)))
    with pytest.raises(ValueError, match="unknown tree attention backend"):
        tree_layer_spec(spec, backend="nope")


def test_te_core_attention_becomes_tree_attention_that_keeps_te_extra_state(cpu_megatron):
    """In place of TE's TEDotProductAttention (recognised by class name, so this runs without TE)
    the spec builds TreeCoreAttentionTE, whose state dict keeps TE's empty ``_extra_state``."""
    from megatron_tree.mcore.core_attention import TreeCoreAttentionTE

    class TEDotProductAttention(DotProductAttention):  # stands in for megatron's TE wrapper
        pass

    spec = get_gpt_layer_local_spec()
    te_spec = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(
            spec.submodules.self_attention, submodules=dataclasses.replace(
                spec.submodules.self_attention.submodules, core_attention=TEDotProductAttention))))
    assert tree_layer_spec(spec).submodules.self_attention.submodules.core_attention.module is TreeCoreAttention
    core = tree_layer_spec(te_spec).submodules.self_attention.submodules.core_attention
    assert core.module is TreeCoreAttentionTE
    attn = TreeCoreAttentionTE(config(), 1, AttnMaskType.arbitrary, "self")
    state = attn.state_dict()
    assert list(state) == ["_extra_state"] and state["_extra_state"].numel() == 0
    assert attn.sharded_state_dict() == {}  # as megatron-core's TEDotProductAttention
    # TE's FP8 scaling state (a non-empty pickled tensor) loads strictly and is dropped.
    attn.load_state_dict({"_extra_state": torch.ones(5, dtype=torch.uint8)}, strict=True)
    assert not TreeCoreAttention(config(), 1, AttnMaskType.arbitrary, "self").state_dict()

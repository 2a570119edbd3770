"""mbridge bridge of GLM-4V (``model_type="glm4v"``, HF ``Glm4vForConditionalGeneration``: GLM-4.1V) for tree
training, in place of mbridge 0.15.1's own (its own model class, Transformer Engine layers only).

The language model (``text_config``, weights under ``model.language_model.*`` and ``lm_head.*``) has GLM-4 layers, as
Hugging Face computes them (transformers 5):

- ``h = h + post_self_attn_norm(attn(input_norm(h)))``, then ``h = h + post_mlp_norm(mlp(post_attention_norm(h)))``:
  four RMSNorms per layer (:mod:`~megatron_tree.mcore.sandwich_norm`);
- q / k / v biases, none on the output projection; the MLP a SwiGLU with fused ``gate_up_proj`` (gate rows first:
  megatron-core's ``linear_fc1`` layout);
- RoPE on the first ``partial_rotary_factor`` of each head, channel pairs interleaved (``rotary_interleaved``), over
  (t, h, w) positions by ``mrope_section``
  (:class:`~megatron_tree.mcore.vision_language.InterleavedMultimodalRotaryEmbedding`). Its 3-D position rule (HF's
  ``get_rope_index`` for images) is Qwen2.5-VL's: ``pack_vision_trees`` computes it.

The vision tower is Hugging Face's ``Glm4vVisionModel`` under ``model.visual.*``
(:class:`~megatron_tree.mcore.bridges.vision_language.VisionLanguageBridge`). Images are the ``image_token_id`` runs
between ``image_start_token_id`` and ``image_end_token_id``; a sequence with ``video_start_token_id`` (GLM-4V's
video frames are image-token runs after it) is refused by ``pack_vision_trees``.

Refused: videos; pipeline, context and sequence parallel (at build). GLM-4.5V:
:mod:`~megatron_tree.mcore.bridges.glm4v_moe`.
"""

from __future__ import annotations

import dataclasses

import torch
from mbridge.models.qwen2 import Qwen2Bridge

from megatron_tree.core.platform import have_transformer_engine
from megatron_tree.mcore.bridges.vision_language import VisionLanguageBridge
from megatron_tree.mcore.sandwich_norm import sandwich_norm_layer

__all__ = ["Glm4VBridge"]

_LAYER = "model.layers.{layer_number}"


class Glm4VBridge(VisionLanguageBridge, Qwen2Bridge):
    """GLM-4V: see the module docstring."""

    video_marker = "video_start_token_id"
    _MLP_MAPPING = {
        **Qwen2Bridge._MLP_MAPPING,
        "mlp.linear_fc1.weight": [f"{_LAYER}.mlp.gate_up_proj.weight"],
        "post_mlp_layernorm.weight": [f"{_LAYER}.post_mlp_layernorm.weight"],
    }
    _OTHER_MAPPING = {"post_self_attn_layernorm.weight": [f"{_LAYER}.post_self_attn_layernorm.weight"]}

    def vision_tower(self) -> torch.nn.Module:
        from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

        return Glm4vVisionModel(self.multimodal_config.vision_config)

    def _build_config(self):
        config = super()._build_config()
        config.rotary_interleaved = True
        return config

    def _get_transformer_layer_spec(self, vp_stage: int | None = None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        self.has_vp_stage = True  # LLMBridge's model provider reads it
        block = get_gpt_decoder_block_spec(self.config, use_transformer_engine=have_transformer_engine(),
                                           normalization=self.config.normalization, vp_stage=vp_stage)
        return dataclasses.replace(block, layer_specs=[sandwich_norm_layer(layer, block.layer_norm)
                                                       for layer in block.layer_specs])

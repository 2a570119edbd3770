"""mbridge bridge of GLM-4.5V (``model_type="glm4v_moe"``, HF ``Glm4vMoeForConditionalGeneration``) for tree training,
in place of mbridge 0.15.1's own (its own model class, Transformer Engine layers only).

The language model (``text_config``: ``glm4v_moe_text``, weights under ``model.language_model.*`` and ``lm_head.*``) has
GLM-4.5's layers, as Hugging Face computes them (transformers 5): mbridge's GLM-4.5 bridge (``glm4_moe``, with the
compatibility fixes of its expert groups and shared-expert size) without qk-norm (``glm4v_moe_text`` has none):

- pre-norm layers, q / k / v biases; layer ``< first_k_dense_replace`` a dense SwiGLU MLP, the others a sigmoid router
  with a score-correction bias, group-limited top-k, ``norm_topk_prob`` and routed scaling, plus shared experts;
- RoPE on the first ``partial_rotary_factor`` of each head over (t, h, w) positions by ``mrope_section``, in halves
  (HF's ``rotate_half``: megatron-core's multimodal RoPE, not GLM-4.1V's interleaved pairs). Its 3-D position rule
  (HF's ``get_rope_index`` for images) is GLM-4V's: ``pack_vision_trees`` computes it.

The vision tower is Hugging Face's ``Glm4vMoeVisionModel`` under ``model.visual.*``
(:class:`~megatron_tree.mcore.bridges.vision_language.VisionLanguageBridge`); images and videos are marked as GLM-4V's.

Refused: videos; pipeline, context and sequence parallel (at build).
"""

from __future__ import annotations

import torch
from mbridge.models.glm4moe import GLM4MoEBridge

from megatron_tree.mcore.bridges.vision_language import VisionLanguageBridge

__all__ = ["Glm4VMoeBridge"]


class Glm4VMoeBridge(VisionLanguageBridge, GLM4MoEBridge):
    """GLM-4.5V: see the module docstring."""

    video_marker = "video_start_token_id"  # GLM-4V's video frames are image-token runs after it

    def vision_tower(self) -> torch.nn.Module:
        from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeVisionModel

        return Glm4vMoeVisionModel(self.multimodal_config.vision_config)

    def _build_config(self):
        self.hf_config.use_qk_norm = False  # GLM4MoEBridge reads it; this text config (our own copy) has no qk-norm
        return super()._build_config()

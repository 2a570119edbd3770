"""mbridge bridge of Qwen2.5-VL (``model_type="qwen2_5_vl"``, HF ``Qwen2_5_VLForConditionalGeneration``) for tree
training, in place of mbridge 0.15.1's own (which builds its vision tower from Transformer Engine layers only).

- The language model (``text_config``: Qwen2 layers, qkv biases) is mbridge's Qwen2 bridge on the checkpoint's
  ``model.*`` and ``lm_head.*`` weights, with megatron-core's multimodal RoPE (the checkpoint's ``mrope_section``).
- The vision tower is Hugging Face's own Qwen2.5-VL vision transformer, under ``visual.*``
  (:class:`~megatron_tree.mcore.bridges.vision_language.VisionLanguageBridge`).

Refused (at build): video inputs are never built (images only); pipeline, context and sequence parallel.
"""

from __future__ import annotations

import torch
from mbridge.models.qwen2 import Qwen2Bridge

from megatron_tree.mcore.bridges.vision_language import VisionLanguageBridge

__all__ = ["Qwen25VLBridge"]


class Qwen25VLBridge(VisionLanguageBridge, Qwen2Bridge):
    """Qwen2.5-VL: see the module docstring."""

    language_model_prefix = "model."  # Qwen2.5-VL checkpoints keep the text model's names (and ``visual.*``)
    vision_prefix = "visual."

    def vision_tower(self) -> torch.nn.Module:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel(self.multimodal_config.vision_config)

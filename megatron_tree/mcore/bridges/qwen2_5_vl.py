"""mbridge bridge of Qwen2.5-VL (``model_type="qwen2_5_vl"``, HF ``Qwen2_5_VLForConditionalGeneration``) for tree
training, in place of mbridge 0.15.1's own (which builds its vision tower from Transformer Engine layers only).

- The language model (``text_config``: Qwen2 layers, qkv biases) is mbridge's Qwen2 bridge on the checkpoint's
  ``model.*`` and ``lm_head.*`` weights (:class:`~megatron_tree.mcore.bridges.language_model.LanguageModelOf`), with
  megatron-core's multimodal RoPE (``position_embedding_type="mrope"``, the checkpoint's ``mrope_section``).
- The vision tower is Hugging Face's own Qwen2.5-VL vision transformer built from ``vision_config``, attached to
  the first stage's ``GPTModel`` as ``visual`` (:func:`~megatron_tree.mcore.vision_language.add_vision_tower`),
  replicated on every tensor-parallel rank; its weights load and export under ``visual.*`` with the rest.

Refused (at build): video inputs are never built (images only); pipeline, context and sequence parallel.
"""

from __future__ import annotations

from typing import Any

from mbridge.models.qwen2 import Qwen2Bridge

from megatron_tree.mcore.bridges.language_model import LanguageModelOf
from megatron_tree.mcore.vision_language import add_vision_tower

__all__ = ["Qwen25VLBridge"]

_VISUAL = "visual."


class Qwen25VLBridge(LanguageModelOf, Qwen2Bridge):
    """Qwen2.5-VL: see the module docstring."""

    builds_vision_tower = True
    language_model_prefix = "model."  # Qwen2.5-VL checkpoints keep the text model's names (and ``visual.*``)

    def _mrope_section(self) -> list[int]:
        section = list(self.hf_config.rope_parameters.get("mrope_section") or [16, 24, 24])
        head_dim = getattr(self.hf_config, "head_dim", None) or self.hf_config.hidden_size // \
            self.hf_config.num_attention_heads
        if len(section) != 3 or sum(section) * 2 != head_dim:
            raise ValueError(f"qwen2_5_vl: rope_parameters mrope_section={section} must be three ints summing to "
                             f"head_dim / 2 = {head_dim // 2}")
        return section

    def _build_config(self):
        config = super()._build_config()
        config.mrope_section = self._mrope_section()
        return config

    def _get_gptmodel_args(self) -> dict:
        return {**super()._get_gptmodel_args(), "position_embedding_type": "mrope"}

    def _add_vision_tower(self, model, pre_process: bool, **kwargs: Any) -> None:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        visual = None
        if pre_process:
            visual = Qwen2_5_VisionTransformerPretrainedModel(self.multimodal_config.vision_config)
        add_vision_tower(model, visual)

    def _model_provider(self, post_model_creation_callbacks):
        return super()._model_provider([self._add_vision_tower, *post_model_creation_callbacks])

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        if mcore_weights_name.startswith(_VISUAL):
            return [mcore_weights_name]
        return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)

    def _weight_merge_across_tp(self, mcore_weights_name: str, mcore_weights: list, param):
        if mcore_weights_name.startswith(_VISUAL):  # replicated on every tensor-parallel rank
            return mcore_weights[0]
        return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)

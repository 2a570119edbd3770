"""What the vision-language bridges share: a language model with multimodal RoPE and Hugging Face's vision tower.

:class:`VisionLanguageBridge` goes before a text bridge class (the language model's layers) in a bridge's bases:

- the language model (``text_config``, weights under :attr:`~LanguageModelOf.language_model_prefix` and
  ``lm_head.*``) is built by the text bridge with megatron-core's multimodal RoPE (``position_embedding_type="mrope"``,
  the checkpoint's ``mrope_section`` over the rotated part of each head, ``partial_rotary_factor`` of it);
- the vision tower (:meth:`VisionLanguageBridge.vision_tower`, Hugging Face's own module built from
  ``vision_config``) is attached to the first stage's ``GPTModel`` as ``visual``
  (:func:`~megatron_tree.mcore.vision_language.add_vision_tower`), replicated on every tensor-parallel rank; its
  weights load and export under :attr:`VisionLanguageBridge.vision_prefix` with the rest.

Bridges: :class:`~megatron_tree.mcore.bridges.qwen2_5_vl.Qwen25VLBridge`,
:class:`~megatron_tree.mcore.bridges.glm4v.Glm4VBridge`, :class:`~megatron_tree.mcore.bridges.glm4v_moe.Glm4VMoeBridge`.
Refused (at build): pipeline, context and sequence parallel; video inputs are never built (images only:
:meth:`VisionLanguageBridge.packing_args`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_tree.core.hf_config import attention_head_dim
from megatron_tree.mcore.bridges.language_model import LanguageModelOf
from megatron_tree.mcore.vision_language import add_vision_tower

__all__ = ["VisionLanguageBridge"]

_VISUAL = "visual."  # the vision tower's parameter names in the built model


class VisionLanguageBridge(LanguageModelOf):
    """Mixin before a text bridge class (module docstring). Subclasses set :attr:`vision_prefix` and
    :meth:`vision_tower`."""

    builds_vision_tower = True

    vision_prefix = "model.visual."
    """Where the checkpoint keeps the vision tower's tensors."""

    video_marker = "video_token_id"
    """The multimodal config key of the token that marks a video in a sequence (refused by ``pack_vision_trees``)."""

    def vision_tower(self) -> torch.nn.Module:
        """A new Hugging Face vision tower from ``self.multimodal_config.vision_config``; its forward takes
        ``(pixel_values [P, C], grid_thw=[I, 3])`` and returns ``.pooler_output [P / m², h]`` (one row per merged
        patch, images in order)."""
        raise NotImplementedError

    def packing_args(self) -> dict[str, int]:
        """``pack_vision_trees``'s model keywords: ``image_token_id``, ``spatial_merge_size``, ``video_token_id``."""
        config = self.multimodal_config
        return dict(image_token_id=config.image_token_id, spatial_merge_size=config.vision_config.spatial_merge_size,
                    video_token_id=getattr(config, self.video_marker))

    def _rotary_percent(self) -> float:
        return float(self.hf_config.rope_parameters.get("partial_rotary_factor", 1.0))

    def _mrope_section(self) -> list[int]:
        hf = self.hf_config
        section = list(hf.rope_parameters.get("mrope_section") or [])
        head_dim = attention_head_dim(hf)
        frequencies = int(head_dim * self._rotary_percent()) // 2
        if len(section) != 3 or sum(section) != frequencies:
            raise ValueError(f"{self.multimodal_config.model_type}: rope_parameters mrope_section={section} must be "
                             f"three ints summing to the rotated frequencies per head, {frequencies} (head_dim "
                             f"{head_dim} x partial_rotary_factor {self._rotary_percent()} / 2)")
        return section

    def _build_config(self):
        config = super()._build_config()
        config.mrope_section = self._mrope_section()
        return config

    def _get_gptmodel_args(self) -> dict:
        return {**super()._get_gptmodel_args(), "position_embedding_type": "mrope",
                "rotary_percent": self._rotary_percent()}

    def _add_vision_tower(self, model, pre_process: bool, **kwargs: Any) -> None:
        add_vision_tower(model, self.vision_tower() if pre_process else None)

    def _model_provider(self, post_model_creation_callbacks):
        return super()._model_provider([self._add_vision_tower, *post_model_creation_callbacks])

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        if mcore_weights_name.startswith(_VISUAL):
            return [self.vision_prefix + mcore_weights_name[len(_VISUAL):]]
        return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)

    def _weight_merge_across_tp(self, mcore_weights_name: str, mcore_weights: list, param):
        if mcore_weights_name.startswith(_VISUAL):  # replicated on every tensor-parallel rank
            return mcore_weights[0]
        return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)

"""The language model of a multimodal Hugging Face checkpoint, built through a text-model bridge.

Published vision-language checkpoints (HF ``…ForConditionalGeneration``, e.g. Qwen3.5 ``model_type="qwen3_5"``)
keep the language model's config in ``text_config`` and its weights under ``model.language_model.*`` (the
output head under ``lm_head.*``, the vision tower under ``model.visual.*``). :class:`LanguageModelOf` makes a text
bridge read such a checkpoint: it builds, loads and exports the language model only, under the checkpoint's own
names (RL weight sync updates the engine's language model; its vision tower keeps the checkpoint's weights);
``save_weights`` writes those tensors with the multimodal config (no ``model.visual.*`` tensors: copy them from the
original checkpoint for a complete one). Prompts are text only: there is no vision tower to embed images.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

__all__ = ["LanguageModelOf"]

_log = logging.getLogger(__name__)

_TEXT_PREFIX, _LANGUAGE_MODEL_PREFIX = "model.", "model.language_model."


def language_model_name(hf_name: str, prefix: str = _LANGUAGE_MODEL_PREFIX) -> str:
    """A text model's HF weight name -> the multimodal checkpoint's (``model.X`` -> ``prefix + X``, by default
    ``model.language_model.X``; ``lm_head.*`` unchanged)."""
    if hf_name.startswith(_TEXT_PREFIX):
        return prefix + hf_name[len(_TEXT_PREFIX):]
    return hf_name


class LanguageModelOf:
    """Mixin before a text bridge class: the bridge takes the multimodal checkpoint's config and builds its
    ``text_config`` (``self.hf_config``; ``self.multimodal_config`` keeps the whole one) with the checkpoint's
    ``tie_word_embeddings``, the flag its HF model ties by; weight names gain ``model.language_model.``."""

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any):
        text = getattr(hf_config, "text_config", None)
        if text is None:
            raise ValueError(
                f"{hf_config.model_type} config has no text_config: a multimodal checkpoint's config.json holds the "
                f"language model's config under text_config; pass such a checkpoint, or the text model's own"
            )
        text = copy.deepcopy(text)
        text.tie_word_embeddings = getattr(hf_config, "tie_word_embeddings", False)
        if not self.builds_vision_tower:
            _log.info("%s checkpoint: building its language model (%s) only; the vision tower (model.visual.*) is "
                      "not built, prompts are text only", hf_config.model_type, text.model_type)
        self.multimodal_config = hf_config
        super().__init__(text, *args, **kwargs)

    builds_vision_tower = False
    """Whether the bridge builds the vision tower too
    (:class:`~megatron_tree.mcore.bridges.vision_language.VisionLanguageBridge`)."""

    language_model_prefix = _LANGUAGE_MODEL_PREFIX
    """Where the checkpoint keeps the language model's ``model.*`` tensors (Qwen2.5-VL checkpoints: ``model.``)."""

    def _language_model_name(self, hf_name: str) -> str:
        return language_model_name(hf_name, self.language_model_prefix)

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        return [self._language_model_name(n) for n in super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)]

    def _get_hf_shared_weight_keys(self) -> list[str]:
        return [self._language_model_name(n) for n in super()._get_hf_shared_weight_keys()]

    def save_weights(self, models: list, weights_path: str, memory_efficient: bool = False) -> None:
        """mbridge's ``save_weights`` (the language model's tensors), with the multimodal config: the directory
        builds this bridge again."""
        import torch.distributed as dist

        super().save_weights(models, weights_path, memory_efficient=memory_efficient)
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.multimodal_config.save_pretrained(weights_path)

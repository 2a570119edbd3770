"""mbridge bridges for model families mbridge 0.15.1 does not know, registered with mbridge's ``register_model``.

- :mod:`~megatron_tree.mcore.bridges.qwen3_hybrid`: Qwen3-Next (``qwen3_next``) and Qwen3.5 (``qwen3_5_text``,
  ``qwen3_5_moe_text``), hybrid Gated DeltaNet / gated full-attention models, and the language model of the published
  multimodal Qwen3.5 checkpoints (``qwen3_5``, ``qwen3_5_moe``; no vision tower:
  :mod:`~megatron_tree.mcore.bridges.language_model`).
- :mod:`~megatron_tree.mcore.bridges.qwen2_5_vl`: Qwen2.5-VL (``qwen2_5_vl``, replacing mbridge's own: its vision
  tower needs Transformer Engine): the language model with mRoPE and Hugging Face's vision tower.
- :mod:`~megatron_tree.mcore.bridges.glm4v`: GLM-4V (``glm4v``, GLM-4.1V, replacing mbridge's own, Transformer Engine
  only): GLM-4 layers with interleaved mRoPE and Hugging Face's vision tower
  (:mod:`~megatron_tree.mcore.bridges.vision_language` holds what they share).
- :mod:`~megatron_tree.mcore.bridges.glm4v_moe`: GLM-4.5V (``glm4v_moe``, replacing mbridge's own, Transformer Engine
  only): GLM-4.5's MoE layers with multimodal RoPE and Hugging Face's vision tower.
- :mod:`~megatron_tree.mcore.bridges.gemma3`: Gemma 3 text (``gemma3_text``) and the language model of the published
  Gemma 3 (``gemma3``, replacing mbridge's own vision-language model, Transformer Engine only; text-only prompts):
  local sliding-window and global layers with their own RoPE bases, sandwich norms.

:func:`register_bridges` makes ``AutoBridge.from_pretrained`` find them; :func:`megatron_tree.build_tree_model`,
:func:`megatron_tree.build_flat_model` and :func:`megatron_tree.patch_bridge_for_tree_training` call it. Registering
adds model types, replaces mbridge's bridge for the types in :data:`REPLACED` and refuses those in :data:`REFUSED`; no
other type changes. Idempotent.
"""

from __future__ import annotations

from megatron_tree.mcore.bridges.gemma3 import Gemma3LanguageModelBridge, Gemma3TextBridge
from megatron_tree.mcore.bridges.glm4v import Glm4VBridge
from megatron_tree.mcore.bridges.glm4v_moe import Glm4VMoeBridge
from megatron_tree.mcore.bridges.qwen2_5_vl import Qwen25VLBridge
from megatron_tree.mcore.bridges.qwen3_hybrid import (
    Qwen3NextBridge,
    Qwen35Bridge,
    Qwen35MoeBridge,
    Qwen35MoeVLBridge,
    Qwen35VLBridge,
)

__all__ = [
    "BRIDGES",
    "REFUSED",
    "REPLACED",
    "Gemma3LanguageModelBridge",
    "Gemma3TextBridge",
    "Glm4VBridge",
    "Glm4VMoeBridge",
    "Qwen25VLBridge",
    "Qwen35Bridge",
    "Qwen35MoeBridge",
    "Qwen35MoeVLBridge",
    "Qwen35VLBridge",
    "Qwen3NextBridge",
    "register_bridges",
]

BRIDGES = {
    "qwen3_next": Qwen3NextBridge,
    "qwen3_5_text": Qwen35Bridge,
    "qwen3_5_moe_text": Qwen35MoeBridge,
    "qwen3_5": Qwen35VLBridge,
    "qwen3_5_moe": Qwen35MoeVLBridge,
    "gemma3_text": Gemma3TextBridge,
    "gemma3": Gemma3LanguageModelBridge,
    "qwen2_5_vl": Qwen25VLBridge,
    "glm4v": Glm4VBridge,
    "glm4v_moe": Glm4VMoeBridge,
}
"""HF ``model_type`` -> our bridge class."""

REPLACED = frozenset({"qwen2_5_vl", "glm4v", "glm4v_moe", "gemma3"})
"""Types mbridge 0.15.1 registers whose bridge ours replaces (mbridge's cannot build them for tree training)."""

REFUSED = {
    "internvl_chat": "InternVL (model_type internvl_chat) is not supported for tree training: megatron_tree builds no "
                     "InternVL vision tower or language model with tree attention; use a Qwen2.5-VL, GLM-4V or "
                     "GLM-4.5V checkpoint, or a text model",
}
"""Types mbridge 0.15.1 registers that tree training does not build: ``AutoBridge`` raises this ``ValueError``."""


def _refuse(model_type: str):
    def refuse(hf_config, *args, **kwargs):
        raise ValueError(REFUSED[model_type])

    return refuse


def register_bridges() -> None:
    """Register :data:`BRIDGES` with mbridge (``AutoBridge`` then builds them); a type already registered (by mbridge
    itself, a later release, or an earlier call) is left as it is, except those in :data:`REPLACED`."""
    from mbridge import AutoBridge
    from mbridge.core import register_model

    known = set(AutoBridge.list_supported_models())
    for model_type, cls in BRIDGES.items():
        if model_type not in known or model_type in REPLACED:
            register_model(model_type)(cls)
    for model_type in REFUSED:
        register_model(model_type)(_refuse(model_type))

"""mbridge bridge of Gemma 3 text models (``model_type="gemma3_text"``, HF ``Gemma3ForCausalLM``: Gemma 3 1B, or the
language model of a larger Gemma 3 saved on its own), and of the language model of the published Gemma 3 4B-27B
checkpoints (``model_type="gemma3"``, HF ``Gemma3ForConditionalGeneration``: :class:`Gemma3LanguageModelBridge`,
text-only prompts).

mbridge 0.15.1 registers ``gemma3`` only: the vision-language model, built from its own Transformer-Engine-only
layers (a ``MemoryEfficientAttention`` core attention, exact-erf GeLU where Gemma has the tanh form, one RoPE table
swapped per layer inside the layer), which cannot build a ``gemma3_text`` checkpoint. This bridge builds the text
model from megatron-core parts and ours, as Hugging Face computes it (transformers 5):

- embeddings multiplied by ``sqrt(hidden_size)`` (cast to the weight dtype, as HF), tied to the output layer when
  ``tie_word_embeddings``: a forward hook on ``GPTModel.embedding``;
- every norm an RMSNorm ``x / rms * (1 + w)`` (megatron-core's ``layernorm_zero_centered_gamma``; HF stores ``w``,
  so weights map unchanged), four per layer (:mod:`~megatron_tree.mcore.sandwich_norm`), q / k norms;
- attention scale ``query_pre_attn_scalar ** -0.5`` (``softmax_scale``);
- the MLP a GeGLU with the tanh GeLU (HF ``gelu_pytorch_tanh``);
- ``layer_types``: ``sliding_attention`` layers see ``sliding_window`` tokens (``window_size`` /
  ``window_attn_skip_freq``) and rotate with ``rope_parameters["sliding_attention"]`` (base 10k:
  :class:`~megatron_tree.mcore.layer_rope.LayerRopeSelfAttention`), ``full_attention`` layers see everything and
  rotate with the model's RoPE from ``rope_parameters["full_attention"]`` (base 1M; ``rope_type="linear"``: positions
  divided by ``factor``, megatron-core's ``seq_len_interpolation_factor``).

Refused (``ValueError`` at build): logit soft-capping (final or attention), bidirectional attention, attention biases,
other activations and RoPE types.
"""

from __future__ import annotations

from typing import Any

import torch
from mbridge.core.llm_bridge import LLMBridge

from megatron_tree.compat.mbridge import hf_window_args
from megatron_tree.core.platform import have_transformer_engine
from megatron_tree.mcore.bridges.language_model import LanguageModelOf
from megatron_tree.mcore.gemma3_spec import gemma3_block_spec

__all__ = ["Gemma3LanguageModelBridge", "Gemma3TextBridge", "gelu_tanh"]

_LAYER = "model.layers.{layer_number}"
_SLIDING, _FULL = "sliding_attention", "full_attention"


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU, tanh approximation (Hugging Face's ``gelu_pytorch_tanh``)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def _scale_embeddings(model: torch.nn.Module, pre_process: bool, hf_config: Any, **kwargs: Any) -> None:
    """mbridge post-creation callback: multiply what ``model.embedding`` returns by ``sqrt(hidden_size)``, in the
    weight's dtype (HF's ``Gemma3TextScaledWordEmbedding``: 55.4256 is 55.5 in bf16)."""
    if not pre_process:
        return
    scale = torch.tensor(hf_config.hidden_size**0.5)

    def scaled(module, args, output):
        return output * scale.to(dtype=module.word_embeddings.weight.dtype, device=output.device)

    model.embedding.register_forward_hook(scaled)


class Gemma3TextBridge(LLMBridge):
    """Gemma 3 text (``gemma3_text``): see the module docstring."""

    _DIRECT_MAPPING = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    _ATTENTION_MAPPING = {
        "self_attention.linear_proj.weight": [f"{_LAYER}.self_attn.o_proj.weight"],
        "self_attention.linear_qkv.layer_norm_weight": [f"{_LAYER}.input_layernorm.weight"],
        "self_attention.q_layernorm.weight": [f"{_LAYER}.self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": [f"{_LAYER}.self_attn.k_norm.weight"],
        "self_attention.linear_qkv.weight": [
            f"{_LAYER}.self_attn.q_proj.weight",
            f"{_LAYER}.self_attn.k_proj.weight",
            f"{_LAYER}.self_attn.v_proj.weight",
        ],
    }
    _MLP_MAPPING = {
        "mlp.linear_fc1.weight": [f"{_LAYER}.mlp.gate_proj.weight", f"{_LAYER}.mlp.up_proj.weight"],
        "mlp.linear_fc1.layer_norm_weight": [f"{_LAYER}.pre_feedforward_layernorm.weight"],
        "mlp.linear_fc2.weight": [f"{_LAYER}.mlp.down_proj.weight"],
        "post_mlp_layernorm.weight": [f"{_LAYER}.post_feedforward_layernorm.weight"],
    }
    _OTHER_MAPPING = {
        "post_self_attn_layernorm.weight": [f"{_LAYER}.post_attention_layernorm.weight"],
    }

    # ------------------------------------------------------------------ config

    def _rope(self, layer_type: str) -> dict[str, Any]:
        return dict(self.hf_config.rope_parameters[layer_type])

    def _check_hf_config(self, hf: Any) -> None:
        problems = []
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(hf, key, None) is not None:
                problems.append(f"{key}={getattr(hf, key)} (megatron-core has no logit soft-capping; Gemma 3's "
                                f"checkpoints have none: set it to null)")
        if getattr(hf, "use_bidirectional_attention", False):
            problems.append("use_bidirectional_attention=True (tree attention is causal)")
        if getattr(hf, "attention_bias", False):
            problems.append("attention_bias=True (Gemma 3's checkpoints have no biases; the sandwich norms need none)")
        if hf.hidden_activation != "gelu_pytorch_tanh":
            problems.append(f"hidden_activation={hf.hidden_activation!r} (this bridge builds 'gelu_pytorch_tanh')")
        types = list(hf.layer_types)
        if len(types) != hf.num_hidden_layers or set(types) - {_SLIDING, _FULL}:
            problems.append(f"layer_types={types} (one of {_SLIDING!r} / {_FULL!r} per layer)")
        local, full = self._rope(_SLIDING), self._rope(_FULL)
        if local.get("rope_type", "default") != "default":
            problems.append(f"rope_parameters[{_SLIDING!r}] rope_type={local.get('rope_type')!r} (only 'default')")
        if full.get("rope_type", "default") not in ("default", "linear"):
            problems.append(f"rope_parameters[{_FULL!r}] rope_type={full.get('rope_type')!r} (only 'default' and "
                            f"'linear')")
        if problems:
            raise ValueError(f"gemma3_text: cannot build {'; '.join(problems)}")

    def _build_config(self):
        hf = self.hf_config
        self._check_hf_config(hf)
        return self._build_base_config(
            activation_func=gelu_tanh,
            add_bias_linear=False,
            add_qkv_bias=False,
            qk_layernorm=True,
            layernorm_zero_centered_gamma=True,
            kv_channels=hf.head_dim,
            softmax_scale=hf.query_pre_attn_scalar**-0.5,
            **hf_window_args(hf),
        )

    def set_extra_args(self, **kwargs):
        """mbridge's, with ``bias_activation_fusion`` off whatever is asked (the Transformer Engine overrides ask for
        it): megatron-core fuses a GeGLU only for ``activation_func=F.gelu`` (and then computes the tanh form, where
        its unfused F.gelu is erf), and its TransformerConfig refuses the fusion for the tanh GeGLU."""
        super().set_extra_args(**{**kwargs, "bias_activation_fusion": False})

    def _get_gptmodel_args(self) -> dict:
        hf, full = self.hf_config, self._rope(_FULL)
        return dict(
            vocab_size=hf.vocab_size,
            max_sequence_length=hf.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=full["rope_theta"],
            seq_len_interpolation_factor=full["factor"] if full.get("rope_type") == "linear" else None,
        )

    def _get_transformer_layer_spec(self, vp_stage: int | None = None):
        self.has_vp_stage = True  # LLMBridge's model provider reads it
        return gemma3_block_spec(
            self.config,
            local_rope=[t == _SLIDING for t in self.hf_config.layer_types],
            local_rotary_base=self._rope(_SLIDING)["rope_theta"],
            use_transformer_engine=have_transformer_engine(),
            vp_stage=vp_stage,
        )

    def _model_provider(self, post_model_creation_callbacks):
        return super()._model_provider([_scale_embeddings, *post_model_creation_callbacks])

    def _adjust_mapping_for_shared_weights(self):
        if getattr(self.hf_config, "tie_word_embeddings", False):
            self._DIRECT_MAPPING = {**self._DIRECT_MAPPING, "output_layer.weight": "model.embed_tokens.weight"}

    def _get_hf_shared_weight_keys(self) -> list[str]:
        return ["model.embed_tokens.weight"] if getattr(self.hf_config, "tie_word_embeddings", False) else []


class Gemma3LanguageModelBridge(LanguageModelOf, Gemma3TextBridge):
    """The language model of a published Gemma 3 checkpoint (HF ``Gemma3ForConditionalGeneration``,
    ``model_type="gemma3"``, 4B-27B): :class:`Gemma3TextBridge` on its ``text_config`` and its language model's
    weights (``language_model.model.*``, as the published checkpoints and transformers 5 store them); its SigLIP
    vision tower is not built (text-only prompts: Gemma 3's image tokens attend to each other both ways, which tree
    attention does not compute)."""

    language_model_prefix = "language_model.model."

"""Tiny random Hugging Face models of the architectures tree training is tested on (the demo and the tests).

:func:`save_tiny_hf_checkpoint` writes one (config and fp32 weights) that ``AutoBridge.from_pretrained``
reads like a real checkpoint; :func:`tiny_hf_config` gives its config, :func:`save_hf_config` the config alone.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["OTHER_TINY_ARCHS", "QWEN2_5_VL_TOKENS", "TINY_ARCHS", "save_hf_config", "save_tiny_hf_checkpoint",
           "tiny_hf_config"]

TINY_ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "qwen3_5",
              "qwen3_next")
"""The causal-LM architectures every family-wide test (and the launcher's ``--arch``) runs."""

OTHER_TINY_ARCHS = ("gemma3_text", "gemma3", "qwen3_5_vl", "qwen3_5_moe", "qwen2_5_vl", "glm4v", "glm4v_moe")
"""Architectures :func:`tiny_hf_config` also knows, tested in their own files rather than in every family-wide
test: Gemma 3 text and the published Gemma 3, whose language model is built (``tests/mcore/test_gemma3_parity.py``),
the published multimodal Qwen3.5 / Qwen3.5-MoE checkpoints, whose language model is built
(``tests/mcore/test_gated_delta_net_parity.py``), and Qwen2.5-VL, GLM-4V and GLM-4.5V
(``tests/mcore/test_vision_language_parity.py``)."""


_DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
"""DeepSeek-V3's RoPE scaling (its checkpoints' ``rope_scaling``): YaRN, softmax scale and cos / sin scaled by mscale."""


_GATED_DELTA_NET = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
)
"""Qwen3.5's and Qwen3-Next's hybrid layers: 3 Gated DeltaNet layers (2 key heads of dim 16, 4 value heads of dim 8,
conv width 4), then one gated full-attention layer (RoPE on a quarter of each head)."""


_GEMMA3_LAYER = "sliding_attention"
_VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")
"""Where the multimodal checkpoints keep their vision towers (Gemma 3: a SigLIP tower and a projector)."""
_GEMMA3_TEXT = dict(
    num_hidden_layers=6,
    layer_types=[_GEMMA3_LAYER, _GEMMA3_LAYER, "full_attention"] * 2,
    head_dim=16,
    query_pre_attn_scalar=24,  # attention scale 24 ** -0.5, not head_dim ** -0.5
    sliding_window=4,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
    tie_word_embeddings=True,
)
"""Gemma 3's language model, tiny: 6 layers, every 3rd global."""

_TINY_SIGLIP_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           image_size=16, patch_size=4)
"""Gemma 3's SigLIP vision tower, tiny: one block over a 4 x 4 patch grid (pooled to 2 x 2 image tokens)."""

_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, num_position_embeddings=16)
"""A one-block vision tower (``vision_config``; ``out_hidden_size`` is the language model's hidden size)."""

_TINY_QWEN2_5_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                            spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
"""Qwen2.5-VL's vision tower, tiny: a windowed block (windows of 2 x 2 merged patches) then a full one; patches of
3 x 2 x 4 x 4 = 96 values, merged 2 x 2."""

QWEN2_5_VL_TOKENS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)
"""The tiny Qwen2.5-VL's special tokens (inside its vocabulary of 160)."""

_TINY_GLM4V_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, image_size=16,
                          spatial_merge_size=2, temporal_patch_size=2)
"""GLM-4V's vision tower, tiny: two blocks, learned position embeddings of a 4 x 4 patch grid (interpolated to each
image's grid), patches of 3 x 2 x 4 x 4 = 96 values, merged 2 x 2 by a strided convolution."""

_GLM4V_TOKENS = dict(image_token_id=150, video_token_id=151, image_start_token_id=152, image_end_token_id=153,
                    video_start_token_id=154, video_end_token_id=155)
"""The tiny GLM-4V's special tokens (vocabulary 160; image, image start and end ids as :data:`QWEN2_5_VL_TOKENS`)."""

_MULTIMODAL = {
    "qwen3_5_vl": ("Qwen3_5Config", _TINY_VISION, {}),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", _TINY_VISION, {}),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", _TINY_QWEN2_5_VISION, QWEN2_5_VL_TOKENS),
    "glm4v": ("Glm4vConfig", _TINY_GLM4V_VISION, _GLM4V_TOKENS),
    "glm4v_moe": ("Glm4vMoeConfig", _TINY_GLM4V_VISION, _GLM4V_TOKENS),
    "gemma3": ("Gemma3Config", _TINY_SIGLIP_VISION,
               dict(mm_tokens_per_image=4, boi_token_index=150, eoi_token_index=151, image_token_index=152)),
}
"""Archs saved as published multimodal checkpoints (HF ``…ForConditionalGeneration``): their ``per_arch`` entry is
the language model's config (``text_config``), wrapped in this config class with this vision config and these
top-level keys."""


_SIGMOID_ROUTER = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                       topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1)
"""GLM-4.5's and DeepSeek-V3's MoE (the same HF keys): layer 0 dense, then 4 sigmoid-routed experts of FFN 32,
2 groups of which 1 is chosen, top-2, routed scaling 2.5, one shared expert."""


def tiny_hf_config(arch: str, **overrides: Any):
    """The Hugging Face config of the tiny ``arch`` model (defaults as :func:`save_tiny_hf_checkpoint`),
    changed by ``overrides``. A key the config class does not define raises ``ValueError``
    naming the closest valid keys (HF config classes would store a typo silently). ``layer_types`` follows
    ``num_hidden_layers`` unless given: for the hybrids (Qwen3.5, Qwen3-Next) every 4th layer full attention, for
    Gemma 3 every 3rd. For the multimodal archs (``qwen3_5_vl``, ``qwen3_5_moe``) ``overrides`` change the language
    model (``text_config``)."""
    import difflib

    import transformers

    common: dict[str, Any] = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    per_arch: dict[str, tuple[str, dict[str, Any]]] = {
        "qwen3": ("Qwen3Config", dict(head_dim=16)),
        "qwen2": ("Qwen2Config", {}),
        "llama": ("LlamaConfig", dict(head_dim=16, attention_bias=False, mlp_bias=False)),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            dict(
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
        ),
        "qwen2_moe": (  # Qwen2MoeConfig has no head_dim: 64 / 4 heads = 16
            "Qwen2MoeConfig",
            dict(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                norm_topk_prob=False,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
        ),
        "mixtral": (  # experts' FFN is intermediate_size; no shared expert, no sliding window
            "MixtralConfig",
            dict(
                head_dim=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                intermediate_size=32,
                sliding_window=None,
                router_jitter_noise=0.0,
            ),
        ),
        "glm4_moe": (  # GLM-4.5: layer 0 dense, then sigmoid-routed experts with a score-correction bias,
            # group-limited top-k, routed scaling and a shared expert; qk-norm, qkv biases, RoPE on half the head dim
            "Glm4MoeConfig",
            dict(
                head_dim=16,
                **_SIGMOID_ROUTER,
                use_qk_norm=True,
                attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
            ),
        ),
        "deepseek_v3": (  # DeepSeek-V3: multi-latent attention (low-rank q and kv, a shared RoPE key, value head dim
            # != q/k head dim, YaRN with DeepSeek-V3's own scaling), layer 0 dense, then a sigmoid router with a
            # score-correction bias, 2 groups of which 1 is chosen, routed scaling and a shared expert; no MTP
            "DeepseekV3Config",
            dict(
                num_key_value_heads=4,
                q_lora_rank=32,
                kv_lora_rank=24,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=12,
                **_SIGMOID_ROUTER,
                num_nextn_predict_layers=0,
                max_position_embeddings=40 * 4096,  # YaRN: factor x original context, as DeepSeek-V3's config
                rope_parameters=_DEEPSEEK_V3_YARN,
            ),
        ),
        "qwen2_5_vl": (  # Qwen2.5-VL's language model: Qwen2 layers (qkv biases), mRoPE over (t, h, w) = 2 + 3 + 3
            # of each head's 8 frequencies
            "Qwen2_5_VLTextConfig",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
                 bos_token_id=None, eos_token_id=None),  # the published ids lie outside the tiny vocabulary
        ),
        "glm4v": (  # GLM-4V's language model: GLM-4 layers (qkv biases, fused gate / up, norms after the attention
            # and the MLP too), interleaved mRoPE on half of each head: (t, h, w) = 1 + 1 + 2 of its 4 frequencies
            "Glm4vTextConfig",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [1, 1, 2],
                                  "partial_rotary_factor": 0.5}),
        ),
        "glm4v_moe": (  # GLM-4.5V's language model: GLM-4.5's MoE layers without qk-norm (qkv biases, layer 0 dense,
            # then the sigmoid router), mRoPE in halves on half of each head: (t, h, w) = 1 + 1 + 2 of its 4 frequencies
            "Glm4vMoeTextConfig",
            dict(**_SIGMOID_ROUTER, attention_bias=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [1, 1, 2],
                                  "partial_rotary_factor": 0.5}),
        ),
        "qwen3_5": ("Qwen3_5TextConfig", _GATED_DELTA_NET),  # Qwen3.5 text: hybrid layers, dense MLPs
        "qwen3_5_vl": ("Qwen3_5TextConfig", _GATED_DELTA_NET),  # published Qwen3.5: the same language model
        "qwen3_5_moe": (  # published Qwen3.5-MoE: hybrid layers, MoE in every layer with a gated shared expert
            "Qwen3_5MoeTextConfig",
            dict(**_GATED_DELTA_NET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32),
        ),
        "qwen3_next": (  # Qwen3-Next: hybrid layers; MoE with a sigmoid-gated shared expert, layer 1 dense
            "Qwen3NextConfig",
            dict(
                **_GATED_DELTA_NET,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
            ),
        ),
        "gemma3_text": ("Gemma3TextConfig", _GEMMA3_TEXT),  # Gemma 3 text: local (sliding window 4, RoPE base 10k)
        # and global layers (RoPE base 1M, linear scaling 8 as the 4B-27B models), sandwich norms, qk-norm, GeGLU,
        # tied and scaled embeddings
        "gemma3": ("Gemma3TextConfig", _GEMMA3_TEXT),  # published Gemma 3 (4B-27B): the same language model
    }
    if arch not in per_arch:
        raise ValueError(f"arch={arch!r} is not a tiny test architecture; use one of {TINY_ARCHS + OTHER_TINY_ARCHS}")
    class_name, extra = per_arch[arch]
    config_class = getattr(transformers, class_name)
    valid = {*config_class().to_dict(), *config_class.attribute_map, *common, *extra}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        close = {key: difflib.get_close_matches(key, valid, n=1) for key in unknown}
        if all(close.values()):
            fix = "; ".join(f"did you mean {m[0]!r} for {key!r}?" for key, m in close.items())
        else:
            fix = f"valid keys: {sorted(k for k in valid if not k.startswith('_'))}"
        raise ValueError(f"unknown {class_name} key(s) {unknown} for arch={arch!r}; {fix}")
    kwargs = {**common, **extra, **overrides}
    if "layer_types" in extra and "layer_types" not in overrides:  # follow num_hidden_layers
        every, other = (3, _GEMMA3_LAYER) if arch.startswith("gemma3") else (4, "linear_attention")
        kwargs["layer_types"] = ["full_attention" if (i + 1) % every == 0 else other
                                 for i in range(kwargs["num_hidden_layers"])]
    config = config_class(**kwargs)
    if arch in _MULTIMODAL:
        class_name, vision, top = _MULTIMODAL[arch]
        vision = dict(vision, out_hidden_size=config.hidden_size)
        return getattr(transformers, class_name)(text_config=config, vision_config=vision,
                                                 tie_word_embeddings=config.tie_word_embeddings, **top)
    return config


def save_tiny_hf_checkpoint(arch: str, path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """Write a random tiny Hugging Face causal LM (fp32 safetensors + config) to ``path``; return ``path``.

    ``arch`` is one of ``"qwen3"`` (qk-norm), ``"qwen2"`` (qkv biases), ``"llama"``,
    ``"qwen3_moe"`` (4 experts, top-2, normalised top-k probs), ``"qwen2_moe"`` (4 experts,
    top-2, unnormalised top-k probs, a shared expert of FFN 32 behind a sigmoid gate, qkv
    biases), ``"mixtral"`` (4 experts of FFN 32, top-2, renormalised top-k probs, no sliding
    window), ``"glm4_moe"`` (GLM-4.5: layer 0 dense, then 4 sigmoid-routed experts of FFN 32 with a
    score-correction bias, 2 groups of which 1 is chosen, top-2, routed scaling 2.5, one shared expert;
    qk-norm, qkv biases, RoPE on half of each head), ``"deepseek_v3"`` (multi-latent attention: 4 heads,
    q rank 32, kv rank 24, q/k head dim 16 + RoPE 8, value head dim 12, YaRN as DeepSeek-V3 (factor 40,
    mscale 1 / 1); layer 0 dense, then GLM-4.5's router and one shared expert; no MTP layers), ``"qwen3_5"`` (Qwen3.5
    text: 4 layers, 3 Gated DeltaNet (2 key heads of dim 16, 4 value heads of dim 8, conv width 4) then one full
    attention with an output gate, q/k norms and RoPE on a quarter of each head; zero-centred RMSNorms; dense MLPs),
    ``"qwen3_next"`` (Qwen3-Next: the same layers, MoE of 4 experts of FFN 32, top-2, normalised, a shared expert of
    FFN 32 behind a sigmoid gate; layer 1 dense), ``"gemma3_text"`` (Gemma 3 text, :data:`OTHER_TINY_ARCHS`: 6 layers,
    every 3rd global (RoPE base 1M, linear scaling 8), the others local (sliding window 4, RoPE base 10k); attention
    scale ``24 ** -0.5``; four zero-centred RMSNorms per layer, q/k norms, GeGLU (tanh GeLU), embeddings scaled by
    ``sqrt(hidden)`` and tied), ``"qwen3_5_vl"`` / ``"qwen3_5_moe"`` (published Qwen3.5 /
    Qwen3.5-MoE checkpoints, ``…ForConditionalGeneration``: a one-block vision tower under ``model.visual``, the
    language model under ``model.language_model``: ``"qwen3_5"``'s layers; Qwen3.5-MoE's MLPs are MoEs of 4 experts
    of FFN 32, top-2, normalised, with a shared expert of FFN 32 behind a sigmoid gate), ``"qwen2_5_vl"`` (Qwen2.5-VL,
    ``Qwen2_5_VLForConditionalGeneration``: Qwen2 layers with mRoPE sections (2, 3, 3), a two-block vision tower of
    hidden 32, patch 4, merge 2, windows of 16 pixels; special tokens :data:`QWEN2_5_VL_TOKENS`), ``"glm4v"`` (GLM-4V,
    ``Glm4vForConditionalGeneration``: GLM-4 layers (qkv biases, fused gate / up, four RMSNorms) with interleaved mRoPE
    sections (1, 1, 2) on half of each head, a two-block vision tower of hidden 32, patch 4, merge 2; the same image
    token ids), ``"glm4v_moe"`` (GLM-4.5V, ``Glm4vMoeForConditionalGeneration``: ``"glm4_moe"``'s layers without
    qk-norm, mRoPE sections (1, 1, 2) in halves on half of each head; GLM-4V's vision tower and ids), ``"gemma3"``
    (published Gemma 3, ``Gemma3ForConditionalGeneration``: ``"gemma3_text"``'s language model under
    ``model.language_model``, a one-block SigLIP tower pooled to 2 x 2 image tokens). Defaults: hidden 64,
    2 layers, 4 heads of dim 16, 2 KV heads (GQA), FFN 128 (expert FFN 32), vocab 160,
    RoPE theta 1e6, untied embeddings; ``overrides`` are passed to the HF config class.
    Every parameter is drawn from a ``seed``-ed generator, norm weights around their initial value (1, or 0
    for zero-centred norms) and biases non-zero, so a weight mapped to the wrong place changes the logits. A
    multimodal checkpoint's vision tower is drawn last: ``"qwen3_5_vl"``'s language model is ``"qwen3_5"``'s, weight
    for weight (same ``seed`` and overrides).

    Under ``torch.distributed`` only rank 0 writes; all ranks then meet at a barrier, so
    call it on every rank after :func:`megatron_tree.runtime.init_distributed`.
    """
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = tiny_hf_config(arch, **overrides)
    path = os.fspath(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        auto_class = AutoModelForImageTextToText if arch in _MULTIMODAL else AutoModelForCausalLM
        model = auto_class.from_config(config).to(torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            vision_last = sorted(model.named_parameters(), key=lambda item: item[0].startswith(_VISION_PREFIXES))
            for name, param in vision_last:
                noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
                is_norm = param.ndim == 1 and "norm" in name
                # norms around their initial value: 1, or 0 for zero-centred ones (x / rms * (1 + w))
                param.copy_(param.mean().round() + 0.2 * noise if is_norm else 0.1 * noise)
            for name, buffer in model.named_buffers():  # GLM-4.5's router score-correction bias is a buffer
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen, dtype=buffer.dtype))
        model.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path


def save_hf_config(arch: str, path: str | os.PathLike, **overrides: Any) -> str:
    """Write only the HF ``config.json`` of ``arch`` (defaults as :func:`save_tiny_hf_checkpoint`,
    changed by ``overrides``) to ``path``; return ``path``. For models that Megatron initialises
    randomly (``AutoBridge.from_pretrained`` reads only the config). Rank 0 writes, then a barrier."""
    import torch.distributed as dist

    path = os.fspath(path)
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        tiny_hf_config(arch, **overrides).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path

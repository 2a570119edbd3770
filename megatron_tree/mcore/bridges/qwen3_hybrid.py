"""mbridge bridges of Qwen3-Next (``qwen3_next``) and Qwen3.5 (``qwen3_5_text``, MoE ``qwen3_5_moe_text``; the
published multimodal checkpoints ``qwen3_5`` / ``qwen3_5_moe``: their language model): Gated DeltaNet hybrids.

All interleave Gated DeltaNet layers with gated full-attention layers (HF ``layer_types``; 3:1 in the
released checkpoints), zero-centred RMSNorms (``x / rms * (1 + w)``: megatron-core's
``layernorm_zero_centered_gamma``) and partial RoPE (``partial_rotary_factor``: megatron-core's ``rotary_percent``).
Qwen3-Next's and Qwen3.5-MoE's MLPs are MoE with a sigmoid-gated shared expert; Qwen3.5's are dense. Layers are built by
:func:`megatron_tree.mcore.hybrid_spec.hybrid_block_spec` (TE or local).

Weight layouts, HF <-> megatron-core (dk / dv: key / value head dim, nk / nv: key / value heads, r = nv / nk;
nh / ng / hd: attention heads, KV groups, head dim, rh = nh / ng):

- full attention ``q_proj`` holds per head ``[q_h | gate_h]`` (``[nh * 2 hd, h]``); megatron-core's ``linear_qkv``
  (``attention_output_gate``) per KV group ``[q (rh heads) | gate (rh heads) | k | v]``.
- GDN ``in_proj``: megatron-core ``[q (nk dk) | k (nk dk) | v (nv dv) | z (nv dv) | b (nv) | a (nv)]``; Qwen3-Next's
  ``in_proj_qkvz`` groups per key head ``[q_i | k_i | v_i (r dv) | z_i (r dv)]`` and ``in_proj_ba``
  ``[b_i (r) | a_i (r)]``;
  Qwen3.5 has ``in_proj_qkv`` (``[q | k | v]``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
- Tensor parallel: each rank holds every component's slice (``[q_r | k_r | v_r | z_r | b_r | a_r]``, conv channels
  ``[q_r | k_r | v_r]``), so ``in_proj`` and ``conv1d`` split and merge per component, not as one block.
- MoE experts: HF checkpoints hold each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` (transformers >= 5
  fuses them into ``gate_up_proj`` / ``down_proj`` when it loads and splits them again when it saves);
  megatron-core's ``linear_fc1`` is ``[gate | up]``.
- GDN ``out_norm``: HF's gated norm is ``x / rms * w`` (``w`` starts at 1), but megatron-core builds it with the
  config's zero-centred gamma: megatron holds ``w - 1``.
"""

from __future__ import annotations

from typing import Any

import torch
from mbridge.core.llm_bridge import LLMBridge

from megatron_tree.core.platform import have_transformer_engine
from megatron_tree.mcore.bridges.language_model import LanguageModelOf
from megatron_tree.mcore.hybrid_spec import hybrid_block_spec

__all__ = ["Qwen35Bridge", "Qwen35MoeBridge", "Qwen35MoeVLBridge", "Qwen35VLBridge", "Qwen3NextBridge"]

_LAYER = "model.layers.{layer_number}"
_LINEAR, _FULL = "linear_attention", "full_attention"


_MOE_MLP_MAPPING = {
    "pre_mlp_layernorm": [f"{_LAYER}.post_attention_layernorm.weight"],
    "mlp.router.weight": [f"{_LAYER}.mlp.gate.weight"],
    "shared_experts.linear_fc1.weight": [f"{_LAYER}.mlp.shared_expert.gate_proj.weight",
                                         f"{_LAYER}.mlp.shared_expert.up_proj.weight"],
    "shared_experts.linear_fc2.weight": [f"{_LAYER}.mlp.shared_expert.down_proj.weight"],
    "shared_experts.gate_weight": [f"{_LAYER}.mlp.shared_expert_gate.weight"],
    "mlp.experts.linear_fc1": [f"{_LAYER}.mlp.experts.{{expert_id}}.gate_proj.weight",
                               f"{_LAYER}.mlp.experts.{{expert_id}}.up_proj.weight"],
    "mlp.experts.linear_fc2": [f"{_LAYER}.mlp.experts.{{expert_id}}.down_proj.weight"],
}
"""MoE layers (router, experts, sigmoid-gated shared expert) of Qwen3-Next and Qwen3.5-MoE; dense layers as
``_Qwen3HybridBridge._MLP_MAPPING``."""


def _moe_args(hf: Any, sparse: list[int], *, normalise_topk: bool) -> dict[str, Any]:
    """megatron-core MoE config fields of a softmax top-k router and a sigmoid-gated shared expert (HF
    ``num_experts``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``); ``sparse``: 1 per MoE layer."""
    shared = hf.shared_expert_intermediate_size
    return dict(
        num_moe_experts=hf.num_experts,
        moe_layer_freq=sparse,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_router_topk=hf.num_experts_per_tok,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not normalise_topk,  # False: softmax over the top-k = normalised top-k
        moe_router_load_balancing_type="none",  # mbridge's default for RL
        moe_aux_loss_coeff=hf.router_aux_loss_coef,
        moe_grouped_gemm=True,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
    )


class _Qwen3HybridBridge(LLMBridge):
    """What Qwen3-Next and Qwen3.5 share; subclasses give the MLP and the GDN input projection."""

    _DIRECT_MAPPING = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    _GDN_IN_PROJ: list[str] = []  # HF names of the GDN input projection, in the order _in_proj_to_mcore takes them
    _ATTENTION_MAPPING = {
        "self_attention.linear_proj.weight": [f"{_LAYER}.self_attn.o_proj.weight"],
        "self_attention.linear_qkv.layer_norm_weight": [f"{_LAYER}.input_layernorm.weight"],
        "self_attention.in_proj.layer_norm_weight": [f"{_LAYER}.input_layernorm.weight"],
        "self_attention.q_layernorm.weight": [f"{_LAYER}.self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": [f"{_LAYER}.self_attn.k_norm.weight"],
        "self_attention.linear_qkv.weight": [
            f"{_LAYER}.self_attn.q_proj.weight",
            f"{_LAYER}.self_attn.k_proj.weight",
            f"{_LAYER}.self_attn.v_proj.weight",
        ],
        "self_attention.conv1d.weight": [f"{_LAYER}.linear_attn.conv1d.weight"],
        "self_attention.A_log": [f"{_LAYER}.linear_attn.A_log"],
        "self_attention.dt_bias": [f"{_LAYER}.linear_attn.dt_bias"],
        "self_attention.out_norm.weight": [f"{_LAYER}.linear_attn.norm.weight"],
        "self_attention.out_proj.weight": [f"{_LAYER}.linear_attn.out_proj.weight"],
    }
    _MLP_MAPPING = {
        "mlp.linear_fc1.weight": [f"{_LAYER}.mlp.gate_proj.weight", f"{_LAYER}.mlp.up_proj.weight"],
        "mlp.linear_fc1.layer_norm_weight": [f"{_LAYER}.post_attention_layernorm.weight"],
        "mlp.linear_fc2.weight": [f"{_LAYER}.mlp.down_proj.weight"],
    }

    # ------------------------------------------------------------------ config

    def _check_hf_config(self, hf: Any) -> None:
        types = list(hf.layer_types)
        unknown = sorted(set(types) - {_LINEAR, _FULL})
        if unknown or len(types) != hf.num_hidden_layers:
            raise ValueError(
                f"{hf.model_type} layer_types={types}: need one of {_LINEAR!r} / {_FULL!r} per layer "
                f"({hf.num_hidden_layers} layers)"
            )
        if getattr(hf, "attention_bias", False):
            raise ValueError(f"{hf.model_type} with attention_bias=True: the released checkpoints have none and this "
                             f"bridge maps no attention biases; use attention_bias=False")
        rope = dict(hf.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{hf.model_type} rope_type={rope.get('rope_type')!r}: this bridge builds plain RoPE "
                             f"('default') only")
        if hf.hidden_act != "silu":
            raise ValueError(f"{hf.model_type} hidden_act={hf.hidden_act!r}: the GDN layers and MLPs are built with "
                             f"SiLU")
        if self.mpu.cp_size > 1:
            raise ValueError(
                f"{hf.model_type} under context parallel size {self.mpu.cp_size}: Gated DeltaNet layers cannot be "
                f"split over context-parallel ranks (each slot's state depends on all its ancestors); use "
                f"context_parallel_size=1"
            )

    def _hybrid_config_args(self) -> dict[str, Any]:
        hf = self.hf_config
        self._check_hf_config(hf)
        return dict(
            use_cpu_initialization=False,
            add_bias_linear=False,
            qk_layernorm=True,
            layernorm_zero_centered_gamma=True,
            attention_output_gate=True,
            kv_channels=hf.head_dim,
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=[int(t == _LINEAR) for t in hf.layer_types],
            linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
            linear_key_head_dim=hf.linear_key_head_dim,
            linear_value_head_dim=hf.linear_value_head_dim,
            linear_num_key_heads=hf.linear_num_key_heads,
            linear_num_value_heads=hf.linear_num_value_heads,
            persist_layer_norm=True,
            bias_activation_fusion=True,
            bias_dropout_fusion=True,
        )

    def _get_gptmodel_args(self) -> dict:
        hf = self.hf_config
        rope = dict(hf.rope_parameters or {})
        return dict(
            vocab_size=hf.vocab_size,
            max_sequence_length=hf.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=rope["rope_theta"],
            rotary_percent=rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)),
        )

    def _get_transformer_layer_spec(self, vp_stage: int | None = None):
        self.has_vp_stage = True  # LLMBridge's model provider reads it
        return hybrid_block_spec(self.config, use_transformer_engine=have_transformer_engine(), vp_stage=vp_stage)

    def _adjust_mapping_for_shared_weights(self):
        if getattr(self.hf_config, "tie_word_embeddings", False):
            self._DIRECT_MAPPING = {**self._DIRECT_MAPPING, "output_layer.weight": "model.embed_tokens.weight"}

    def _get_hf_shared_weight_keys(self) -> list[str]:
        return ["model.embed_tokens.weight"] if getattr(self.hf_config, "tie_word_embeddings", False) else []

    # ------------------------------------------------------------------ names

    def _weight_name_mapping_attention(self, name: str) -> list[str]:
        if "self_attention.in_proj.weight" in name:
            return [x.format(layer_number=name.split(".")[2]) for x in self._GDN_IN_PROJ]
        return super()._weight_name_mapping_attention(name)

    def _weight_name_mapping_mlp(self, name: str) -> list[str]:
        layer = name.split(".")[2]
        for keyword, hf_names in self._MLP_MAPPING.items():
            if keyword in name:
                expert = name.split("weight")[-1]
                return [x.format(layer_number=layer, expert_id=expert) for x in hf_names]
        raise NotImplementedError(f"Unsupported parameter name: {name}")

    # ------------------------------------------------------------------ layouts

    def _sizes(self) -> dict[str, int]:
        c = self.config
        return dict(qk=c.linear_num_key_heads * c.linear_key_head_dim,
                    v=c.linear_num_value_heads * c.linear_value_head_dim, nv=c.linear_num_value_heads)

    def _in_proj_sections(self) -> list[int]:
        s = self._sizes()
        return [s["qk"], s["qk"], s["v"], s["v"], s["nv"], s["nv"]]

    def _conv_sections(self) -> list[int]:
        s = self._sizes()
        return [s["qk"], s["qk"], s["v"]]

    def _in_proj_to_mcore(self, hf_weights: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _in_proj_to_hf(self, weight: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def _qkv_to_mcore(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """HF ``q_proj`` (per head ``[q | gate]``), ``k_proj``, ``v_proj`` -> ``linear_qkv`` per KV group
        ``[q | gate | k | v]``."""
        c, hidden = self.config, q.shape[-1]
        ng, hd = c.num_query_groups, c.kv_channels
        rh = c.num_attention_heads // ng
        qg = q.view(ng, rh, 2, hd, hidden)
        return torch.cat([qg[:, :, 0].reshape(ng, rh * hd, hidden), qg[:, :, 1].reshape(ng, rh * hd, hidden),
                          k.view(ng, hd, hidden), v.view(ng, hd, hidden)], dim=1).reshape(-1, hidden)

    def _qkv_to_hf(self, qkv: torch.Tensor) -> list[torch.Tensor]:
        c, hidden = self.config, qkv.shape[-1]
        ng, hd = c.num_query_groups, c.kv_channels
        rh = c.num_attention_heads // ng
        q, gate, k, v = qkv.view(ng, -1, hidden).split([rh * hd, rh * hd, hd, hd], dim=1)
        q_proj = torch.stack([q.reshape(ng, rh, hd, hidden), gate.reshape(ng, rh, hd, hidden)], dim=2)
        return [q_proj.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]

    def _weight_to_mcore_format(self, mcore_weights_name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
        name = mcore_weights_name
        if self.dtype is not None:
            hf_weights = [w.to(self.dtype) for w in hf_weights]
        if "self_attention.in_proj.weight" in name:
            return self._in_proj_to_mcore(hf_weights).contiguous()
        if "self_attention.linear_qkv.weight" in name:
            return self._qkv_to_mcore(*hf_weights).contiguous()
        if "self_attention.out_norm.weight" in name:
            return hf_weights[0] - 1.0
        return super()._weight_to_mcore_format(name, hf_weights)

    def _weight_to_hf_format(self, mcore_weights_name: str, mcore_weights: torch.Tensor):
        name = mcore_weights_name
        hf_names = self._weight_name_mapping_mcore_to_hf(name)
        if "self_attention.in_proj.weight" in name:
            return hf_names, self._in_proj_to_hf(mcore_weights)
        if "self_attention.linear_qkv.weight" in name:
            return hf_names, self._qkv_to_hf(mcore_weights)
        if "self_attention.out_norm.weight" in name:
            return hf_names, [mcore_weights + 1.0]
        return super()._weight_to_hf_format(name, mcore_weights)

    def _component_sections(self, name: str) -> list[int] | None:
        """The per-component sections of a parameter that tensor parallel splits per component (dim 0), else None."""
        if "self_attention.in_proj.weight" in name:
            return self._in_proj_sections()
        if "self_attention.conv1d.weight" in name:
            return self._conv_sections()
        return None

    def _weight_split_across_tp(self, mcore_weights_name, mcore_weights, param, tp_split_size):
        sections = self._component_sections(mcore_weights_name)
        if tp_split_size > 1 and sections is not None:
            parts = [p.chunk(tp_split_size) for p in mcore_weights.split(sections)]
            return [torch.cat([p[rank] for p in parts]) for rank in range(tp_split_size)]
        if tp_split_size > 1 and mcore_weights_name.endswith(("self_attention.A_log", "self_attention.dt_bias")):
            return list(mcore_weights.chunk(tp_split_size))
        return super()._weight_split_across_tp(mcore_weights_name, mcore_weights, param, tp_split_size)

    def _weight_merge_across_tp(self, mcore_weights_name, mcore_weights, param):
        sections = self._component_sections(mcore_weights_name)
        if len(mcore_weights) > 1 and sections is not None:
            tp = len(mcore_weights)
            per_rank = [w.split([s // tp for s in sections]) for w in mcore_weights]
            return torch.cat([torch.cat([r[i] for r in per_rank]) for i in range(len(sections))])
        if len(mcore_weights) > 1 and mcore_weights_name.endswith(("self_attention.A_log", "self_attention.dt_bias")):
            return torch.cat(mcore_weights)
        return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)


class Qwen35Bridge(_Qwen3HybridBridge):
    """Qwen3.5 text models (HF ``Qwen3_5ForCausalLM``, ``model_type="qwen3_5_text"``): dense MLPs, GDN input
    projection in four matrices (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``)."""

    _GDN_IN_PROJ = [f"{_LAYER}.linear_attn.in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")]

    def _build_config(self):
        return self._build_base_config(**self._hybrid_config_args())

    def _in_proj_to_mcore(self, hf_weights):
        return torch.cat(hf_weights)  # [q | k | v], z, b, a

    def _in_proj_to_hf(self, weight):
        q, k, v, z, b, a = weight.split(self._in_proj_sections())
        return [torch.cat([q, k, v]), z, b, a]


class Qwen35MoeBridge(Qwen35Bridge):
    """Qwen3.5-MoE text models (HF ``Qwen3_5MoeForCausalLM``, ``model_type="qwen3_5_moe_text"``): Qwen3.5's layers
    with an MoE in every layer (softmax router, top-k always normalised, a sigmoid-gated shared expert)."""

    _MLP_MAPPING = {**Qwen35Bridge._MLP_MAPPING, **_MOE_MLP_MAPPING}

    def _build_config(self):
        hf = self.hf_config
        args = self._hybrid_config_args()
        args.update(_moe_args(hf, [1] * hf.num_hidden_layers, normalise_topk=True))
        return self._build_base_config(**args)


class Qwen35VLBridge(LanguageModelOf, Qwen35Bridge):
    """The language model of a published Qwen3.5 checkpoint (HF ``Qwen3_5ForConditionalGeneration``,
    ``model_type="qwen3_5"``): :class:`Qwen35Bridge` on its ``text_config`` and ``model.language_model.*`` weights;
    no vision tower (text-only prompts)."""


class Qwen35MoeVLBridge(LanguageModelOf, Qwen35MoeBridge):
    """The language model of a published Qwen3.5-MoE checkpoint (HF ``Qwen3_5MoeForConditionalGeneration``,
    ``model_type="qwen3_5_moe"``), as :class:`Qwen35VLBridge`."""


class Qwen3NextBridge(_Qwen3HybridBridge):
    """Qwen3-Next (HF ``Qwen3NextForCausalLM``, ``model_type="qwen3_next"``): MoE layers (softmax router,
    ``norm_topk_prob``, a sigmoid-gated shared expert; ``mlp_only_layers`` / ``decoder_sparse_step`` dense), GDN input
    projection grouped per key head (``in_proj_qkvz``, ``in_proj_ba``)."""

    _GDN_IN_PROJ = [f"{_LAYER}.linear_attn.in_proj_qkvz.weight", f"{_LAYER}.linear_attn.in_proj_ba.weight"]
    _MLP_MAPPING = {**_Qwen3HybridBridge._MLP_MAPPING, **_MOE_MLP_MAPPING}

    def _build_config(self):
        hf = self.hf_config
        args = self._hybrid_config_args()
        if hf.num_experts > 0:
            sparse = [int(i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0)
                      for i in range(hf.num_hidden_layers)]
            args.update(_moe_args(hf, sparse, normalise_topk=hf.norm_topk_prob))
        return self._build_base_config(**args)

    def _in_proj_to_mcore(self, hf_weights):
        c = self.config
        qkvz, ba = hf_weights
        hidden = qkvz.shape[-1]
        nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        r = c.linear_num_value_heads // nk
        q, k, v, z = qkvz.view(nk, -1, hidden).split([dk, dk, r * dv, r * dv], dim=1)
        b, a = ba.view(nk, 2 * r, hidden).split([r, r], dim=1)
        return torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)])

    def _in_proj_to_hf(self, weight):
        c = self.config
        hidden = weight.shape[-1]
        nk = c.linear_num_key_heads
        q, k, v, z, b, a = (t.reshape(nk, -1, hidden) for t in weight.split(self._in_proj_sections()))
        return [torch.cat([q, k, v, z], dim=1).reshape(-1, hidden), torch.cat([b, a], dim=1).reshape(-1, hidden)]

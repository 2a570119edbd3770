"""Model FLOPs: what a forward of a model costs per token and per attended (query, key) pair.

Counted as Megatron counts model FLOPs (``num_floating_point_operations``): two FLOPs per multiply-add of the
matrix products, a backward twice its forward, activation recompute not counted (it is not model work). Tokens
are the tokens a micro-batch computes (a prefix tree's unique tokens; padding slots excluded), pairs the (query,
key) pairs its full-attention layers compute (:func:`micro_batch_work`); a tree's FLOPs are therefore fewer than
its sequences' one by one, which is the point.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_tree.core.hf_config import attention_head_dim, attention_kv_heads

__all__ = ["ModelFlops", "micro_batch_work", "packed_work"]

GATED_ATTENTION = ("qwen3_5_text", "qwen3_next")
"""HF model types whose full-attention ``q_proj`` also computes a per-head output gate (twice the query width)."""


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of one model: ``per_token`` through every layer (everything that grows with tokens but the
    output layer), ``per_pair`` per (query, key) pair through the full-attention layers (QK^T and PV),
    ``output_per_token`` through the language-model output layer (2 h V; a value head's 2 h instead)."""

    per_token: float
    per_pair: float
    output_per_token: float
    value_head_per_token: float

    @classmethod
    def of(cls, cfg) -> ModelFlops:
        """From a Hugging Face config ``cfg`` (a multimodal one's text config: ``get_text_config()``). Layers are full attention unless ``layer_types`` says
        ``linear_attention`` (Gated DeltaNet per token: ``in_proj`` (q, k, v, output gate, beta, decay), its causal
        conv, the delta rule as a recurrence (reading the state with k and with q, the rank-one write: 3 x Hv dk dv
        multiply-adds) and ``out_proj``); multi-latent attention (``kv_lora_rank``) counts its low-rank projections,
        its pairs q/k head dim ``qk_nope + qk_rope`` and value head dim ``v_head_dim``. MoE layers count their top-k
        experts, the router and the shared experts (Qwen's gated one, or DeepSeek's / GLM's ``n_shared_experts``);
        ``mlp_only_layers`` and the first ``first_k_dense_replace`` layers are dense."""
        if hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()
        if not hasattr(cfg, "hidden_size"):
            raise TypeError(f"ModelFlops.of takes a Hugging Face model config (transformers.PretrainedConfig, e.g. "
                            f"AutoConfig.from_pretrained(path)), got {type(cfg).__name__}")
        h = cfg.hidden_size
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        linear = sum(t == "linear_attention" for t in types)
        full = len(types) - linear
        nq, nkv = cfg.num_attention_heads, attention_kv_heads(cfg)
        if getattr(cfg, "kv_lora_rank", None):  # multi-latent attention
            d_qk, d_v, rank = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            q_rank = getattr(cfg, "q_lora_rank", None)
            q = h * q_rank + q_rank * nq * d_qk if q_rank else h * nq * d_qk
            attn_proj = q + h * (rank + cfg.qk_rope_head_dim) + rank * nq * (cfg.qk_nope_head_dim + d_v) + nq * d_v * h
        else:
            d_qk = d_v = attention_head_dim(cfg)
            gate = 2 if cfg.model_type in GATED_ATTENTION else 1
            attn_proj = h * gate * nq * d_qk + 2 * h * nkv * d_qk + nq * d_qk * h
        gdn = 0
        if linear:
            qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim
            hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
            vd = hv * dv
            gdn = (h * (2 * qk + 2 * vd + 2 * hv) + cfg.linear_conv_kernel_dim * (2 * qk + vd)
                   + 3 * hv * cfg.linear_key_head_dim * dv + vd * h)
        dense = 3 * h * cfg.intermediate_size if getattr(cfg, "intermediate_size", None) else 0
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
        if experts:
            ffn = cfg.moe_intermediate_size
            shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
            moe = cfg.num_experts_per_tok * 3 * h * ffn + h * experts
            moe += (3 * h * shared + h) if shared else 0  # Qwen's shared expert and its sigmoid gate
            moe += 3 * h * ffn * (getattr(cfg, "n_shared_experts", 0) or 0)  # DeepSeek's / GLM's shared experts
            n_dense = len(getattr(cfg, "mlp_only_layers", None) or []) + (getattr(cfg, "first_k_dense_replace", 0) or 0)
            mlp = (len(types) - n_dense) * moe + n_dense * dense
        else:
            mlp = len(types) * dense
        return cls(per_token=2.0 * (full * attn_proj + linear * gdn + mlp), per_pair=2.0 * nq * (d_qk + d_v) * full,
                   output_per_token=2.0 * h * cfg.vocab_size, value_head_per_token=2.0 * h)

    def forward(self, tokens: float, pairs: float, *, value_head: bool = False) -> float:
        """FLOPs of one forward over ``tokens`` tokens and ``pairs`` attended pairs; ``value_head``: the model ends in
        a value head (critic, reward model), not the language-model output layer."""
        head = self.value_head_per_token if value_head else self.output_per_token
        return (self.per_token + head) * tokens + self.per_pair * pairs


def micro_batch_work(mb) -> tuple[int, int]:
    """(tokens, attended (query, key) pairs) a micro-batch (:class:`~megatron_tree.core.microbatch.TreeMicroBatch`)
    computes, padding slots excluded: key j of a tree is seen by the queries ``[j, subtree_end[j])``; a chunk's
    queries also see its context keys (``context_mask``: its first C entries are the context)."""
    n = mb.num_tokens
    if mb.context_mask is None:
        end = mb.attention_mask[0, :n].long()
        return n, int((end - torch.arange(n, device=end.device)).sum())
    c = mb.context_mask.shape[1] - mb.num_slots
    end = mb.context_mask[0, : c + n].long().clamp(max=c + n)
    return n, int((end - torch.arange(c + n, device=end.device).clamp(min=c)).sum())


def packed_work(mbs) -> tuple[int, int]:
    """(tokens, attended pairs) of the micro-batches ``mbs`` together (:func:`micro_batch_work`, summed)."""
    work = [micro_batch_work(mb) for mb in mbs]
    return sum(t for t, _ in work), sum(p for _, p in work)

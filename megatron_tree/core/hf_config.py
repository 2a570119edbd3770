"""What a Hugging Face model config says about attention, read the same way everywhere."""

from __future__ import annotations

__all__ = ["attention_head_dim", "attention_kv_heads"]


def attention_head_dim(hf_config) -> int:
    """The attention head dim of a Hugging Face (text) config: its ``head_dim`` where set (Qwen3, Gemma 3: not
    hidden / heads), else ``hidden_size // num_attention_heads`` (Llama, Qwen2)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def attention_kv_heads(hf_config) -> int:
    """The key / value heads of a Hugging Face (text) config: ``num_key_value_heads`` where set (GQA), else the query
    heads (multi-head attention)."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads

"""What a Hugging Face model config says about attention, read the same way everywhere."""

from __future__ import annotations

__all__ = ["attention_head_dim"]


def attention_head_dim(hf_config) -> int:
    """The attention head dim of a Hugging Face (text) config: its ``head_dim`` where set (Qwen3, Gemma 3: not
    hidden / heads), else ``hidden_size // num_attention_heads`` (Llama, Qwen2)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads

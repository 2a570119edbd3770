"""A self-attention layer with a RoPE table of its own: models whose layers rotate with different bases.

Gemma 3's local (sliding-window) layers rotate queries and keys with base 10k, its global layers with 1M (and a
linear position scaling). megatron-core's ``GPTModel`` builds one table, ``[S, 1, 1, D]``, and hands it to every
layer. :class:`LayerRopeSelfAttention` is megatron-core's ``SelfAttention`` that replaces the table it is handed
by one from its own ``RotaryEmbedding`` (same kv channels, interleaving and context-parallel group as the model's,
its own base), built for the same positions each call. Layers built as plain ``SelfAttention`` keep the model's.

Tree models: :func:`megatron_tree.mcore.rope.convert_to_tree_model` wraps this layer's ``rotary_pos_emb`` as it
wraps the model's (:class:`~megatron_tree.mcore.rope.TreeRotaryEmbedding`, fed the micro-batch's depths through
the attention mask, as for multi-latent attention), so both bases rotate by depth.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention

__all__ = ["LayerRopeSelfAttention"]


class LayerRopeSelfAttention(SelfAttention):
    """``SelfAttention`` rotating with its own RoPE table: base ``rotary_base``, on ``rotary_percent`` of each head,
    positions divided by ``seq_len_interpolation_factor`` (None: not scaled; Hugging Face's ``rope_type="linear"``).

    Built from a layer spec like ``SelfAttention`` (``ModuleSpec(LayerRopeSelfAttention, params={"rotary_base":
    ...})``); called like it. When the model passes a table (``rotary_pos_emb``), the layer uses its own for the
    same sequence length instead; without one (no RoPE) it passes none. megatron-core's inference RoPE paths that
    hand cos / sin tables (flash decode, flashinfer) are refused.
    """

    def __init__(self, config, submodules, layer_number: int, *args: Any, rotary_base: float,
                 rotary_percent: float = 1.0, seq_len_interpolation_factor: float | None = None, **kwargs: Any):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if config.multi_latent_attention:
            raise ValueError("LayerRopeSelfAttention is a standard self-attention; multi-latent attention has its "
                             "own per-layer RoPE (MLASelfAttention)")
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=config.rotary_interleaved,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=self.pg_collection.cp,
        )

    def forward(self, hidden_states, attention_mask, *, rotary_pos_emb=None, packed_seq_params=None,
                inference_context=None, **kwargs: Any):
        """``SelfAttention.forward`` with the layer's own table in place of ``rotary_pos_emb``."""
        if any(kwargs.get(k) is not None for k in ("rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")):
            raise ValueError(
                "LayerRopeSelfAttention got precomputed RoPE cos / sin tables (megatron-core's flash-decode or "
                "flashinfer inference), built with the model's RoPE base, not this layer's; run without flash_decode "
                "/ flashinfer RoPE"
            )
        if rotary_pos_emb is not None:
            seq_len = self.rotary_pos_emb.get_rotary_seq_len(
                inference_context, None, hidden_states, self.config, packed_seq_params
            )
            packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
            rotary_pos_emb = self.rotary_pos_emb(seq_len, packed_seq=packed)
        return super().forward(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb,
                               packed_seq_params=packed_seq_params, inference_context=inference_context, **kwargs)

"""Megatron's ``core_attention`` over a tree micro-batch: :class:`TreeCoreAttention` (and its TE-spec twin).

Shape legend: s = slots, b = batch (1 for a tree micro-batch), np / ng = query / key-value heads per TP
rank, hn = q / k head dim, hv = value head dim (= hn except under multi-latent attention). The module
calls :func:`megatron_tree.attention.tree_attention` with the
backend named in its layer spec (``"auto"`` by default), and with the layer's sliding window
(:func:`layer_window`) if it has one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_tree.attention import get_tree_attention_backend, tree_attention
from megatron_tree.attention.shapes import AttentionShape, device_generation
from megatron_tree.mcore.chunk_context import chunk_link

__all__ = ["TreeCoreAttention", "TreeCoreAttentionTE", "check_tree_attention_config", "layer_window"]


def _window_problem(window_size: Any) -> str | None:
    """Why megatron-core's ``window_size`` has no tree equivalent, None when it has one."""
    if window_size is None:
        return None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
        isinstance(w, int) and not isinstance(w, bool) for w in window_size
    ):
        return f"window_size={window_size!r} (megatron-core's sliding window is a pair of ints (left, right))"
    if window_size[1] not in (0, -1):
        return (f"window_size={tuple(window_size)} (a right window > 0 lets a query see later tokens; tree attention is "
                f"causal: use (left, 0))")
    if window_size[0] < -1:
        return f"window_size={tuple(window_size)} (left must be >= 0, or -1 for no limit)"
    return None


def layer_window(config: TransformerConfig, layer_number: int) -> int | None:
    """The sliding window of layer ``layer_number`` (1-based, global) in tree terms, None for full attention.

    megatron-core's ``window_size=(left, 0)`` lets query i see keys ``i - left .. i``: ``window = left + 1``
    path tokens (Hugging Face's ``sliding_window``: ``i - j < window``). ``left = -1`` is no limit. Which
    layers are windowed follows ``window_attn_skip_freq`` as megatron-core's ``is_layer_window_attention``
    (an int N: every N-th layer is full; a list: 1 = windowed, per layer).
    """
    problem = _window_problem(config.window_size)
    if problem is not None:
        raise ValueError(f"tree attention does not support: {problem}")
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left = config.window_size[0]
    return None if left < 0 else left + 1


def check_tree_attention_config(config: TransformerConfig) -> None:
    """Raise if ``config`` asks for an attention feature tree attention does not implement."""
    problems = []
    window_problem = _window_problem(config.window_size)
    if window_problem is not None:
        problems.append(window_problem)
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax_type={config.softmax_type!r} (only 'vanilla')")
    if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
        problems.append("qk_clip / log_max_attention_logit (max attention logits are not tracked)")
    if problems:
        raise ValueError("tree attention does not support: " + "; ".join(problems))


def _model_attention_shape(config: TransformerConfig, windowed: bool = False) -> AttentionShape:
    """The :class:`AttentionShape` of a model's attention calls (per TP rank the GQA ratio is the same);
    ``windowed``: the layer's sliding window."""
    dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    device = device_generation(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if config.multi_latent_attention:  # one key and value per query head; q / k carry the RoPE part too
        return AttentionShape(config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim, 1, dtype, device,
                              windowed)
    ratio = config.num_attention_heads // (config.num_query_groups or config.num_attention_heads)
    return AttentionShape(config.kv_channels, config.kv_channels, ratio, dtype, device, windowed)


class TreeCoreAttention(MegatronModule):
    """Megatron ``core_attention`` module for tree micro-batches.

    Built by ``SelfAttention`` through the layer spec (see :func:`megatron_tree.tree_layer_spec`)
    with the standard keywords; ``backend`` (a registered name, default ``"auto"``) comes from
    the spec's params. Called as ``(query [s, b, np, hn], key [s, b, ng, hn], value [s, b, ng, hv],
    attention_mask int [b, s], *, attn_mask_type, attention_bias=None, packed_seq_params=None)``, returns
    ``[s, b, np * hv]``. Scale: ``softmax_scale`` (multi-latent attention passes its YaRN-scaled one) or
    ``1 / sqrt(kv_channels)``. Attention dropout
    (``attention_dropout`` or ``config.attention_dropout``) applies in training mode only. Sliding window:
    ``self.window`` = :func:`layer_window` (``config.window_size`` / ``window_attn_skip_freq``, this layer), the
    tree mask limited to the ``window`` path tokens above each query.

    ``positions_from_ids`` starts False and the forward refuses to run until it is True:
    upstream RoPE rotates slot i as position i, which is wrong for every branch laid out after a
    sibling. :func:`megatron_tree.convert_to_tree_model` sets it once the model's RoPE reads
    ``position_ids``; set it yourself only when queries and keys already carry tree positions.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        backend: str = "auto",
        **kwargs: Any,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(
                f"TreeCoreAttention supports self-attention only, got attention_type="
                f"{attention_type!r}; keep the upstream core attention for cross-attention"
            )
        if attn_mask_type != AttnMaskType.arbitrary:
            raise ValueError(
                f"TreeCoreAttention must be built with attn_mask_type=AttnMaskType.arbitrary, got "
                f"{attn_mask_type}; build the layer spec with megatron_tree.tree_layer_spec"
            )
        check_tree_attention_config(config)
        self.backend = get_tree_attention_backend(backend).name
        self.layer_number = layer_number
        self.window = layer_window(config, layer_number)
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if self.backend != "auto":  # a named backend says at build time what its first call would
            shape = _model_attention_shape(config, windowed=self.window is not None)
            impl = get_tree_attention_backend(self.backend)
            reason = impl.refusal(shape, batch=1, dropout_p=self.dropout_p)
            if reason is None and self.window is not None and not impl.windowed:
                reason = f"the {self.backend} backend takes no sliding window"
            if reason is not None:
                raise ValueError(
                    f"tree attention backend {self.backend!r} cannot run this model's attention ({shape}): {reason}. "
                    f"Use backend='auto' (the fastest backend proven on each call) or 'dense'"
                )
        self.positions_from_ids = False
        # Context parallel: megatron-core hands its groups in pg_collection (else the global state).
        cp_group = getattr(pg_collection, "cp", None)
        if cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
            if cp_group is None:
                raise ValueError(
                    f"context_parallel_size={config.context_parallel_size} but there is no context-parallel group: "
                    f"initialise megatron's parallel state with context_parallel_size={config.context_parallel_size} "
                    f"before building the model (or pass pg_collection)"
                )
        multi = cp_group is not None and torch.distributed.get_world_size(cp_group) > 1
        self.cp_group = cp_group if multi else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """query [s, b, np, hn], key [s, b, ng, hn], value [s, b, ng, hv], attention_mask int [b, s] -> [s, b, np*hv]."""
        if packed_seq_params is not None:
            raise ValueError(
                "TreeCoreAttention got packed_seq_params: tree micro-batches are one packed row "
                "described by attention_mask; call the model with packed_seq_params=None"
            )
        if attention_bias is not None:
            raise ValueError("TreeCoreAttention does not support attention_bias; pass None")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.arbitrary:
            raise ValueError(
                f"TreeCoreAttention got attn_mask_type={attn_mask_type}; the tree mask is "
                f"arbitrary (build the layer spec with megatron_tree.tree_layer_spec)"
            )
        if not self.positions_from_ids:
            raise RuntimeError(
                "TreeCoreAttention runs only in a model whose RoPE rotates by position_ids: call "
                "megatron_tree.convert_to_tree_model(model) after building it (building under "
                "patch_bridge_for_tree_training does this)"
            )
        if attention_mask is None:
            raise ValueError(
                "TreeCoreAttention got attention_mask=None but needs attention_mask = the micro-batch's "
                "interval vector (TreeMicroBatch.attention_mask, int32 [1, s]), without which the tree's "
                "branches would see each other; call model(mb.input_ids, mb.position_ids, mb.attention_mask)"
            )
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Like DotProductAttention: TP ranks hold different heads, so use the TP-rank RNG.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self._attend(query, key, value, attention_mask, dropout_p)
        return self._attend(query, key, value, attention_mask, dropout_p)

    def _attend(self, query, key, value, attention_mask, dropout_p):
        # A chunk of a tree larger than a micro-batch (megatron_tree.mcore.chunk_context): its context's keys
        # and values, kept by earlier chunks, go in front of its own.
        link = chunk_link(attention_mask)
        if link is not None:
            key, value = link.keys_and_values(self.layer_number, key, value)
        return tree_attention(
            query,
            key,
            value,
            attention_mask,
            scale=self.softmax_scale,
            dropout_p=dropout_p,
            backend=self.backend,
            cp_group=self.cp_group,
            window=self.window,
            context=0 if link is None else link.context_len,
        )


class TreeCoreAttentionTE(TreeCoreAttention):
    """:class:`TreeCoreAttention` in place of Transformer Engine's ``TEDotProductAttention``.

    TE modules keep FP8 scaling state as ``_extra_state``, so TE-spec torch state dicts hold
    ``...core_attention._extra_state``. This module keeps that entry, empty (what TE writes
    without FP8), and like megatron-core's ``TEDotProductAttention`` puts nothing into distributed
    checkpoints: checkpoints move both ways between a tree model and the upstream TE model with
    strict loading. Loaded FP8 attention state is dropped: tree
    attention runs no FP8 kernel.
    """

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Empty, as megatron-core's ``TEDotProductAttention`` with vanilla softmax writes nothing to
        distributed checkpoints (its ``_extra_state`` goes only into torch state dicts)."""
        return {}

    def set_extra_state(self, state: Any) -> None:
        return None

"""Per-token RoPE: make a built ``GPTModel`` rotate every slot by its ``position_ids`` (depth).

Shape legend: b = batch (1 for a tree micro-batch), S = slots (full sequence length, before any
sequence-parallel split), D = rotary dim.

Upstream ``GPTModel`` (position_embedding_type "rope" or "yarn", megatron-core 0.16–0.19) asks
its ``rotary_pos_emb`` module for a table ``[S, 1, 1, D]`` of angles for positions ``0..S-1`` and
never reads ``position_ids``. In a DFS tree layout slot i is not position i: a branch laid out
after its sibling would be rotated as if it continued the sibling. :func:`convert_to_tree_model`
swaps that module for :class:`TreeRotaryEmbedding`, which builds the same table with the
upstream module (so rope scaling, ``seq_len_interpolation_factor``, YaRN and interleaving stay
the upstream code) and gathers row ``position_ids[b, i]`` for slot i: ``[S, b, 1, D]``. The
fused (Transformer Engine) RoPE kernel reads row s of a ``[S, 1, 1, D]`` table for slot s, so
the gathered table serves it unchanged when b == 1.

Multi-latent attention (DeepSeek-V3) has no model-level table: each ``MLASelfAttention`` asks its own
``rotary_pos_emb`` (``RotaryEmbedding``, or ``YarnRotaryEmbedding`` returning ``(table, mscale)``) for
positions ``0..S-1`` inside its forward. So does a
:class:`~megatron_tree.mcore.layer_rope.LayerRopeSelfAttention` (a layer with its own RoPE base: Gemma 3's local
layers), in place of the model's table. Each of those is wrapped the same way, so the decoupled RoPE part of MLA's
queries and shared key, and every layer's own RoPE base, rotate by depth too.

A forward pre-hook on each ``GPTModel`` hands ``position_ids`` to its wrapped modules for the duration
of the forward; every pipeline stage and model chunk is a ``GPTModel`` of its own and gets one.

Context parallel: each rank holds S / cp slots (:mod:`megatron_tree.core.context_parallel`), and
``position_ids [b, S / cp]`` are their depths. The upstream module would cut its table into the
rank's causal zig-zag chunks; here it builds the whole ``[S, 1, 1, D]`` table (depths are < S)
and the gather picks each local slot's row.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any, Iterable

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

from megatron_tree.mcore.chunk_context import chunk_link
from megatron_tree.mcore.core_attention import TreeCoreAttention
from megatron_tree.mcore.layer_rope import LayerRopeSelfAttention
from megatron_tree.mcore.router_stats import weigh_router_statistics
from megatron_tree.mcore.vision_language import VisionLanguageModel

__all__ = ["LAYER_ROPE_ATTENTIONS", "TreeRotaryEmbedding", "convert_to_tree_model", "enable_tree_rope"]

LAYER_ROPE_ATTENTIONS = (MultiLatentAttention, LayerRopeSelfAttention)
"""Attention layers that build their own RoPE table (``rotary_pos_emb``) inside their forward."""


class _OneRank:
    """Stands in for the CP group so the upstream module returns the table uncut."""

    @staticmethod
    def size() -> int:
        return 1


class TreeRotaryEmbedding(torch.nn.Module):
    """Drop-in for ``GPTModel.rotary_pos_emb`` (or an attention layer's own) that returns the table gathered at
    ``position_ids``.

    ``inner`` is the upstream ``RotaryEmbedding`` (or a subclass such as YaRN's). Call
    contract is upstream's: ``forward(max_seq_len, offset=0, packed_seq=False, cp_group=None)``
    returns what ``inner`` returns, with the ``[S, 1, 1, D]`` table replaced by
    ``[S, b, 1, D]`` = row ``position_ids[b, s]`` of the table for slot s. Positions must be
    ``< S`` (a token's depth is at most its DFS slot index). Under context parallel
    (``context_parallel_size`` > 1) ``max_seq_len`` is the whole micro-batch's S, ``position_ids``
    the rank's ``[b, S / cp]``, and the result ``[S / cp, b, 1, D]``.
    """

    def __init__(self, inner: RotaryEmbedding, *, apply_rope_fusion: bool, context_parallel_size: int = 1):
        super().__init__()
        self.inner = inner
        self.apply_rope_fusion = apply_rope_fusion
        self.context_parallel_size = context_parallel_size
        self.position_ids: torch.Tensor | None = None
        self.table_rows = 0  # a chunk of a larger tree: its depths reach C + S - 1 (C context slots above it)

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        """Upstream ``get_rotary_seq_len``: S, the full sequence length of this forward."""
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(
        self,
        max_seq_len: int,
        offset: int = 0,
        packed_seq: bool = False,
        cp_group: torch.distributed.ProcessGroup | None = None,
    ):
        """The upstream table for ``0..max_seq_len-1``, gathered at the captured ``position_ids``."""
        pos = self.position_ids
        cp = self.context_parallel_size
        if pos is None:
            return self.inner(max_seq_len, offset, packed_seq, cp_group)
        rows = max(max_seq_len, self.table_rows)
        out = self.inner(rows, offset, packed_seq, _OneRank() if cp > 1 else cp_group)
        table, *rest = out if isinstance(out, tuple) else (out,)
        if pos.dim() != 2 or pos.shape[1] * cp != max_seq_len:
            raise ValueError(
                f"position_ids has shape {tuple(pos.shape)} but RoPE is built for "
                f"{max_seq_len // cp} slots{f' per context-parallel rank' if cp > 1 else ''}; pass position_ids "
                f"[b, {max_seq_len // cp}] ({'ContextParallelShard' if cp > 1 else 'TreeMicroBatch'}.position_ids) "
                f"to the model"
            )
        if pos.shape[0] > 1 and self.apply_rope_fusion:
            raise ValueError(
                f"fused RoPE takes one table for the whole batch, but position_ids has batch "
                f"{pos.shape[0]}; use batch 1 (tree micro-batches are [1, S]) or set "
                f"apply_rope_fusion=False"
            )
        # table [S, 1, 1, D] -> rows [S, D] -> gathered [S, b, D] -> [S, b, 1, D]
        gathered = table[:, 0, 0, :][pos.t().to(table.device)].unsqueeze(2)
        return (gathered, *rest) if isinstance(out, tuple) else gathered

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written before the swap may hold upstream's `rotary_pos_emb.inv_freq`,
        # which upstream drops on load; drop it here too.
        state_dict.pop(f"{prefix}inv_freq", None)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _gpt_models(model: torch.nn.Module | Iterable[torch.nn.Module]) -> list[GPTModel]:
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(
                f"convert_to_tree_model takes a module or a list of model chunks, got an element of "
                f"type {type(chunk).__name__}"
            )
    found = [m for chunk in chunks for m in chunk.modules() if isinstance(m, GPTModel)]
    if not found:
        raise TypeError(
            f"convert_to_tree_model found no megatron.core GPTModel in "
            f"{[type(c).__name__ for c in chunks]}"
        )
    return found


def _layer_ropes(gpt: GPTModel) -> list[torch.nn.Module]:
    """The attention layers of ``gpt`` with their own RoPE (:data:`LAYER_ROPE_ATTENTIONS`)."""
    return [m for m in gpt.modules() if isinstance(m, LAYER_ROPE_ATTENTIONS)]


def _check_supported(gpt: GPTModel) -> None:
    config = gpt.config
    if config.multi_latent_attention and config.apply_rope_fusion:
        raise ValueError(
            "tree RoPE does not support multi-latent attention with apply_rope_fusion=True (the fused MLA kernel "
            "reads cos / sin by packed index); build with apply_rope_fusion=False"
        )
    layers = _layer_ropes(gpt)
    if layers and config.context_parallel_size > 1:
        raise ValueError(
            f"tree training has not been verified for attention layers with their own RoPE "
            f"({type(layers[0]).__name__}: multi-latent attention, Gemma 3's local layers) under context parallel "
            f"(size {config.context_parallel_size}); use context_parallel_size=1"
        )
    for layer in layers:
        if not isinstance(layer.rotary_pos_emb, RotaryEmbedding | TreeRotaryEmbedding):
            raise TypeError(
                f"tree RoPE wraps megatron.core RotaryEmbedding, but a {type(layer).__name__} layer's rotary_pos_emb "
                f"is {type(layer.rotary_pos_emb).__name__}"
            )
    if getattr(gpt, "mtp_process", False):
        raise ValueError(
            "tree training does not support multi-token prediction (MTP shifts input_ids by one "
            "slot, which is not the next token at branch points); build the model without MTP"
        )
    if gpt.position_embedding_type == "mrope" and not isinstance(gpt, VisionLanguageModel):
        raise ValueError(
            "tree RoPE supports position_embedding_type='mrope' only in a vision-language model (a "
            "VisionLanguageModel, fed VisionMicroBatch.mrope_position_ids): plain tree micro-batches carry 1-D "
            "depths; build a Qwen2.5-VL checkpoint with build_tree_model"
        )
    if _model_rope(gpt) and not isinstance(gpt.rotary_pos_emb, RotaryEmbedding | TreeRotaryEmbedding):
        raise TypeError(
            f"tree RoPE wraps megatron.core RotaryEmbedding, but this GPTModel's "
            f"rotary_pos_emb is {type(gpt.rotary_pos_emb).__name__}"
        )


def _model_rope(gpt: GPTModel) -> bool:
    """Whether ``gpt`` builds a model-level RoPE table (MLA builds one per attention layer instead)."""
    return gpt.position_embedding_type in ("rope", "yarn") and not gpt.config.multi_latent_attention


# Depths of the tree micro-batches in flight, keyed (weakly) on their attention mask's storage. Multi-latent
# attention (and LayerRopeSelfAttention) builds its RoPE table inside each layer, in the forward and again in
# activation recompute (after the model's forward returned); the mask is what megatron hands the layer both times
# (recompute saves it; its detached copy shares the storage). The entry goes with the mask, after the backward.
# The interval vector determines the depths, so micro-batches sharing a mask share them too.
_DEPTHS: "weakref.WeakKeyDictionary[torch.UntypedStorage, torch.Tensor]" = weakref.WeakKeyDictionary()


def _is_tree_mask(mask: Any) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dtype in (torch.int32, torch.int64)


def _tree_rope(inner: RotaryEmbedding, gpt: GPTModel) -> TreeRotaryEmbedding:
    return TreeRotaryEmbedding(
        inner, apply_rope_fusion=gpt.config.apply_rope_fusion, context_parallel_size=gpt.config.context_parallel_size
    )


def _wrap_rotary(gpt: GPTModel) -> None:
    """Swap in :class:`TreeRotaryEmbedding` (the model's, each attention layer's own) and hand them
    ``position_ids``: the model's around each forward, a layer's around each of its calls (recompute included),
    looked up by the attention mask it is called with."""
    rope = None
    if _model_rope(gpt):
        rope = gpt.rotary_pos_emb = _tree_rope(gpt.rotary_pos_emb, gpt)
    layers = _layer_ropes(gpt)
    for layer in layers:
        layer.rotary_pos_emb = _tree_rope(layer.rotary_pos_emb, gpt)
        _feed_from_mask(layer)
    if rope is None and not layers:
        return
    signature = inspect.signature(gpt.forward)

    def capture(module, args, kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        if any(bound.get(k) is not None for k in ("inference_context", "inference_params")):
            raise ValueError(
                "tree RoPE does not support KV-cache inference (inference_context); score "
                "tree micro-batches with inference_context=None"
            )
        if bound.get("packed_seq_params") is not None:
            raise ValueError(
                "tree RoPE does not take packed_seq_params: a tree micro-batch is one packed row whose "
                "layout is in attention_mask (the interval vector) and position_ids (the depths); call "
                "the model with packed_seq_params=None"
            )
        pos, mask = bound.get("position_ids"), bound.get("attention_mask")
        if pos is None and _is_tree_mask(mask):
            raise ValueError(
                "the model got a tree attention_mask but position_ids=None: pass "
                "TreeMicroBatch.position_ids (the depth of each slot) on every pipeline stage"
            )
        if layers and _is_tree_mask(mask):
            _DEPTHS[mask.untyped_storage()] = pos
        if rope is not None:
            rope.position_ids = pos
            rope.table_rows = _table_rows(mask)

    gpt.register_forward_pre_hook(capture, with_kwargs=True)
    if rope is not None:
        gpt.register_forward_hook(lambda *_: _release(rope), with_kwargs=True, always_call=True)


def _feed_from_mask(layer: torch.nn.Module) -> None:
    """Around each call of attention ``layer`` (forward and recompute), give its RoPE the depths of the tree mask it
    gets."""
    rope, signature = layer.rotary_pos_emb, inspect.signature(layer.forward)

    def capture(module, args, kwargs):
        mask = signature.bind(*args, **kwargs).arguments.get("attention_mask")
        rope.position_ids = _DEPTHS.get(mask.untyped_storage()) if _is_tree_mask(mask) else None
        rope.table_rows = _table_rows(mask)
        if rope.position_ids is None and _is_tree_mask(mask):
            raise ValueError(
                f"a {type(layer).__name__} layer got a tree attention_mask its model was not called with: "
                "call the GPTModel (model(input_ids, position_ids, attention_mask)), not its layers"
            )

    layer.register_forward_pre_hook(capture, with_kwargs=True)
    layer.register_forward_hook(lambda *_: _release(rope), with_kwargs=True, always_call=True)


def _table_rows(mask: Any) -> int:
    """Rows the RoPE table needs beyond the slots: a chunk's ``context_mask`` [1, C + S] (its depths are < C + S)."""
    return mask.shape[-1] if _is_tree_mask(mask) and chunk_link(mask) is not None else 0


def _release(rope: TreeRotaryEmbedding) -> None:
    rope.position_ids = None
    rope.table_rows = 0


def _converted(gpt: GPTModel) -> bool:
    if _model_rope(gpt):
        return isinstance(gpt.rotary_pos_emb, TreeRotaryEmbedding)
    return any(isinstance(layer.rotary_pos_emb, TreeRotaryEmbedding) for layer in _layer_ropes(gpt))


def _install(gpt: GPTModel) -> None:
    _check_supported(gpt)
    if not _converted(gpt):
        _wrap_rotary(gpt)
    # learned_absolute already embeds position_ids; "none" has no positions: both are correct.
    for module in gpt.modules():
        if isinstance(module, TreeCoreAttention):
            module.positions_from_ids = True
    weigh_router_statistics(gpt)


def convert_to_tree_model(model: torch.nn.Module | Iterable[torch.nn.Module]):
    """Finish making ``model`` a tree model, in place; returns ``model``: every ``GPTModel`` in it rotates
    slots by ``position_ids`` (depths), its tree attention is marked as fed those positions, and its MoE
    routers count each slot once per sequence through it. (The layer spec's tree attention comes first:
    :func:`megatron_tree.tree_layer_spec`; :func:`megatron_tree.build_tree_model` does both.)

    ``model``: a ``GPTModel``, a wrapper holding one (DDP, Float16Module), or the list of model
    chunks ``get_model`` returns (pipeline stages, virtual stages). Idempotent. After it, the
    models' forward needs ``position_ids [b, S]`` whenever ``attention_mask`` is a tree interval
    vector; with ``position_ids=None`` on a plain batch, RoPE stays upstream's ``0..S-1``.
    Also marks the models' :class:`TreeCoreAttention` modules as fed correct positions (they
    refuse to run otherwise), and makes their MoE routers count each slot once per sequence
    through it (:func:`megatron_tree.mcore.router_stats.weigh_router_statistics`). Attention layers with a RoPE
    of their own (multi-latent attention, :class:`~megatron_tree.mcore.layer_rope.LayerRopeSelfAttention`) get their
    own per-token RoPE. Raises for mrope, multi-token prediction, MoE token dropping, MLA with fused RoPE, and
    layers with their own RoPE under context parallel.
    """
    for gpt in _gpt_models(model):
        _install(gpt)
    return model


def enable_tree_rope(model: torch.nn.Module | Iterable[torch.nn.Module]):
    """Deprecated name of :func:`convert_to_tree_model` (it converts more than RoPE)."""
    warnings.warn("megatron_tree.enable_tree_rope is now megatron_tree.convert_to_tree_model", DeprecationWarning,
                  stacklevel=2)
    return convert_to_tree_model(model)

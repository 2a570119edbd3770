"""Tree attention without Megatron: the backend registry and dispatch, one module per kernel.

Layer: imports :mod:`megatron_tree.core` only (and the optional kernels: FlexAttention, flash-attn-4,
Transformer Engine). The Megatron ``core_attention`` module built on it is
:class:`megatron_tree.mcore.core_attention.TreeCoreAttention`.

- :mod:`~megatron_tree.attention.dispatch`: :func:`tree_attention`, the registry, the per-micro-batch mask cache.
- :mod:`~megatron_tree.attention.shapes`: the shapes each backend is proven exact on (``PROVEN`` tables).
- :mod:`~megatron_tree.attention.conformance`: the GPU check that proves them.
- :mod:`~megatron_tree.attention.availability`: whether an optional kernel package runs here (pinned release, GPU).
- :mod:`~megatron_tree.attention.dense`, :mod:`~megatron_tree.attention.flex`, :mod:`~megatron_tree.attention.fa4`
  (with :mod:`~megatron_tree.attention.fa4_kernels`), :mod:`~megatron_tree.attention.cudnn_flex` (with
  :mod:`~megatron_tree.attention.cudnn_flex_kernels`), :mod:`~megatron_tree.attention.te_chains`: the backends.
"""

import warnings

from megatron_tree.attention.dispatch import (
    PREPARED_MASKS,
    TreeAttentionBackend,
    backend_names,
    get_tree_attention_backend,
    register_tree_attention_backend,
    tree_attention,
)
from megatron_tree.attention.shapes import AttentionShape, ProvenShapes

__all__ = [
    "PREPARED_MASKS",
    "AttentionShape",
    "ProvenShapes",
    "TreeAttentionBackend",
    "backend_names",
    "get_tree_attention_backend",
    "register_tree_attention_backend",
    "tree_attention",
]

_MOVED_TO_MCORE = ("TreeCoreAttention", "TreeCoreAttentionTE", "check_tree_attention_config")


def __getattr__(name: str):
    if name in _MOVED_TO_MCORE:
        from megatron_tree.mcore import core_attention

        warnings.warn(f"megatron_tree.attention.{name} moved to megatron_tree.mcore.core_attention.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(core_attention, name)
    raise AttributeError(f"module 'megatron_tree.attention' has no attribute {name!r}")

"""Linear-attention (recurrent) layers on trees: Gated DeltaNet's causal conv and gated delta rule.

Layer: torch and numpy only, imports :mod:`megatron_tree.core` at most (no Megatron); flash-linear-attention
(``fla``) is an optional kernel, used on CUDA where it imports.

- :mod:`~megatron_tree.linear_attention.scan_layout`: :func:`tree_scan_layout` -> :class:`TreeScanLayout`
  (parents, conv ancestors, single-child segments, levels), once per micro-batch; :func:`packed_scan_layout`:
  the same for sequences packed in one row (THD ``cu_seqlens``), so the flat baseline runs the tree's kernels.
- :mod:`~megatron_tree.linear_attention.causal_conv`: :func:`tree_causal_conv1d`, :func:`tree_conv_windows` (what
  a chunk of a larger tree hands the next).
- :mod:`~megatron_tree.linear_attention.chunked_delta_rule`: :func:`chunk_gated_delta_rule` (fla's
  semantics; PyTorch chunked path, fla on CUDA).
- :mod:`~megatron_tree.linear_attention.tree_delta_rule`: :func:`tree_gated_delta_rule`, one
  chunked call per level.
- :func:`compute_dtype`: what the PyTorch paths compute in (fp64 for fp64 inputs, the exactness checks; else fp32).
"""

from megatron_tree.linear_attention.checks import compute_dtype
from megatron_tree.linear_attention.causal_conv import tree_causal_conv1d, tree_conv_windows
from megatron_tree.linear_attention.chunked_delta_rule import chunk_gated_delta_rule
from megatron_tree.linear_attention.scan_layout import TreeScanLayout, packed_scan_layout, tree_scan_layout
from megatron_tree.linear_attention.tree_delta_rule import tree_gated_delta_rule

__all__ = [
    "TreeScanLayout",
    "chunk_gated_delta_rule",
    "compute_dtype",
    "packed_scan_layout",
    "tree_causal_conv1d",
    "tree_conv_windows",
    "tree_gated_delta_rule",
    "tree_scan_layout",
]

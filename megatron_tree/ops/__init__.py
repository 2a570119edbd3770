"""Per-sequence results from tree-packed outputs: log-probs (vocab-parallel), values, scores, RL losses.

Layer: torch only (process groups are arguments); imports :mod:`megatron_tree.core`.
"""

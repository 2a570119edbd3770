"""megatron_tree: tree training for Megatron-LM.

Pack sequences that share prefixes into prefix trees, compute every shared token once,
and get exact per-sequence log-probabilities and gradients.
"""

from megatron_tree.balance import balance_across_ranks
from megatron_tree.metrics import BalanceStats, PackingStats
from megatron_tree.microbatch import TreeMicroBatch
from megatron_tree.microbatch_spec import MicroBatchSpec
from megatron_tree.packing import pack_trees
from megatron_tree.tree import TokenForest, build_forest

__all__ = [
    "BalanceStats",
    "MicroBatchSpec",
    "PackingStats",
    "TokenForest",
    "TreeMicroBatch",
    "balance_across_ranks",
    "build_forest",
    "pack_trees",
]

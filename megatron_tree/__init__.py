"""megatron_tree: tree training for Megatron-LM.

Pack sequences that share prefixes into prefix trees, compute every shared token once,
and get exact per-sequence log-probabilities and gradients.
"""

from megatron_tree.microbatch import TreeMicroBatch
from megatron_tree.microbatch_spec import MicroBatchSpec
from megatron_tree.packing import pack_trees
from megatron_tree.tree import TokenForest, build_forest

__all__ = ["MicroBatchSpec", "TokenForest", "TreeMicroBatch", "build_forest", "pack_trees"]

"""megatron_tree: tree training for Megatron-LM.

Pack sequences that share prefixes into prefix trees, compute every shared token once,
and get exact per-sequence log-probabilities and gradients.

The data model, packing and log-prob gather import no Megatron. The Megatron adapters
(``build_tree_model``, ``patch_bridge_for_tree_training``, ``tree_layer_spec``, ``enable_tree_rope``,
``tree_forward_backward``, ``flat_forward_backward``, ``tree_forward_only``, ``check_tree_model``, ``verify_tree_model``) import megatron-core when
first used.
"""

from importlib import import_module

from megatron_tree.balance import balance_across_ranks
from megatron_tree.context_parallel import ContextParallelShard, shard_micro_batch
from megatron_tree.logprobs import gather_tree_logprobs
from megatron_tree.metrics import BalanceStats, PackingStats
from megatron_tree.microbatch import TreeMicroBatch
from megatron_tree.microbatch_spec import MicroBatchSpec
from megatron_tree.packing import pack_trees
from megatron_tree.tree import TokenForest, build_forest
from megatron_tree.values import gather_tree_scores, gather_tree_values

_MEGATRON_ADAPTERS = {
    "build_tree_model": "megatron_tree.bridge",
    "patch_bridge_for_tree_training": "megatron_tree.bridge",
    "tree_layer_spec": "megatron_tree.layer_spec",
    "enable_tree_rope": "megatron_tree.rope",
    "tree_forward_backward": "megatron_tree.schedule",
    "flat_forward_backward": "megatron_tree.schedule",
    "tree_forward_only": "megatron_tree.forward_only",
    "check_tree_model": "megatron_tree.model_check",
    "verify_tree_model": "megatron_tree.verify",
}

__all__ = [
    "BalanceStats",
    "ContextParallelShard",
    "MicroBatchSpec",
    "PackingStats",
    "TokenForest",
    "TreeMicroBatch",
    "balance_across_ranks",
    "build_forest",
    "gather_tree_logprobs",
    "gather_tree_scores",
    "gather_tree_values",
    "pack_trees",
    "shard_micro_batch",
    *_MEGATRON_ADAPTERS,
]


def __getattr__(name: str):
    if name in _MEGATRON_ADAPTERS:
        return getattr(import_module(_MEGATRON_ADAPTERS[name]), name)
    raise AttributeError(f"module 'megatron_tree' has no attribute {name!r}")

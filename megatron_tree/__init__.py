"""megatron_tree: tree training for Megatron-LM.

Pack sequences that share prefixes into prefix trees, compute every shared token once,
and get exact per-sequence log-probabilities and gradients.

Every public name is importable from here. The layers, each importing only those before it:
:mod:`megatron_tree.core` (tree data model, packing, balance: numpy / torch), :mod:`megatron_tree.ops`
(log-probs, values, losses: torch), :mod:`megatron_tree.attention` (tree attention kernels: torch),
:mod:`megatron_tree.compat` (fixes of upstream bugs), :mod:`megatron_tree.mcore` (the Megatron adapters),
:mod:`megatron_tree.runtime` (distributed set-up, CPU mode, tiny models), :mod:`megatron_tree.train`
(the launcher). Names from the Megatron layers import megatron-core when first used.
"""

from importlib import import_module

from megatron_tree import _moved
from megatron_tree.core.balance import balance_across_ranks
from megatron_tree.core.context_parallel import ContextParallelShard, shard_micro_batch
from megatron_tree.core.metrics import BalanceStats, PackingStats
from megatron_tree.core.microbatch import TreeMicroBatch
from megatron_tree.core.microbatch_spec import MicroBatchSpec
from megatron_tree.core.packing import pack_trees
from megatron_tree.core.tree import TokenForest, build_forest
from megatron_tree.core.vision_packing import ImageInput, VisionMicroBatch, pack_vision_trees
from megatron_tree.ops.logprobs import gather_tree_logprobs
from megatron_tree.ops.losses import ppo_clip_loss, sft_loss, value_loss
from megatron_tree.ops.values import gather_tree_scores, gather_tree_values

_moved.install()

_LAZY = {
    "tree_attention": "megatron_tree.attention",
    "build_tree_model": "megatron_tree.mcore.bridge",
    "patch_bridge_for_tree_training": "megatron_tree.mcore.bridge",
    "tree_layer_spec": "megatron_tree.mcore.layer_spec",
    "convert_to_tree_model": "megatron_tree.mcore.rope",
    "enable_tree_rope": "megatron_tree.mcore.rope",
    "build_flat_model": "megatron_tree.mcore.bridge",
    "tree_training_overrides": "megatron_tree.mcore.config_overrides",
    "ddp_config": "megatron_tree.mcore.data_parallel",
    "tree_forward_backward": "megatron_tree.mcore.schedule",
    "flat_forward_backward": "megatron_tree.mcore.schedule",
    "tree_forward_only": "megatron_tree.mcore.forward_only",
    "flat_forward_only": "megatron_tree.mcore.forward_only",
    "check_tree_model": "megatron_tree.mcore.model_check",
    "verify_tree_model": "megatron_tree.mcore.verify",
    "apply_compat_patches": "megatron_tree.compat",
    "cpu_mode": "megatron_tree.runtime",
    "init_distributed": "megatron_tree.runtime",
    "save_tiny_hf_checkpoint": "megatron_tree.runtime",
}

__all__ = [
    "BalanceStats",
    "ContextParallelShard",
    "ImageInput",
    "MicroBatchSpec",
    "PackingStats",
    "TokenForest",
    "TreeMicroBatch",
    "VisionMicroBatch",
    "balance_across_ranks",
    "build_forest",
    "gather_tree_logprobs",
    "gather_tree_scores",
    "gather_tree_values",
    "pack_trees",
    "pack_vision_trees",
    "ppo_clip_loss",
    "sft_loss",
    "shard_micro_batch",
    "value_loss",
    *(name for name in _LAZY if name != "enable_tree_rope"),  # enable_tree_rope: convert_to_tree_model's 0.1 name
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_tree' has no attribute {name!r}")

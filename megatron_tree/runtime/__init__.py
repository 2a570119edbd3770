"""What a run needs around the model: one distributed set-up, CPU mode, tiny models for demos.

Used by the launcher (:mod:`megatron_tree.train`), the examples and the benchmarks; imports every
layer below it.
"""

from megatron_tree.runtime.cpu import cpu_mode
from megatron_tree.runtime.distributed import destroy_distributed, init_cpu_distributed, init_distributed
from megatron_tree.runtime.tiny_models import (
    OTHER_TINY_ARCHS,
    QWEN2_5_VL_TOKENS,
    TINY_ARCHS,
    save_hf_config,
    save_tiny_hf_checkpoint,
    tiny_hf_config,
)

__all__ = [
    "OTHER_TINY_ARCHS",
    "QWEN2_5_VL_TOKENS",
    "TINY_ARCHS",
    "cpu_mode",
    "destroy_distributed",
    "init_cpu_distributed",
    "init_distributed",
    "save_hf_config",
    "save_tiny_hf_checkpoint",
    "tiny_hf_config",
]

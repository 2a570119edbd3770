"""Module paths of the flat layout (0.1) that moved into the layered packages: importing one still works
for a release, with a ``DeprecationWarning`` naming the new path (the old name is the new module itself)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "megatron_tree.tree": "megatron_tree.core.tree",
    "megatron_tree.masks": "megatron_tree.core.masks",
    "megatron_tree.microbatch": "megatron_tree.core.microbatch",
    "megatron_tree.microbatch_spec": "megatron_tree.core.microbatch_spec",
    "megatron_tree.packing": "megatron_tree.core.packing",
    "megatron_tree.balance": "megatron_tree.core.balance",
    "megatron_tree.metrics": "megatron_tree.core.metrics",
    "megatron_tree.synthetic": "megatron_tree.core.synthetic",
    "megatron_tree.context_parallel": "megatron_tree.core.context_parallel",
    "megatron_tree.logprobs": "megatron_tree.ops.logprobs",
    "megatron_tree.values": "megatron_tree.ops.values",
    "megatron_tree.losses": "megatron_tree.ops.losses",
    "megatron_tree.dense_attention": "megatron_tree.attention.dense",
    "megatron_tree.flex_attention": "megatron_tree.attention.flex",
    "megatron_tree.fa4_attention": "megatron_tree.attention.fa4",
    "megatron_tree.chain_attention": "megatron_tree.attention.te_chains",
    "megatron_tree.layer_spec": "megatron_tree.mcore.layer_spec",
    "megatron_tree.rope": "megatron_tree.mcore.rope",
    "megatron_tree.router_stats": "megatron_tree.mcore.router_stats",
    "megatron_tree.bridge": "megatron_tree.mcore.bridge",
    "megatron_tree.config_overrides": "megatron_tree.mcore.config_overrides",
    "megatron_tree.schedule": "megatron_tree.mcore.schedule",
    "megatron_tree.forward_only": "megatron_tree.mcore.forward_only",
    "megatron_tree.verify": "megatron_tree.mcore.verify",
    "megatron_tree.model_check": "megatron_tree.mcore.model_check",
    "megatron_tree.packed_seq": "megatron_tree.mcore.packed_seq",
    "megatron_tree.patches": "megatron_tree.compat",
    "megatron_tree.patches.mbridge": "megatron_tree.compat.mbridge",
    "megatron_tree.patches.megatron_core": "megatron_tree.compat.megatron_core",
    "megatron_tree.patches.flash_attn": "megatron_tree.attention.fa4_kernels",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; import it from there (the old path goes in the next release)",
                      DeprecationWarning, stacklevel=3)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Let the old module paths import (once per process)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before the path finder, which would load a second copy

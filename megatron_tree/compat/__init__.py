"""Compatibility patches: fixes of upstream bugs in mbridge and megatron-core, nothing else.

One module per upstream library (:mod:`megatron_tree.compat.mbridge`, :mod:`megatron_tree.compat.megatron_core`),
one small function per problem, each naming the versions that need it and checking for itself whether
this process does. Feature code that reaches into upstream internals lives with its feature: the
mbridge hooks tree training is built on (:mod:`megatron_tree.mcore.bridge_hooks`), the MoE router
statistics weighting (:mod:`megatron_tree.mcore.router_stats`), FA4's tree mask and per-query-head
backward (:mod:`megatron_tree.attention.fa4_kernels`), cuDNN frontend's flex kernels launched without its per-call
Python (:mod:`megatron_tree.attention.cudnn_flex_kernels`), the CPU shim (:mod:`megatron_tree.runtime.cpu`).
Nothing is applied at import: use the context manager ::

    with apply_compat_patches():
        bridge = AutoBridge.from_pretrained(path)
        model = bridge.get_model(...)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from megatron_tree.core.patching import AttrPatch, PatchScope


def _compat_patches() -> list[AttrPatch]:
    from . import mbridge, megatron_core

    return mbridge.compat_patches() + megatron_core.compat_patches()


_COMPAT_SCOPE = PatchScope(_compat_patches)


@contextlib.contextmanager
def apply_compat_patches() -> Iterator[tuple[AttrPatch, ...]]:
    """Apply the compatibility patches this process needs; revert them when the outermost block exits.

    Covers mbridge 0.15.1 on megatron-core >= 0.14, transformers >= 5 and machines without
    Transformer Engine (see :mod:`megatron_tree.compat.mbridge` and :mod:`megatron_tree.compat.megatron_core`).
    Nested and repeated entries share one application. Yields the patches applied (and reverted).

    Not reverted: fixes of upstream bugs (``megatron_core.lasting_fixes``: the missing
    ``te_general_gemm`` of megatron-core 0.16 without TE; ``mbridge.lasting_fixes``: weight export
    without autograd), applied at the first entry, and
    what a bridge built inside needs for its life, stored on that bridge (see
    :mod:`megatron_tree.compat.mbridge`).
    """
    from . import mbridge, megatron_core

    for fix in megatron_core.lasting_fixes() + mbridge.lasting_fixes():
        fix.apply()
    with _COMPAT_SCOPE.active() as applied:
        yield applied


__all__ = ["apply_compat_patches"]

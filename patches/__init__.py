"""Compatibility patches: the only code here that touches private internals of mbridge,
megatron-core, transformers or flash-attn-4.

One module per upstream library (``megatron_tree.patches.mbridge``, ``megatron_tree.patches.megatron_core``,
``megatron_tree.patches.flash_attn``), one small function per problem, each saying which versions need it
and checking for itself whether this process does. ``flash_attn`` is applied by the FA4 backend itself
(:func:`megatron_tree.patches.flash_attn.lean_tree_mask`). Nothing is applied at import: use the context manager ::

    with apply_compat_patches():
        bridge = AutoBridge.from_pretrained(path)
        model = bridge.get_model(...)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ._attr import AttrPatch, PatchScope


def _compat_patches() -> list[AttrPatch]:
    from . import mbridge

    return mbridge.compat_patches()


_COMPAT_SCOPE = PatchScope(_compat_patches)


@contextlib.contextmanager
def apply_compat_patches() -> Iterator[tuple[AttrPatch, ...]]:
    """Apply the compatibility patches this process needs; revert them when the outermost block exits.

    Covers mbridge 0.15.1 on megatron-core >= 0.14, transformers >= 5 and machines without
    Transformer Engine (see :mod:`megatron_tree.patches.mbridge` and :mod:`megatron_tree.patches.megatron_core`).
    Nested and repeated entries share one application. Yields the patches applied (and reverted).

    Not reverted: fixes of upstream bugs (``megatron_core.lasting_fixes``: the missing
    ``te_general_gemm`` of megatron-core 0.16 without TE), applied at the first entry, and
    what a bridge built inside needs for its life, stored on that bridge (see
    :mod:`megatron_tree.patches.mbridge`).
    """
    from . import megatron_core

    for fix in megatron_core.lasting_fixes():
        fix.apply()
    with _COMPAT_SCOPE.active() as applied:
        yield applied


__all__ = ["apply_compat_patches"]

"""Fixes of megatron-core problems (``megatron.core``), one function per problem.

Each function returns the :class:`~megatron_tree.core.patching.AttrPatch` list its problem needs in
this process (empty when the installed version does not have the problem); nothing is applied
here. Entry point: :func:`megatron_tree.compat.apply_compat_patches` (the lasting fixes).
"""

from __future__ import annotations

from megatron_tree.core.patching import AttrPatch


def moe_te_general_gemm() -> list[AttrPatch]:
    """Define ``moe_utils.te_general_gemm = None`` when Transformer Engine is absent.

    Needed by megatron-core 0.16.x without Transformer Engine: ``moe/moe_utils.py`` imports
    ``te_general_gemm`` only inside its ``try: import transformer_engine`` block but the
    router GEMM (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None``
    unconditionally, so every MoE forward raises ``NameError``. ``None`` selects the
    plain-PyTorch path that is already there. No-op where the name is defined.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return []
    return [
        AttrPatch(moe_utils, "te_general_gemm", None, "megatron-core without TE: router GEMM NameError")
    ]


def lasting_fixes() -> list[AttrPatch]:
    """Fixes of upstream bugs (a missing name) that this process needs and models rely on for
    their whole life: :func:`megatron_tree.compat.apply_compat_patches` applies them once and
    never reverts them."""
    return moe_te_general_gemm()

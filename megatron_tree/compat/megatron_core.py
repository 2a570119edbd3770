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


def torch_optimizers_without_cuda() -> list[AttrPatch]:
    """``megatron.core.optimizer`` on torch's AdamW / SGD in a process without CUDA.

    Needed by megatron-core (0.16 - 0.19 at least) where Transformer Engine or Apex is installed but no GPU
    is usable (a CPU run on a GPU host: ``CUDA_VISIBLE_DEVICES=""``): the module
    binds ``Adam`` / ``SGD`` at import to TE's (or Apex's) fused optimizers whenever they import, which run
    CUDA kernels only. The patch sets what megatron-core sets when neither is installed
    (``USING_PYTORCH_OPTIMIZER = True``, torch's classes). No-op with CUDA or where it already is so.
    """
    import torch
    from megatron.core import optimizer

    if torch.cuda.is_available() or getattr(optimizer, "USING_PYTORCH_OPTIMIZER", True):
        return []
    why = "no CUDA: torch optimizers, not TE's / Apex's fused ones"
    return [
        AttrPatch(optimizer, "USING_PYTORCH_OPTIMIZER", True, why),
        AttrPatch(optimizer, "Adam", torch.optim.AdamW, why),
        AttrPatch(optimizer, "SGD", torch.optim.SGD, why),
    ]


def compat_patches() -> list[AttrPatch]:
    """The revertible megatron-core fixes this process needs (applied by :func:`megatron_tree.compat.apply_compat_patches`)."""
    return torch_optimizers_without_cuda()


def lasting_fixes() -> list[AttrPatch]:
    """Fixes of upstream bugs (a missing name) that this process needs and models rely on for
    their whole life: :func:`megatron_tree.compat.apply_compat_patches` applies them once and
    never reverts them."""
    return moe_te_general_gemm()

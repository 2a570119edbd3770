"""Patches for megatron-core internals (``megatron.core``), one function per problem.

Each function returns the :class:`~megatron_tree.patches._attr.AttrPatch` list its problem needs in
this process (empty when the installed version or hardware does not have the problem);
nothing is applied here. Entry points: :func:`megatron_tree.patches.apply_compat_patches` (the
lasting fixes) and :func:`megatron_tree.testing.cpu_mode` (the CPU pieces).
"""

from __future__ import annotations

import torch

from ._attr import AttrPatch


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


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in for ``tensor_parallel.random._get_cuda_rng_state``: the CPU generator state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    """CPU stand-in for ``tensor_parallel.random._set_cuda_rng_state``: sets the CPU generator state."""
    torch.set_rng_state(new_state)


def cpu_rng_state() -> list[AttrPatch]:
    """Route megatron-core's private CUDA RNG-state helpers to the CPU generator (no CUDA only).

    Needed on machines without CUDA, every megatron-core version up to at least 0.19:
    the RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``)
    and activation recompute save/restore state through
    ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which index
    ``torch.cuda.default_generators``. On CPU, dropout and init draw from the CPU generator,
    so tracking that generator keeps the tracker's fork/restore semantics.
    """
    if torch.cuda.is_available():
        return []
    from megatron.core.tensor_parallel import random as tp_random

    why = "no CUDA: RNG tracker state lives in the CPU generator"
    return [
        AttrPatch(tp_random, "_get_cuda_rng_state", _cpu_get_rng_state, why),
        AttrPatch(tp_random, "_set_cuda_rng_state", _cpu_set_rng_state, why),
    ]


def lasting_fixes() -> list[AttrPatch]:
    """Fixes of upstream bugs (a missing name) that this process needs and models rely on for
    their whole life: :func:`megatron_tree.patches.apply_compat_patches` applies them once and
    never reverts them."""
    return moe_te_general_gemm()

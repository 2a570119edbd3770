"""Tree attention through FlashAttention-4's CuTe DSL kernels, block-sparse over the tree (Hopper, Blackwell).

Shape legend: b = batch (1), h = query heads, hkv = key/value heads (h % hkv == 0), T = slots,
Tq = query rows (T, or a context-parallel rank's share), d = head dim, nq / nk = 128-slot query /
key blocks (``ceil(Tq / 128)``, ``ceil(T / 128)``).

Mask (the interval encoding, :mod:`megatron_tree.core.masks`): key j is visible to query i iff
``j <= i < subtree_end[j]``. The kernels are the ``flash-attn-4`` package's (``flash_attn.cute``,
pinned to :data:`FA4_VERSION`: its block-sparse interface is still moving): warp-specialised,
TMA-fed wgmma (Hopper) / tcgen05 (Blackwell) forward and backward that visit only the tiles the
block tables list. The tables are :func:`megatron_tree.attention.flex.classify_blocks`' (exact:
"full" tiles skip the mask, "partial" tiles evaluate it per element, empty tiles are never loaded),
in both directions: query block -> key blocks for the forward and dQ, key block -> query blocks
for dK / dV. The per-element mask is a CuTe ``mask_mod`` reading ``subtree_end`` (and, under
context parallel, each query row's slot) from global memory.

No padding of q / k / v: the kernels mask the ragged last tile; only ``subtree_end`` (and the
query slots) are padded to a multiple of 128 so the mask never reads past them. Kernels are
compiled on first use per (dtype, head layout, mask kind) and reused for every length.

bf16 only (the kernels have no fp32 path; fp16 is unproven): fp32 / fp16 runs take ``"flex"`` or ``"dense"``.

Trusted only where a GPU test compared its gradients (:data:`PROVEN`: bf16 on Hopper, head dims 64 / 96 /
128 with MHA and GQA 2:1 / 4:1 / 8:1, 64 / 128 with GQA 5:1 / 7:1 too, flash-attn-4 4.0.0b36; 4.0.0b36 returns a wrong dQ at
head dims 72 - 112 (and at GQA 4:1 and 8:1 a wrong dK and dV too) and refuses 192 / 256). Every other call is refused (``auto`` sends it to a backend proven there).

No sliding window: :data:`WINDOW_REFUSAL`. The block tables could express it exactly (``classify_blocks``
takes each query row's window start), but the CuTe ``mask_mod`` s (and the lean mask of
:mod:`~megatron_tree.attention.fa4_kernels`) read only ``subtree_end`` and no windowed kernel has been
compared on a GPU, so windowed calls are refused and ``auto`` sends them to ``"flex"`` / ``"dense"``.

As the ``"fa4"`` backend of :mod:`megatron_tree.attention`: :func:`prepare` / :func:`attend` /
:func:`refusal` (b = 1, no attention dropout, the shapes above); ``"auto"`` picks it for the calls
it computes exactly, wherever it runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_tree.attention.availability import pinned_import_problem, unavailable_reason
from megatron_tree.attention.shapes import AttentionShape, ProvenShapes
from megatron_tree.attention.flex import (
    _check_qkv,
    _check_subtree_end,
    _ordered_tables,
    classify_blocks,
    pad_query_slots,
    pad_subtree_end,
)

__all__ = [
    "FA4_VERSION",
    "FA4TreeMask",
    "PROVEN",
    "WINDOW_REFUSAL",
    "attend",
    "fa4_available",
    "fa4_tree_attention",
    "fa4_tree_mask",
    "fa4_unavailable_reason",
    "prepare",
    "refusal",
]

FA4_VERSION = "4.0.0b36"
"""The ``flash-attn-4`` release this module is written and tested against (``pip install flash-attn-4==4.0.0b36``)."""

PROVEN = ProvenShapes.grid(
    head_dims=(64, 96, 128), gqa_ratios=(1, 2), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="flash-attn-4 4.0.0b36, H200, torch 2.11: out / dQ / dK / dV on a ragged 14,101-slot branching tree "
    "within dense bf16's own error of the fp32 reference (head dims 72, 80, 104, 112: dQ off by 1.3; 192, 256: "
    "refused by the kernel); tests/attention/test_fa4_attention.py at 64 MHA and 128 GQA 2:1",
) | ProvenShapes.grid(
    head_dims=(64, 128), gqa_ratios=(4, 5, 7, 8), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="benchmarks/results/te/conformance_raw_{a,c}.json (flash-attn-4 4.0.0b36, H200, torch 2.11): raw "
    "kernel, GRPO tree and context-parallel query slots, at most 1.5x dense bf16's error (the rule: 2x)",
) | ProvenShapes.grid(
    head_dims=(96,), gqa_ratios=(4, 8), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="benchmarks/results/te/conformance_raw_{a,d}.json (as above)",
)
"""Where the FA4 kernels of :data:`FA4_VERSION` were proven exact: bf16 on Hopper, head dims 64 / 96 / 128 with
MHA and GQA 2:1, 4:1, 8:1, and 64 / 128 with GQA 5:1 and 7:1 too. Every other call (other head dims or GQA ratios,
fp16, a v head dim of its own as in MLA, other GPU generations) is refused."""

BLOCK = 128
"""Sparse block size, query and key, forward and backward: the Hopper forward tile, and two of the
backward's 64-row query tiles. (64-row backward tables were tried on the H200: no faster on the
benchmark trees, twice the table build time, and the head-dim-64 and query-slot GPU tests failed.)"""


def fa4_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the FA4 backend cannot run on ``device`` (default: the current CUDA device), None if it can.
    Names every missing prerequisite (GPU, GPU generation, the flash-attn-4 package)."""
    device = None if device is None else torch.device(device)
    missing = pinned_import_problem("flash-attn-4", FA4_VERSION, "flash_attn.cute.interface", "flash_attn.cute")
    return unavailable_reason("FA4", device, missing, "fa4")


def _require(device: torch.device | None) -> None:
    """ValueError with :func:`fa4_unavailable_reason` and what to use instead, unless FA4 runs on ``device``."""
    reason = fa4_unavailable_reason(device)
    if reason is not None:
        instead = "'flex' or 'auto'" if torch.cuda.is_available() else "'auto' or 'dense' (no CUDA GPU here)"
        raise ValueError(f"{reason}. Use backend={instead}.")


def fa4_available(device: torch.device | None = None) -> bool:
    """True when :func:`fa4_tree_attention` runs on ``device``: Hopper/Blackwell and flash-attn-4 :data:`FA4_VERSION`."""
    return fa4_unavailable_reason(device) is None


@functools.cache
def _mask_mods():
    """The CuTe ``mask_mod`` s: ``(tree, tree_with_query_slots)``; aux tensors ``[subtree_end]`` / ``[subtree_end, slots]``."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    from megatron_tree.attention.fa4_kernels import lean_tree_mask

    @cute.jit
    def tree_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        end = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0]], cutlass.Int32)
        return (kv_idx <= q_idx) & (q_idx < end)

    @cute.jit
    def tree_mask_query_slots(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        end = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0]], cutlass.Int32)
        slot = utils.scalar_to_ssa(aux_tensors[1][q_idx[0]], cutlass.Int32)
        return (kv_idx <= slot) & (slot < end)

    lean_tree_mask(tree_mask, tree_mask_query_slots)
    return tree_mask, tree_mask_query_slots


@dataclass(frozen=True)
class FA4TreeMask:
    """What the FA4 kernels need for one micro-batch (built once, shared by all layers).

    ``aux``: ``[subtree_end int32 [nk * 128]]`` (+ ``slots int32 [nq * 128]``, -1 = padding row, under
    context parallel); ``forward`` / ``backward``: ``flash_attn.cute`` ``BlockSparseTensorsTorch``
    (query -> key blocks, key -> query blocks); ``num_slots`` T, ``num_queries`` Tq.
    """

    aux: tuple[torch.Tensor, ...]
    forward: object
    backward: object
    num_slots: int
    num_queries: int


def fa4_tree_mask(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None) -> FA4TreeMask:
    """Block tables and mask inputs of the tree mask for the FA4 kernels (no host sync).

    ``subtree_end`` int [T] or [1, T] (``j < subtree_end[j] <= T``, not re-checked here);
    ``query_slots`` int [Tq] (context parallel) or None (Tq = T, row i is slot i).
    """
    end = _check_subtree_end(subtree_end)
    _require(end.device)
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    t = end.shape[0]
    end_padded = pad_subtree_end(end, -(-t // BLOCK) * BLOCK)
    slots, tq = None, t
    if query_slots is not None:
        tq = query_slots.numel()
        slots = pad_query_slots(query_slots, -(-tq // BLOCK) * BLOCK)
    partial, full = classify_blocks(end_padded, BLOCK, slots)
    forward = BlockSparseTensorsTorch(*_ordered_tables(partial), *_ordered_tables(full), block_size=(BLOCK, BLOCK))
    # clone, not .contiguous(): a transposed [nk, 1] keeps stride (1, nk), which the CuTe layout check refuses.
    partial_t, full_t = (blocks.T.clone(memory_format=torch.contiguous_format) for blocks in (partial, full))
    backward = BlockSparseTensorsTorch(*_ordered_tables(partial_t), *_ordered_tables(full_t), block_size=(BLOCK, BLOCK))
    aux = (end_padded,) if slots is None else (end_padded, slots)
    return FA4TreeMask(aux, forward, backward, t, tq)


def _flash(query, key, value, mask: FA4TreeMask, softmax_scale: float) -> torch.Tensor:
    """The FA4 kernels as they are, on any shape they accept (the conformance harness measures them raw):
    query [1, h, Tq, d], key [1, hkv, T, d], value [1, hkv, T, dv] -> [1, h, Tq, dv]."""
    from flash_attn.cute.interface import flash_attn_func

    tree_mask, tree_mask_query_slots = _mask_mods()
    out, _ = flash_attn_func(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        softmax_scale=softmax_scale,
        mask_mod=tree_mask if len(mask.aux) == 1 else tree_mask_query_slots,
        aux_tensors=list(mask.aux),
        block_sparse_tensors=mask.forward,
        block_sparse_tensors_bwd=mask.backward,
        # forward-only passes (no_grad, recompute's first forward) then run the training forward's kernel, the one
        # that writes the log-sum-exp (one kernel to compile, not two; the same output); an unused log-sum-exp
        # adds nothing to the backward (FA4 leaves its gradient None)
        return_lse=True,
    )
    return out.transpose(1, 2)


def fa4_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: FA4TreeMask,
    *,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Tree attention by FlashAttention-4's block-sparse kernels, on the shapes they are proven on. Differentiable.

    query [1, h, Tq, d], key [1, hkv, T, d], value [1, hkv, T, dv] (bf16, CUDA, h % hkv == 0), ``mask`` from
    :func:`fa4_tree_mask`; ``softmax_scale`` None = ``1 / sqrt(d)``. Returns [1, h, Tq, dv]. A call whose
    shape :data:`PROVEN` does not hold is refused (``ValueError``, with what to use).
    """
    _check_qkv(query, key, value, mask.num_slots, mask.num_queries)
    problem = _refusal(query, key, value)
    if problem is not None:
        raise problem
    if mask.aux[0].device != query.device:
        raise ValueError(f"the FA4 tree mask is on {mask.aux[0].device} but query is on {query.device}")
    return _flash(query, key, value, mask, query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)


def _refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0) -> Exception | None:
    """Why :func:`fa4_tree_attention` does not run this call, as the exception to raise; None when it does (no
    attention dropout, bf16/fp16, b = 1, FA4 runs on the device, a proven kernel shape fits the call)."""
    if dropout_p:
        return ValueError(
            f"the fa4 tree attention backend has no attention dropout (got {dropout_p}); set "
            f"attention_dropout=0 or use backend='dense'"
        )
    if query.dtype not in (torch.bfloat16, torch.float16):
        return TypeError(
            f"the FA4 tree attention kernels run bf16/fp16, got {query.dtype}; use backend='flex' or 'dense' for fp32"
        )
    if query.shape[0] != 1:
        return ValueError(f"FA4 tree attention takes one micro-batch (b = 1), got b = {query.shape[0]}")
    unavailable = fa4_unavailable_reason(query.device)
    if unavailable is not None:
        return ValueError(f"{unavailable}. Use backend='auto' (it picks a backend that runs here) or 'dense'.")
    return _unproven(AttentionShape.of(query, key, value))


def _unproven_reason(shape: AttentionShape) -> str | None:
    """What FA4 is proven on, unless a proven kernel shape computes ``shape``."""
    if PROVEN.proves(shape):
        return None
    return (
        f"flash-attn-4 {FA4_VERSION} is proven exact (forward and backward against the dense reference) {PROVEN.describe()}; "
        f"this call is {shape}"
    )


def _unproven(shape: AttentionShape) -> ValueError | None:
    reason = _unproven_reason(shape)
    if reason is None:
        return None
    return ValueError(f"{reason}. Use backend='auto' (it sends such calls to a backend proven there) or 'dense'")


WINDOW_REFUSAL = (
    "the fa4 backend has no sliding-window mask: its CuTe mask_mod reads only subtree_end and no windowed FA4 kernel "
    "was compared on a GPU (the block tables could express the window; the per-element mask is not written)"
)
"""Why a windowed call does not run on FA4 (module docstring)."""


def refusal(shape: AttentionShape, *, batch: int, dropout_p: float) -> str | None:
    """Backend ``refusal``: why the fa4 backend does not compute a call of ``shape`` exactly, None when it does."""
    if shape.windowed:
        return WINDOW_REFUSAL
    if dropout_p:
        return f"the fa4 backend has no attention dropout (attention_dropout={dropout_p})"
    if shape.dtype not in (torch.bfloat16, torch.float16):
        return f"the FA4 kernels run bf16/fp16, not {shape.dtype}"
    if batch != 1:
        return f"the fa4 backend takes one micro-batch (b = 1), got b = {batch}"
    unavailable = fa4_unavailable_reason(None if shape.device.startswith("sm") else torch.device(shape.device))
    return unavailable if unavailable is not None else _unproven_reason(shape)


def prepare(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None) -> FA4TreeMask:
    """Backend ``prepare``: :func:`fa4_tree_mask`, after checking the kernels run on this device."""
    _require(subtree_end.device)
    if subtree_end.dim() != 2 or subtree_end.shape[0] != 1:
        raise ValueError(f"the fa4 tree attention backend takes one micro-batch mask [1, T], got shape {tuple(subtree_end.shape)}")
    return fa4_tree_mask(subtree_end, query_slots)


def attend(query, key, value, prepared, *, scale, dropout_p):
    """Backend ``attend``: query ``[1, np, Tq, hn]``, key ``[1, ng, T, hn]``, value ``[1, ng, T, dv]`` -> ``[1, np, Tq, dv]``."""
    if dropout_p:
        raise _refusal(query, key, value, dropout_p)
    return fa4_tree_attention(query, key, value, prepared, softmax_scale=scale)

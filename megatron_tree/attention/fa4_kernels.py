"""flash-attn-4 (``flash_attn.cute``, pinned 4.0.0b36): a lean mask and a per-query-head GQA backward for the tree ``mask_mod`` s.

FA4's SM90 kernels apply a FlexAttention-style ``mask_mod`` element by element
(``AttentionMask.apply_mask``): for each of a thread's accumulator elements they wrap both
indices modulo the sequence lengths (two fast divisions), call the ``mask_mod`` (one global
load of ``subtree_end[kv]``) and check bounds. Every partial tile of the backward pays this
(its tiles are always bounds-checked), and on GRPO / multi-turn trees (15-17% of the visited
tiles partial) it was about a fifth of the backward.

:func:`lean_tree_mask` registers our tree ``mask_mod`` s and swaps ``AttentionMask.apply_mask``
for a function that, for those ``mask_mod`` s only, computes the same mask with one load per
accumulator column (``subtree_end[kv]``) and per row (the query's slot, under context parallel),
no index wrapping (the tree's aux tensors are padded to whole 128-tiles, so no index leaves
them), and the bounds checks folded into those per-row / per-column values. Every other
``mask_mod`` (and no ``mask_mod``) goes to FA4's own ``apply_mask`` unchanged. The swap is applied
once and never reverted: it changes nothing for any other caller, and kernels compiled with
it stay cached under the tree ``mask_mod`` s' own cache hash.

With grouped K/V heads (GQA), FA4's backward adds each query head's dK / dV into fp32 buffers of the
K/V heads with atomics, after zero-filling them, and converts them in two more kernels. For the tree
``mask_mod`` s with two query heads per K/V head, ``_flash_attn_bwd`` instead runs on K/V repeated to the
query heads (the kernel then writes each head's dK / dV directly) and adds the two heads' dK / dV
(each rounded to bf16 once before the add): the tree kernels' key tiles are short (a mean of 23 / 15
query tiles per key tile on the 32k GRPO / multi-turn trees), so the atomic epilogue, the fills and the
conversions cost more than the two copies and the add (two torch element-wise kernels, any memory order).

Mask (as the ``mask_mod`` s in :mod:`megatron_tree.attention.fa4`): query position ``p`` (its row,
or ``slots[row]`` under context parallel, ``-1`` for a padding row) sees key ``kv`` iff
``kv <= p < subtree_end[kv]``.

Imports ``flash_attn.cute`` and the CuTe DSL: imported by :mod:`megatron_tree.attention.fa4` only where
FA4 runs. Checked on the H200 by ``tests/attention/test_fa4_attention.py`` (against the dense reference; bit for bit
against FA4's element-wise masking of the same predicate; the GQA backward against FA4's own, and its head
repeat / pair sum bit for bit against a plain torch reference).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr
from flash_attn.cute import interface as fa4_interface
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.utils import AuxData
from quack import layout_utils

from megatron_tree.core.patching import AttrPatch

# The CuTe DSL re-traces jit functions from their source with this module's globals: everything the
# two jit functions below use is a module-level name.
_KINDS: dict[int, bool] = {}
"""id(mask_mod) -> whether it reads query slots (aux_tensors[1])."""
_ORIGINAL_APPLY_MASK = AttentionMask.apply_mask
_SOURCE_HASH = hashlib.sha256(b"".join(Path(__file__).with_name(name).read_bytes()
                                       for name in ("fa4.py", "fa4_kernels.py"))).hexdigest()[:16]
"""The tree ``mask_mod`` s' and the lean mask's source, hashed: their FA4 compile-cache key (``__cute_hash__``), so a
kernel compiled from other sources, e.g. in FA4's persistent cache (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``,
keyed by flash_attn's own sources only), is never reused."""


def lean_tree_mask(tree_mask: Callable, tree_mask_query_slots: Callable) -> None:
    """Register the two tree ``mask_mod`` s; swap FA4's SM90 ``apply_mask`` and its backward entry (once per process)."""
    _KINDS[id(tree_mask)] = False
    _KINDS[id(tree_mask_query_slots)] = True
    for fn, tag in ((tree_mask, "tree"), (tree_mask_query_slots, "tree_slots")):
        fn.__cute_hash__ = f"megatron_tree.{tag}.lean_sm90_mask.{_SOURCE_HASH}"
    for patch in _SWAPS:
        if vars(patch.owner)[patch.name] is not patch.new:
            patch.apply()


@cute.jit
def _apply_tree_mask(self, acc_S, m_block, n_block, thr_mma, mask_seqlen: cutlass.Constexpr[bool],
                     query_slots: cutlass.Constexpr[bool], aux_tensors):
    swap = const_expr(self.swap_AB)
    acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=swap)
    acc_shape = (self.tile_m, self.tile_n)
    c_s = cute.make_identity_tensor(acc_shape if const_expr(not swap) else acc_shape[::-1])
    t_c = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(c_s), transpose=swap)
    t0_c = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(c_s), transpose=swap)
    row_dim = const_expr(1 if swap else 0)
    col_dim = const_expr(0 if swap else 1)
    qpk = const_expr(self.qhead_per_kvhead_packgqa)
    # per row: the query's position; -1 (sees nothing) for a row past the queries when bounds are checked
    pos = []
    for r in cutlass.range_constexpr(cute.size(t_c.shape[0])):
        row = t_c[r, 0][row_dim] + m_block * self.tile_m
        if const_expr(qpk != 1):
            row = row // qpk
        p = row
        if const_expr(query_slots):
            p = Int32(aux_tensors[1][row])
        if const_expr(mask_seqlen):
            p = Int32(-1) if row >= self.seqlen_q else p
        pos.append(p)
    col0 = t_c[0][col_dim] + n_block * self.tile_n
    for c in cutlass.range_constexpr(cute.size(t_c.shape[1])):
        kv = col0 + t0_c[0, c][col_dim]
        end = Int32(aux_tensors[0][kv])
        if const_expr(mask_seqlen):
            end = kv if kv >= self.seqlen_k else end  # empty range [kv, kv) for a key past the keys
        for r in cutlass.range_constexpr(len(pos)):
            acc_S_mn[r, c] = acc_S_mn[r, c] if kv <= pos[r] and pos[r] < end else -Float32.inf


@cute.jit
def _apply_mask(self, acc_S: cute.Tensor, batch_idx: cutlass.Int32, head_idx: cutlass.Int32,
                m_block: cutlass.Int32, n_block: cutlass.Int32, thr_mma: cute.TiledMma,
                mask_seqlen: cutlass.Constexpr[bool], mask_causal: cutlass.Constexpr[bool],
                mask_local: cutlass.Constexpr[bool] = False, mask_mod: cutlass.Constexpr = None,
                aux_data: AuxData = AuxData(), fastdiv_mods=(None, None)) -> None:
    if const_expr(mask_mod is not None and id(mask_mod) in _KINDS and not mask_causal and not mask_local):
        _apply_tree_mask(self, acc_S, m_block, n_block, thr_mma, mask_seqlen, _KINDS[id(mask_mod)],
                         aux_data.tensors)
    else:
        _ORIGINAL_APPLY_MASK(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen,
                             mask_causal, mask_local, mask_mod, aux_data, fastdiv_mods)


_ORIGINAL_BWD = fa4_interface._flash_attn_bwd


def _bwd_per_query_head(q, k, v, out, dout, lse, *args, mask_mod=None, **kwargs):
    """FA4's ``_flash_attn_bwd`` (q / out / dout [b, Tq, h, d], k / v [b, T, hkv, d]); for a tree ``mask_mod``
    with two query heads per K/V head, run on K/V repeated to the h query heads (head i reads K/V head i // 2,
    as FA4's GQA) and return each dK / dV as the sum of its two query heads' (fp32 add, one rounding).
    Other groupings keep FA4's GQA backward (not measured here)."""
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if id(mask_mod) not in _KINDS or heads != 2 * kv_heads:
        return _ORIGINAL_BWD(q, k, v, out, dout, lse, *args, mask_mod=mask_mod, **kwargs)
    dq, dk, dv, *rest = _ORIGINAL_BWD(q, _repeat_heads(k), _repeat_heads(v), out, dout, lse, *args,
                                      mask_mod=mask_mod, **kwargs)
    return (dq, _add_head_pairs(dk, like=k), _add_head_pairs(dv, like=v), *rest)


def _repeat_heads(x: torch.Tensor) -> torch.Tensor:
    """x [b, T, hkv, d] -> [b, T, 2 hkv, d], head i = x's head i // 2, in x's memory order (head-major, or
    token-major as Megatron's [T, b, hkv, d]); one copy kernel."""
    b, t, h, d = x.shape
    head_major = x.stride(2) > x.stride(1)
    y = torch.empty(b, 2 * h, t, d, dtype=x.dtype, device=x.device).transpose(1, 2) if head_major \
        else torch.empty(b, t, 2 * h, d, dtype=x.dtype, device=x.device)
    y.unflatten(2, (h, 2)).copy_(x.unsqueeze(3))
    return y


def _add_head_pairs(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x [b, T, 2 hkv, d] -> [b, T, hkv, d] laid out as ``like``, head j = x's heads 2j + 2j+1 added (one kernel:
    torch adds bf16 in fp32 and rounds once)."""
    pairs = x.unflatten(2, (like.shape[2], 2))
    return torch.add(pairs[:, :, :, 0], pairs[:, :, :, 1], out=torch.empty_like(like))


# FA4's _flash_attn_bwd finds its kernel cache as an attribute of the function its module name holds (ours).
_bwd_per_query_head.compile_cache = _ORIGINAL_BWD.compile_cache

_SWAPS = (
    AttrPatch(AttentionMask, "apply_mask", _apply_mask,
              why="one subtree_end load per accumulator column for the tree mask_mods (SM90)"),
    AttrPatch(fa4_interface, "_flash_attn_bwd", _bwd_per_query_head,
              why="grouped K/V heads: backward per query head, dK / dV summed, for the tree mask_mods"),
)

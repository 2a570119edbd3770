"""flash-attn-4 (``flash_attn.cute``, pinned 4.0.0b36): a lean mask for the tree ``mask_mod`` s on Hopper.

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

Mask (as the ``mask_mod`` s in :mod:`megatron_tree.fa4_attention`): query position ``p`` (its row,
or ``slots[row]`` under context parallel, ``-1`` for a padding row) sees key ``kv`` iff
``kv <= p < subtree_end[kv]``.

Imports ``flash_attn.cute`` and the CuTe DSL: imported by :mod:`megatron_tree.fa4_attention` only where
FA4 runs. Checked on the H200 by ``tests/test_fa4_attention.py`` (against the dense reference and, bit
for bit, against FA4's element-wise masking of the same predicate).
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.utils import AuxData
from quack import layout_utils

from ._attr import AttrPatch

# The CuTe DSL re-traces jit functions from their source with this module's globals: everything the
# two jit functions below use is a module-level name.
_KINDS: dict[int, bool] = {}
"""id(mask_mod) -> whether it reads query slots (aux_tensors[1])."""
_ORIGINAL_APPLY_MASK = AttentionMask.apply_mask


def lean_tree_mask(tree_mask: Callable, tree_mask_query_slots: Callable) -> None:
    """Register the two tree ``mask_mod`` s and swap FA4's SM90 ``apply_mask`` (once per process)."""
    _KINDS[id(tree_mask)] = False
    _KINDS[id(tree_mask_query_slots)] = True
    for fn, tag in ((tree_mask, "tree"), (tree_mask_query_slots, "tree_slots")):
        fn.__cute_hash__ = f"megatron_tree.{tag}.lean_sm90_mask.v1"
    if vars(AttentionMask)["apply_mask"] is not _apply_mask:
        _SWAP.apply()


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


_SWAP = AttrPatch(AttentionMask, "apply_mask", _apply_mask,
                  why="one subtree_end load per accumulator column for the tree mask_mods (SM90)")

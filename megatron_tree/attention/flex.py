"""Tree attention through FlexAttention, with the block mask derived directly from the interval encoding.

Shape legend: b = batch, h = query heads, hkv = key/value heads (h % hkv == 0, GQA when
smaller), T = slots of the micro-batch, Tp = T padded up to a bucket (:func:`padded_length`),
d = head dim, nq / nk = query / key blocks of ``Tp``, bq / bk = their block sizes.

Mask (the interval encoding, see ``megatron_tree.core.masks``): slots are in DFS pre-order and
key j is visible to query i iff ``j <= i < subtree_end[j]``; a padding slot j has
``subtree_end[j] == j + 1`` and sees only itself. With a sliding window of W path tokens the mask
is ``window_start[i] <= j <= i < subtree_end[j]`` (:func:`megatron_tree.core.masks.window_starts`):
key blocks wholly before every query's window start are skipped, blocks wholly inside every
query's window and the tree are full.

Cost model. ``create_block_mask`` evaluates the ``mask_mod`` on all T² pairs (12-14 ms for
T = 32k on an H200, more than the tree attention's 8 ms forward + backward). Here the block
tables come from per-block min/max of ``subtree_end`` in O(T + nq·nk) vectorised ops (about
2 ms for T = 32k, mostly host-side launches), built once per micro-batch (:func:`flex_tree_mask`):
every layer of a micro-batch, and activation recompute, reuse one :class:`BlockMask` (the
dispatch's one mask cache). The ``mask_mod`` is evaluated only inside partial blocks; full
blocks skip it.

Recompilation. ``flex_attention`` is compiled once at module level with static shapes.
Each call pads T up to :func:`padded_length` (a multiple of the block sizes with at most
four values per octave, so padding is < 25% of T beyond 8 blocks), so a new micro-batch length compiles
again only when it lands in a new bucket. Padded query blocks attend to their diagonal
block only, so padding costs almost no attention work; a packer that emits micro-batches
of a bucket length avoids the pad copy of q/k/v altogether. Each (bucket, dtype, head
layout, grad mode) is one compiled graph; the call raises Dynamo's recompile limit
(default 8 graphs per function) to :data:`RECOMPILE_LIMIT`, since hitting it would fall
back to eager FlexAttention, which materialises the full [b, h, Tp, Tp] score matrix.

As the ``"flex"`` backend of :mod:`megatron_tree.attention`: :func:`prepare` / :func:`attend` /
:func:`refusal` (CUDA, b = 1, no attention dropout; on the shapes of :data:`PROVEN` only, fp32
included; with a sliding window on those of :data:`PROVEN_WINDOWED`). :func:`flex_tree_attention` itself runs any shape FlexAttention takes, unchecked (CPU:
forward only, a FlexAttention limitation).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from megatron_tree.attention.shapes import AttentionShape, ProvenShapes
from megatron_tree.core.masks import check_window, window_starts

__all__ = [
    "PROVEN",
    "PROVEN_WINDOWED",
    "RECOMPILE_LIMIT",
    "FlexTreeMask",
    "attend",
    "classify_blocks",
    "flex_tree_attention",
    "flex_tree_mask",
    "padded_length",
    "prepare",
    "refusal",
    "row_window_starts",
    "tree_block_mask",
]

PROVEN = ProvenShapes.grid(
    head_dims=(64,), gqa_ratios=(1, 4), dtypes=(torch.float32,), devices=("sm90",),
    evidence="tests/attention/test_flex_attention.py::test_cuda_fp32_forward_backward_match_dense (H200, torch 2.11)",
) | ProvenShapes.grid(
    head_dims=(16,), gqa_ratios=(2,), dtypes=(torch.float32,), devices=("sm90",),
    evidence="the tiny models' tree-vs-per-sequence gradient tests with TE, TF32 off (benchmarks/gpu_te_checks.sh)",
) | ProvenShapes.grid(
    head_dims=(128,), gqa_ratios=(2,), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="tests/attention/test_flex_attention.py::test_cuda_bf16_error_within_k_times_dense_bf16_error (H200, torch 2.11)",
) | ProvenShapes.grid(
    head_dims=(128,), gqa_ratios=(1, 2, 4, 5, 7, 8), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="benchmarks/results/te/conformance_raw_{a,c}.json (H200, torch 2.11): raw kernel, GRPO tree and "
    "context-parallel query slots, at most 1.5x dense bf16's error (the rule: 2x)",
) | ProvenShapes.grid(
    head_dims=(64,), gqa_ratios=(4, 5, 7, 8), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="benchmarks/results/te/conformance_raw_{a,c}.json (as above)",
) | ProvenShapes.grid(
    head_dims=(96,), gqa_ratios=(4, 8), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="benchmarks/results/te/conformance_raw_{a,d}.json (as above)",
) | ProvenShapes.grid(
    head_dims=((192, 128), 256), gqa_ratios=(1, 2, 4, 8), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="benchmarks/results/te/conformance_flex_192_256{,_b}.json (H200, torch 2.11): raw kernel, GRPO tree, "
    "context-parallel query slots (and multi-turn at 2:1 / 8:1), at most 1.52x dense bf16's error (MLA's 192 / v 128, "
    "Qwen3.5's / Qwen3-Next's 256)",
)
"""Where this backend's FlexAttention kernels were proven exact (forward and backward against the dense
reference, on a GPU); other calls go elsewhere (``auto``) or are refused."""

PROVEN_WINDOWED = ProvenShapes.grid(
    head_dims=(64,), gqa_ratios=(1, 2, 4), dtypes=(torch.bfloat16, torch.float16, torch.float32), devices=("sm90",),
    evidence="benchmarks/results/te/conformance_windowed_w{7,300}.json (H200, torch 2.11): raw kernel, GRPO tree, "
    "windows 7 and 300, fp32 within 1e-5 and bf16 / fp16 at most 1.6x dense's error; "
    "tests/attention/test_sliding_window.py::test_cuda_flex_windowed_forward_backward_match_dense (fp32 MHA and 4:1, "
    "bf16 4:1, with and without context-parallel query slots)",
    windowed=True,
) | ProvenShapes.grid(
    head_dims=(128,), gqa_ratios=(2,), dtypes=(torch.bfloat16,), devices=("sm90",),
    evidence="tests/attention/test_sliding_window.py::test_cuda_flex_windowed_forward_backward_match_dense (H200, "
    "torch 2.11, windows 7 and 300, with and without context-parallel query slots)",
    windowed=True,
)
"""Where the flex backend's sliding-window mask was proven exact on a GPU (forward and backward against the dense
reference); ``auto`` sends other windowed calls to the dense reference. Add the shapes a GPU run compared
(``ProvenShapes.grid(..., windowed=True)``)."""

RECOMPILE_LIMIT = 64
"""Compiled graphs allowed for the module-level compiled FlexAttention (Dynamo's default is 8)."""

_compiled_flex_attention = torch.compile(flex_attention, dynamic=False)


def _block_sizes(block_size: int | tuple[int, int]) -> tuple[int, int]:
    """``(bq, bk)`` from an int (both) or a pair; ValueError unless positive powers of two."""
    pair = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(pair) != 2 or not all(isinstance(s, int) and s > 0 and s & (s - 1) == 0 for s in pair):
        raise ValueError(f"block_size must be a power of two or a pair of them, got {block_size!r}")
    return pair


def padded_length(num_slots: int, block_size: int | tuple[int, int] = 128) -> int:
    """Bucket length ``Tp >= num_slots``: a multiple of the block sizes, four buckets per octave.

    ``Tp`` is ``num_slots`` rounded up to a multiple of ``max(bq, bk, 2**(ceil(log2 T) - 3))``,
    so ``Tp < 1.25 * T`` once T exceeds 8 blocks.
    """
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
    step = max(*_block_sizes(block_size), 2 ** max(math.ceil(math.log2(num_slots)) - 3, 0))
    return -(-num_slots // step) * step


def _check_subtree_end(subtree_end: torch.Tensor) -> torch.Tensor:
    """``subtree_end`` [T] or [1, T] integer tensor -> [T] view; TypeError / ValueError otherwise."""
    if not isinstance(subtree_end, torch.Tensor):
        raise TypeError(f"subtree_end must be a torch.Tensor, got {type(subtree_end).__name__}")
    if subtree_end.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"subtree_end must be int32 or int64, got {subtree_end.dtype}")
    if subtree_end.dim() == 2 and subtree_end.shape[0] == 1:
        subtree_end = subtree_end[0]
    if subtree_end.dim() != 1 or subtree_end.numel() == 0:
        raise ValueError(f"subtree_end must have shape [T] or [1, T] with T >= 1, got {tuple(subtree_end.shape)}")
    return subtree_end


def classify_blocks(
    subtree_end: torch.Tensor,
    block_size: int | tuple[int, int] = 128,
    query_slots: torch.Tensor | None = None,
    row_window_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classify the (query block, key block) tiles of the tree mask: ``(partial, full)``, each bool [nq, nk].

    ``subtree_end`` is int [T] (T a multiple of bq and bk) with ``subtree_end[j] > j``. A tile
    is *full* if every pair in it is visible, *partial* if some but not all are, *empty*
    (neither flag) if none is.

    Query block Q = [q0, q1] and key block K = [k0, k1] (inclusive); ``e = subtree_end``.

    * Nonempty  iff  ``k0 <= q1`` and ``max_{j in K} e[j] > q0``.
      (=>) a visible pair (i, j) has ``k0 <= j <= i <= q1`` and ``e[j] > i >= q0``.
      (<=) if ``k1 < q0``, the argmax j satisfies ``j < q0 < e[j]``: (q0, j) is visible.
      Otherwise ``k0 <= q1`` and ``k1 >= q0`` make K and Q share a slot j, and (j, j) is
      visible because ``e[j] > j``.
    * Full  iff  ``k1 <= q0`` and ``min_{j in K} e[j] > q1``.
      (=>) (q0, k1) visible needs ``k1 <= q0``; (q1, j) visible for every j needs ``e[j] > q1``.
      (<=) for i in Q, j in K: ``j <= k1 <= q0 <= i`` and ``i <= q1 < e[j]``.

    Neither proof uses the nesting of DFS intervals, only ``e[j] > j``, so the tables are
    exact for any mask of the form ``j <= i < e[j]``. Cost: O(T) for the per-block
    min/max and O(nq·nk) for the tables, all on ``subtree_end``'s device, no host sync.

    ``query_slots`` int [Tq] (a multiple of bq; context parallel): query row r is slot
    ``query_slots[r]`` (-1: a padding row that sees nothing). Then q0 / q1 are the least / largest
    slot of the block's rows: "nonempty" stays a necessary condition (a block it flags may still
    be empty: it is then partial and the ``mask_mod`` masks it) and "full" a sufficient one
    (a block holding a padding row is never full).

    ``row_window_start`` int [Tq] (a sliding window): query row r sees only keys ``j >= row_window_start[r]``
    (:func:`megatron_tree.core.masks.window_starts` of its slot; a padding row: any value > its slot). With
    ``w0`` / ``w1`` the least / largest start of the block's rows, a tile is also empty if ``k1 < w0`` (the key
    block lies before every row's window: skipped), and full only if also ``k0 >= w1`` (inside every row's
    window). "Nonempty" is then a necessary condition (a pair may meet the tree and the window conditions
    through different rows: partial, masked per element), "full" stays sufficient. On a chain (one
    sequence) the tables are exactly the sliding-window band's.
    """
    end = _check_subtree_end(subtree_end)
    bq, bk = _block_sizes(block_size)
    t = end.shape[0]
    if t % bq or t % bk:
        raise ValueError(f"T={t} must be a multiple of both block sizes {(bq, bk)}; pad with padded_length()")
    per_key_block = end.view(t // bk, bk)
    max_end = per_key_block.amax(dim=1)  # [nk]
    min_end = per_key_block.amin(dim=1)  # [nk]
    if query_slots is None:
        q0 = torch.arange(0, t, bq, device=end.device)[:, None]  # [nq, 1]
        q1 = q0 + (bq - 1)
    else:
        if query_slots.numel() % bq:
            raise ValueError(f"query_slots has {query_slots.numel()} rows, not a multiple of bq={bq}")
        rows = query_slots.reshape(-1, bq).to(end.device, torch.int64)
        q0, q1 = rows.amin(dim=1)[:, None], rows.amax(dim=1)[:, None]
    k0 = torch.arange(0, t, bk, device=end.device)[None, :]  # [1, nk]
    k1 = k0 + (bk - 1)
    nonempty = (k0 <= q1) & (max_end[None, :] > q0)
    full = (k1 <= q0) & (min_end[None, :] > q1)
    if row_window_start is not None:
        if row_window_start.numel() != q0.shape[0] * bq:
            raise ValueError(f"row_window_start has {row_window_start.numel()} rows, expected {q0.shape[0] * bq}")
        starts = row_window_start.reshape(-1, bq).to(end.device, torch.int64)
        nonempty &= k1 >= starts.amin(dim=1)[:, None]
        full &= k0 >= starts.amax(dim=1)[:, None]
    return nonempty & ~full, full


def _ordered_tables(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [nq, nk] -> (num_blocks int32 [1, 1, nq], indices int32 [1, 1, nq, nk]), listed blocks first, ascending."""
    num = blocks.sum(dim=1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int32), dim=1, descending=True, stable=True).to(torch.int32)
    # Row-major strides even on size-1 dims (sort keeps its input's): kernels check strides[-1] == 1.
    return num[None, None], indices[None, None].clone(memory_format=torch.contiguous_format)


def pad_subtree_end(end: torch.Tensor, length: int) -> torch.Tensor:
    """``end`` int [T] -> int32 [length >= T]: slots ``[T, length)`` are padding that sees only itself."""
    pad = torch.arange(end.shape[0] + 1, length + 1, device=end.device, dtype=end.dtype)
    return torch.cat([end, pad]).to(torch.int32)


def pad_query_slots(query_slots: torch.Tensor, length: int) -> torch.Tensor:
    """``query_slots`` int [Tq] -> int32 [length >= Tq]: rows ``[Tq, length)`` are slot -1 (see nothing)."""
    return torch.cat([query_slots.reshape(-1), query_slots.new_full((length - query_slots.numel(),), -1)]).to(torch.int32)


def _interval_mask_mod(end: torch.Tensor, query_slots: torch.Tensor | None = None,
                       row_window_start: torch.Tensor | None = None):
    """FlexAttention mask_mod of the interval encoding over ``end`` int [Tp] (True = attend); with
    ``query_slots`` int [Tqp], query row q is slot ``query_slots[q]`` (-1 sees nothing); with
    ``row_window_start`` int [Tqp] (a sliding window), row q sees only keys ``>= row_window_start[q]``."""

    if query_slots is None and row_window_start is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

    elif query_slots is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < end[kv_idx]) & (kv_idx >= row_window_start[q_idx])

    elif row_window_start is None:

        def mask_mod(b, h, q_idx, kv_idx):
            slot = query_slots[q_idx]
            return (kv_idx <= slot) & (slot < end[kv_idx])

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            slot = query_slots[q_idx]
            return (kv_idx <= slot) & (slot < end[kv_idx]) & (kv_idx >= row_window_start[q_idx])

    return mask_mod


def row_window_starts(end_padded: torch.Tensor, window: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [Tqp]: the first key slot each query row sees under a sliding ``window``
    (:func:`~megatron_tree.core.masks.window_starts` over the padded ``end_padded`` int [Tp]); with ``slots``
    int [Tqp] (context parallel), row r is slot ``slots[r]`` and a padding row (-1) gets ``Tp`` (sees nothing)."""
    starts = window_starts(end_padded, window)
    if slots is None:
        return starts.to(torch.int32)
    slots = slots.long()
    return torch.where(slots >= 0, starts[slots.clamp_min(0)], end_padded.shape[0]).to(torch.int32)


def tree_block_mask(
    subtree_end: torch.Tensor,
    block_size: int | tuple[int, int] = 128,
    query_slots: torch.Tensor | None = None,
    window: int | None = None,
) -> BlockMask:
    """The :class:`BlockMask` of the tree mask over ``Tp = padded_length(T, block_size)`` slots (built on each call).

    ``subtree_end``: int32/int64 [T] or [1, T] (the micro-batch's ``attention_mask``), on the
    device the attention runs on. Slots ``[T, Tp)`` are padding that sees only itself. The
    mask has batch and head dims 1 (broadcast over both). Built from :func:`classify_blocks`
    with ``BlockMask.from_kv_blocks``. Build it once per micro-batch and pass it to every layer
    (:func:`flex_tree_mask`; the ``"flex"`` backend's ``prepare``, cached per micro-batch by
    :data:`megatron_tree.attention.PREPARED_MASKS`).

    ``query_slots`` int [Tq] (context parallel): the queries are these slots (a rank's share), the
    keys all T slots; the mask is ``[Tqp, Tp]`` with ``Tqp = padded_length(Tq, block_size)``.

    ``window`` (int >= 1, None = none): a sliding window of that many path tokens
    (:mod:`megatron_tree.core.masks`); blocks before every query's window are skipped.
    """
    check_window(window)
    end = _check_subtree_end(subtree_end)
    sizes = _block_sizes(block_size)
    tp = padded_length(end.shape[0], sizes)
    end_padded = pad_subtree_end(end, tp)
    slots, q_len = None, tp
    if query_slots is not None:
        q_len = padded_length(query_slots.numel(), sizes)
        slots = pad_query_slots(query_slots, q_len)
    starts = None if window is None else row_window_starts(end_padded, window, slots)
    partial, full = classify_blocks(end_padded, sizes, slots, starts)
    kv_num, kv_idx = _ordered_tables(partial)
    full_num, full_idx = _ordered_tables(full)
    block_mask = BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=sizes,
        mask_mod=_interval_mask_mod(end_padded, slots, starts),
        seq_lengths=(q_len, tp),
    )
    return block_mask


def _check_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_slots: int, num_queries: int | None = None
) -> None:
    """TypeError / ValueError unless q [b, h, Tq, d], k [b, hkv, T, d], v [b, hkv, T, dv] agree
    (Tq = T unless ``num_queries`` is given)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [b, heads, T, d], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query/key/value devices differ: {query.device}, {key.device}, {value.device}")
    b, h, tq, d = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != b or key.shape[3] != d:
        raise ValueError(
            f"expected query [b, h, Tq, d], key [b, hkv, T, d], value [b, hkv, T, dv]; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if h % key.shape[1]:
        raise ValueError(f"query heads {h} must be a multiple of key/value heads {key.shape[1]}")
    if key.shape[2] != num_slots:
        raise ValueError(f"key/value have T={key.shape[2]} slots but subtree_end has {num_slots}")
    if tq != (num_slots if num_queries is None else num_queries):
        raise ValueError(f"query has {tq} rows, expected {num_slots if num_queries is None else num_queries}")


@dataclass(frozen=True)
class FlexTreeMask:
    """What :func:`flex_tree_attention` needs for one micro-batch (built once, shared by all layers):
    ``block_mask`` over the padded lengths, ``num_slots`` T and ``num_queries`` Tq (unpadded), ``window``
    the sliding window it encodes (None = none)."""

    block_mask: BlockMask
    num_slots: int
    num_queries: int
    window: int | None = None


def flex_tree_mask(
    subtree_end: torch.Tensor,
    block_size: int | tuple[int, int] = 128,
    query_slots: torch.Tensor | None = None,
    window: int | None = None,
) -> FlexTreeMask:
    """:func:`tree_block_mask` with the lengths it was built for (``query_slots``: context parallel; ``window``:
    a sliding window; see there)."""
    t = _check_subtree_end(subtree_end).shape[0]
    return FlexTreeMask(tree_block_mask(subtree_end, block_size, query_slots, window), t,
                        t if query_slots is None else query_slots.numel(), window)


def flex_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: FlexTreeMask | torch.Tensor,
    *,
    softmax_scale: float | None = None,
    kernel_options: dict | None = None,
    block_size: int | tuple[int, int] = 128,
    query_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention: softmax over the keys each query sees in the interval encoding. Differentiable.

    Args:
      query: [b, h, Tq, d]; key: [b, hkv, T, d]; value: [b, hkv, T, dv] (same dtype and device;
        GQA when hkv < h). CUDA for forward and backward; CPU runs forward only (a PyTorch
        limitation of FlexAttention). Not checked against :data:`PROVEN` (the ``"flex"`` backend is).
      mask: :func:`flex_tree_mask` of the micro-batch's ``subtree_end`` (key j is visible to query i
        iff ``j <= i < subtree_end[j]``), built once and passed to every layer. (A ``subtree_end``
        tensor, with ``block_size`` / ``query_slots``, still works for a release: deprecated, it builds
        the mask on every call.)
      softmax_scale: score scale; ``1 / sqrt(d)`` when None.
      kernel_options: passed to ``flex_attention`` (tile sizes, ``fwd_``/``bwd_`` prefixes;
        ``benchmarks/attention_bench.py`` times a few).

    Returns:
      [b, h, Tq, dv], dtype of ``query``.
    """
    if isinstance(mask, torch.Tensor):
        warnings.warn("flex_tree_attention(q, k, v, subtree_end) builds the block mask on every call; pass "
                      "flex_tree_mask(subtree_end, block_size, query_slots), built once per micro-batch",
                      DeprecationWarning, stacklevel=2)
        if mask.device != query.device:
            raise ValueError(f"subtree_end is on {mask.device} but query is on {query.device}")
        mask = flex_tree_mask(mask, block_size, query_slots)
    if not isinstance(mask, FlexTreeMask):
        raise TypeError(f"mask must be flex_tree_mask(subtree_end, ...), got {type(mask).__name__}")
    t, tq = mask.num_slots, mask.num_queries
    _check_qkv(query, key, value, t, tq)
    block_mask = mask.block_mask
    if block_mask.kv_num_blocks.device != query.device:
        raise ValueError(f"the block mask is on {block_mask.kv_num_blocks.device} but query is on {query.device}")
    pad, pad_q = block_mask.seq_lengths[1] - t, block_mask.seq_lengths[0] - tq
    if pad_q:
        query = F.pad(query, (0, 0, 0, pad_q))
    if pad:
        key, value = (F.pad(x, (0, 0, 0, pad)) for x in (key, value))
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        out = _compiled_flex_attention(
            query,
            key,
            value,
            block_mask=block_mask,
            scale=softmax_scale,
            enable_gqa=query.shape[1] != key.shape[1],
            kernel_options=kernel_options,
        )
    return out[:, :, :tq] if pad_q else out


def prepare(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None, window: int | None = None) -> FlexTreeMask:
    """Backend ``prepare``: the micro-batch's :func:`flex_tree_mask` (one per micro-batch and window, cached by the
    dispatch)."""
    if subtree_end.shape[0] != 1:
        raise ValueError(f"the flex tree attention backend takes one micro-batch (b = 1), got b = {subtree_end.shape[0]}")
    return flex_tree_mask(subtree_end, query_slots=query_slots, window=window)


def refusal(shape: AttentionShape, *, batch: int, dropout_p: float) -> str | None:
    """Backend ``refusal``: why the flex backend does not compute a call of ``shape`` exactly, None when it does."""
    if dropout_p:
        return f"the flex backend has no attention dropout (attention_dropout={dropout_p})"
    if batch != 1:
        return f"the flex backend takes one micro-batch (b = 1), got b = {batch}"
    if not shape.device.startswith("sm"):
        return f"the flex backend runs on CUDA GPUs (FlexAttention has no backward on {shape.device})"
    table = PROVEN_WINDOWED if shape.windowed else PROVEN
    if not table.proves(shape):
        return (f"the flex backend is proven exact (forward and backward against the dense reference) {table.describe()}; "
                f"this call is {shape}")
    return None


def attend(query, key, value, prepared, *, scale, dropout_p):
    """Backend ``attend``: query ``[1, np, Tq, hn]``, key ``[1, ng, T, hn]``, value ``[1, ng, T, dv]`` -> ``[1, np, Tq, dv]``,
    on the shapes of :data:`PROVEN` (:data:`PROVEN_WINDOWED` with a sliding window) only."""
    shape = AttentionShape.of(query, key, value, windowed=prepared.window is not None)
    problem = refusal(shape, batch=query.shape[0], dropout_p=dropout_p)
    if problem is not None:
        raise ValueError(f"{problem}; use backend='auto' (it picks a backend proven on this call) or 'dense'")
    return flex_tree_attention(query, key, value, prepared, softmax_scale=scale)

"""Tree attention: the backend registry, the per-micro-batch mask cache and :func:`tree_attention` (Megatron layout).

Shape legend: s = slots (query and key length, self-attention), b = batch (1 for a tree
micro-batch), np = query heads per TP rank, ng = key/value heads per TP rank (GQA: np % ng == 0),
hn = head dim.

Megatron hands ``core_attention`` ``query [s, b, np, hn]``, ``key``/``value [s, b, ng, hn]`` and
the ``attention_mask`` given to ``GPTModel.forward``. Here that mask is the interval vector
``subtree_end`` (int ``[b, s]``, see :mod:`megatron_tree.core.masks`): key j is visible to query i iff
``j <= i < subtree_end[b, j]``. The output is ``[s, b, np * hn]``.

Sliding window (``window`` W, Hugging Face's ``sliding_window``, megatron-core's ``window_size=(W - 1, 0)``):
key j is visible to query i iff it is visible in the tree and ``depth(i) - depth(j) < W``; the depths
come from ``subtree_end`` itself (:mod:`megatron_tree.core.masks`). Backends that take it declare
``windowed=True``; a windowed call is a shape of its own (:attr:`AttentionShape.windowed`), proven apart.

Backends turn the interval vector into what their kernel needs (``prepare``) and run attention
(``attend``). ``prepare`` runs at most once per micro-batch: its result is cached on the mask
tensor's memory, so the layers of a model and their recomputation share it. One module per
backend, registered here by name (:func:`register_tree_attention_backend` adds more):

* ``"dense"`` (:mod:`megatron_tree.attention.dense`): SDPA with the materialised mask; the
  reference, any device, dtype, head dims, dropout and sliding window.
* ``"flex"`` (:mod:`megatron_tree.attention.flex`): block-sparse FlexAttention (Triton) from the
  interval vector; CUDA, b = 1, no attention dropout, fp32 included; sliding window (blocks before
  every query's window skipped) where a GPU proved it (none yet).
* ``"fa4"`` (:mod:`megatron_tree.attention.fa4`): FlashAttention-4's block-sparse CuTe kernels;
  Hopper with ``flash-attn-4``, bf16, b = 1, no attention dropout, no sliding window.
* ``"cudnn_flex"`` (:mod:`megatron_tree.attention.cudnn_flex`): cuDNN frontend's interval-mask ("flex")
  CuTe kernels, the tree as each query's root-path intervals; Hopper / Blackwell with ``nvidia-cudnn-frontend``,
  bf16 / fp16, b = 1, no attention dropout, no sliding window.
* ``"auto"`` (the default) picks per call the fastest backend proven exact on it: ``"fa4"``; for a
  micro-batch without a branch (a forest of chains) where FA4 does not run, Transformer Engine's
  cuDNN varlen attention (:mod:`megatron_tree.attention.te_chains`); ``"flex"``; else ``"dense"``.
  Windowed calls: ``"flex"`` where proven, else ``"dense"``.

No kernel is trusted beyond the shapes whose gradients a GPU test compared: each backend module
has a ``PROVEN`` table (:class:`~megatron_tree.attention.shapes.ProvenShapes`: head dim, v head
dim, GQA ratio, dtype, GPU generation; FA4 also its pinned version) and runs a call only on a
shape it holds. ``auto``
warns once per shape when it passes over an installed fast kernel for that reason;
:mod:`megatron_tree.attention.conformance` is the GPU check that proves a backend on more shapes.

Context parallel (CP > 1, :mod:`megatron_tree.core.context_parallel`): each rank holds s of the
micro-batch's T slots and ``attention_mask`` is ``cat(slot_order, subtree_end)`` int ``[1, 2T]``.
Key and value are all-gathered over the CP group and put back into DFS order; the rank's s
queries (global slots ``slot_order[rank * s:(rank + 1) * s]``) attend to all T keys.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from megatron_tree.attention import cudnn_flex as cudnn_flex_attention
from megatron_tree.attention import dense as dense_attention
from megatron_tree.attention import fa4 as fa4_attention
from megatron_tree.attention import flex as flex_attention
from megatron_tree.attention import te_chains as chain_attention
from megatron_tree.attention.shapes import AttentionShape, device_generation
from megatron_tree.core import host_checks
from megatron_tree.core.masks import check_window
from megatron_tree.core.platform import have_transformer_engine

__all__ = [
    "PREPARED_MASKS",
    "TreeAttentionBackend",
    "backend_names",
    "get_tree_attention_backend",
    "register_tree_attention_backend",
    "tree_attention",
]


@dataclass(frozen=True)
class TreeAttentionBackend:
    """A way to run tree attention.

    prepare(subtree_end, query_slots=None[, window=W]) -> Any
        ``subtree_end`` int ``[b, s]`` (already validated); ``query_slots`` int ``[sq]`` or None:
        the slot of each query row (context parallel), None = all s slots in order; ``window`` (passed
        only for a windowed call, to backends with ``windowed=True``): the sliding window, an int >= 1.
        Returns what ``attend`` needs; it is computed once per micro-batch and window and cached, so
        build the expensive parts here.
    attend(query, key, value, prepared, *, scale, dropout_p) -> Tensor
        ``query [b, np, sq, hn]``, ``key [b, ng, s, hn]``, ``value [b, ng, s, dv]`` (GQA: np % ng == 0,
        query head h reads key/value head ``h // (np // ng)``). Returns ``[b, np, sq, dv]``; ``scale``
        multiplies ``q @ k^T``; ``dropout_p`` is the attention-probability dropout (0 in eval).
    refusal(shape, *, batch, dropout_p) -> str | None
        Why ``attend`` does not compute a call of this :class:`~megatron_tree.attention.shapes.AttentionShape`
        exactly (not proven on it, no such kernel here, dropout, b > 1), or None when it does. A kernel
        is trusted only on the shapes whose gradients a GPU test compared (its ``PROVEN`` table).
        ``shape.windowed`` says whether the call has a sliding window.
        Asked before every call: an explicit backend raises it, ``auto`` passes to the next backend.
    windowed
        ``prepare`` takes ``window=`` (a backend without it refuses every windowed call).
    """

    name: str
    prepare: Callable[[torch.Tensor], Any]
    attend: Callable[..., torch.Tensor]
    refusal: Callable[..., str | None]
    windowed: bool = False


_BACKENDS: dict[str, TreeAttentionBackend] = {}


def register_tree_attention_backend(backend: TreeAttentionBackend) -> None:
    """Make ``backend`` selectable by its name; a second backend of the same name is an error."""
    if not isinstance(backend, TreeAttentionBackend):
        raise TypeError(f"expected a TreeAttentionBackend, got {type(backend).__name__}")
    if backend.name in _BACKENDS:
        raise ValueError(f"a tree attention backend named {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, ``"auto"`` first (the choices of a ``backend`` setting)."""
    return ("auto", *sorted(n for n in _BACKENDS if n != "auto"))


def get_tree_attention_backend(name: str) -> TreeAttentionBackend:
    """The registered backend called ``name``."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown tree attention backend {name!r}; registered: {sorted(_BACKENDS)}"
        )
    return _BACKENDS[name]


for _name, _module, _windowed in (("dense", dense_attention, True), ("flex", flex_attention, True),
                                  ("fa4", fa4_attention, False), ("cudnn_flex", cudnn_flex_attention, False)):
    register_tree_attention_backend(
        TreeAttentionBackend(name=_name, prepare=_module.prepare, attend=_module.attend, refusal=_module.refusal,
                             windowed=_windowed)
    )

_PASSED_OVER: set[tuple[str, AttentionShape]] = set()
"""(backend, shape) pairs ``auto`` has warned about: a fast kernel here that is not proven on the shape."""


def _pass_over(name: str, shape: AttentionShape, reason: str) -> None:
    """Warn once per (backend, shape) that ``auto`` skips an installed fast kernel because it is unproven there."""
    if (name, shape) not in _PASSED_OVER:
        _PASSED_OVER.add((name, shape))
        warnings.warn(
            f"tree attention 'auto' does not use {name} for {shape}: {reason}. It runs a slower backend that is "
            f"exact there. To prove {name} on this shape, run `python -m megatron_tree.attention.conformance` on this "
            f"GPU (see the README, attention backends)",
            stacklevel=3,
        )


def _auto_prepare(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None, window: int | None = None) -> dict:
    """What ``auto`` may need, by kernel: ``"fa4"`` the FA4 block tables where those kernels run (CUDA
    Hopper/Blackwell, flash-attn-4); else ``"chains"`` = ``(cu_seqlens, max_seqlen)`` when the
    micro-batch has no branch, Transformer Engine is installed and every slot is a query; else
    ``"flex"`` on CUDA and ``"dense"`` elsewhere. ``attend`` adds a flex or dense mask later if the call's dtype, head dim or
    dropout needs one (a dict: the cached entry is updated in place, so that happens once per mask).
    With a sliding ``window`` nothing is built here: ``attend`` builds the flex or dense mask it uses."""
    prepared = {"masks": (subtree_end, query_slots), "window": window}
    if window is not None:  # FA4 and TE's chain path have no window; flex / dense are built when used
        return prepared
    cuda_one = subtree_end.is_cuda and subtree_end.shape[0] == 1
    if cuda_one and fa4_attention.fa4_available(subtree_end.device):
        prepared["fa4"] = fa4_attention.prepare(subtree_end, query_slots)
        return prepared
    if query_slots is None and cuda_one and have_transformer_engine():
        cu = chain_attention.chain_segments(subtree_end)
        if cu is not None:
            prepared["chains"] = (cu, int((cu[1:] - cu[:-1]).max()))
            return prepared
    if cuda_one:
        prepared["flex"] = flex_attention.prepare(subtree_end, query_slots)
    else:
        prepared["dense"] = dense_attention.prepare(subtree_end, query_slots)
    return prepared


def _auto_attend(query, key, value, prepared, *, scale, dropout_p):
    # The fastest kernel proven exact on this call, in order (benchmarks/attention_bench.py, H200):
    # a micro-batch without a branch (prepared where FA4 does not run) -> TE's cuDNN varlen attention;
    # -> FA4's block-sparse kernels (with or without branches: on the no-sharing batch they beat TE's
    # cuDNN THD varlen attention, 1.67 vs 2.25 ms); -> FlexAttention; else the dense reference. An
    # installed kernel passed over because it is not proven on the call is warned about once.
    masks, window = prepared["masks"], prepared["window"]
    extra = {} if window is None else {"window": window}
    shape = AttentionShape.of(query, key, value, windowed=window is not None)
    batch = masks[0].shape[0]
    if "chains" in prepared and query.dtype in (torch.bfloat16, torch.float16):
        reason = chain_attention.refusal(shape, dropout_p=dropout_p)
        if reason is None:
            return chain_attention.te_chain_attention(query, key, value, *prepared["chains"], scale=scale)
    if "fa4" in prepared:
        reason = fa4_attention.refusal(shape, batch=batch, dropout_p=dropout_p)
        if reason is None:
            return fa4_attention.attend(query, key, value, prepared["fa4"], scale=scale, dropout_p=dropout_p)
        if query.dtype == torch.bfloat16 and not dropout_p:
            _pass_over("fa4", shape, reason)
    if masks[0].is_cuda and not dropout_p:
        reason = flex_attention.refusal(shape, batch=batch, dropout_p=dropout_p)
        if reason is None:
            if "flex" not in prepared:
                prepared["flex"] = flex_attention.prepare(*masks, **extra)
            return flex_attention.attend(query, key, value, prepared["flex"], scale=scale, dropout_p=dropout_p)
        if batch == 1:
            _pass_over("flex", shape, reason)
    if "dense" not in prepared:
        prepared["dense"] = dense_attention.prepare(*masks, **extra)
    return dense_attention.attend(query, key, value, prepared["dense"], scale=scale, dropout_p=dropout_p)


register_tree_attention_backend(
    TreeAttentionBackend(name="auto", prepare=_auto_prepare, attend=_auto_attend, refusal=dense_attention.refusal,
                         windowed=True)
)


def check_subtree_end(subtree_end: torch.Tensor, batch: int, slots: int) -> None:
    """Raise unless ``subtree_end`` is an int tensor ``[batch, slots]`` (no host sync)."""
    if not isinstance(subtree_end, torch.Tensor):
        raise TypeError(
            f"tree attention needs attention_mask = the int interval vector [b, s] of a tree "
            f"micro-batch (TreeMicroBatch.attention_mask), got {type(subtree_end).__name__}"
        )
    if subtree_end.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"tree attention needs an int32/int64 interval vector as attention_mask, got dtype "
            f"{subtree_end.dtype} of shape {tuple(subtree_end.shape)}: pass "
            f"TreeMicroBatch.attention_mask, not a dense or boolean mask"
        )
    if tuple(subtree_end.shape) != (batch, slots):
        raise ValueError(
            f"tree attention_mask has shape {tuple(subtree_end.shape)}, expected [b, s] = "
            f"{[batch, slots]} (one subtree end per slot of the micro-batch)"
        )


def check_subtree_end_values(subtree_end: torch.Tensor) -> None:
    """Raise unless ``j < subtree_end[:, j] <= s`` for every slot j (one host sync, none for a mask
    ``TreeMicroBatch.to`` checked on the host: :mod:`megatron_tree.core.host_checks`)."""
    if host_checks.recall(subtree_end, "interval_vector"):
        return
    if not host_checks.interval_vector_ok(subtree_end):
        slots = subtree_end.shape[-1]
        idx = torch.arange(slots, device=subtree_end.device)
        bad = (~((subtree_end > idx) & (subtree_end <= slots))).nonzero()[:8].tolist()
        raise ValueError(
            f"tree attention_mask is not an interval vector: every slot j needs "
            f"j < subtree_end[b, j] <= {slots}; violated at [b, j] = {bad} with values "
            f"{[int(subtree_end[b, j]) for b, j in bad]}"
        )


class _PreparedMaskCache:
    """What each backend prepared for the last few masks, and for the masks someone :meth:`hold` s, keyed on the
    mask's memory.

    Keys are (backend, window, context parallel, device, data_ptr, shape, stride, version counter) (:meth:`lookup`:
    a caller's tag in place of the first three). The entry holds the mask tensor itself, so its memory cannot be reused by another tensor while the entry lives;
    ``detach()`` (done by activation recompute) shares memory and version counter, so a
    recomputed layer finds the entry its forward made. In-place edits bump the version and miss
    (edits through ``.data`` bypass the version counter: do not edit a mask in flight that way).
    At most ``capacity`` entries of masks nobody holds stay (the least recently used go first); the entries of a
    held mask stay until it is released (the schedule holds the masks of the device copies it reuses across passes).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, Any]] = OrderedDict()
        self._held: dict[tuple[str, int], int] = {}

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep the entries of ``tensors`` (masks, or what :meth:`lookup` keys on) until :meth:`release`; the caller
        keeps the tensors alive meanwhile. Holds count: each ``hold`` needs its ``release``."""
        for where in _places(tensors):
            self._held[where] = self._held.get(where, 0) + 1

    def release(self, tensors: Iterable[torch.Tensor]) -> None:
        """Undo one :meth:`hold` of ``tensors``; a mask no longer held loses its entries."""
        freed = set()
        for where in _places(tensors):
            count = self._held.pop(where, 0) - 1
            if count > 0:
                self._held[where] = count
            else:
                freed.add(where)
        for key in [k for k in self._entries if (k[1], k[2]) in freed]:
            del self._entries[key]

    def get(self, backend: TreeAttentionBackend, subtree_end: torch.Tensor, cp: tuple[int, int] | None = None,
            window: int | None = None, context: int = 0) -> Any:
        """``backend.prepare(subtree_end)``, computed on the first call for this mask (and ``window``: a sliding
        window, passed to ``prepare`` when not None). ``context`` C > 0: the queries are slots ``C..`` of
        ``subtree_end`` (a chunk behind its context, :func:`tree_attention`).

        ``cp = (rank, size)`` (context parallel): ``subtree_end`` is the CP mask ``[1, 2T]``
        (module docstring); returns ``(prepared for the rank's queries, inverse [T] int64: the
        rank-order position of each global slot)``."""
        extra = {} if window is None else {"window": window}

        def prepare() -> Any:
            if cp is not None:
                return _prepare_context_parallel(backend, subtree_end, *cp, **extra)
            check_subtree_end_values(subtree_end)
            if context:
                extra["query_slots"] = torch.arange(context, subtree_end.shape[-1], device=subtree_end.device)
            return backend.prepare(subtree_end, **extra)

        return self.lookup(subtree_end, (backend.name, window, cp, context), prepare)

    def lookup(self, tensor: torch.Tensor, tag: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, computed on the first call for ``tensor``'s memory and ``tag`` and cached like :meth:`get`'s
        entries: what a layer prepares once per micro-batch from a tensor every layer receives (a recurrent
        layer's scan layout from the interval vector, or from a packed row's ``cu_seqlens``)."""
        key = (
            tag,
            str(tensor.device),
            tensor.data_ptr(),
            tuple(tensor.shape),
            tensor.stride(),
            None if tensor.is_inference() else tensor._version,
        )
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit[1]
        prepared = make()
        self._entries[key] = (tensor, prepared)
        loose = [k for k in self._entries if (k[1], k[2]) not in self._held]
        for k in loose[: max(0, len(loose) - self.capacity)]:
            del self._entries[k]
        return prepared

    def clear(self) -> None:
        """Drop every cached entry (frees the prepared masks; held masks are prepared again when next used)."""
        self._entries.clear()


def _places(tensors: Iterable[torch.Tensor]) -> set[tuple[str, int]]:
    """(device, data_ptr) of each non-empty tensor (an empty one has no memory of its own to key on)."""
    return {(str(t.device), t.data_ptr()) for t in tensors if t.numel()}


def _prepare_context_parallel(backend: TreeAttentionBackend, mask: torch.Tensor, rank: int, size: int, **extra) -> tuple:
    """``(backend.prepare(subtree_end, this rank's query slots), inverse)`` from the CP mask ``[1, 2T]``
    (validated: the subtree ends, and the slot order is a permutation of ``0..T-1``; two host syncs)."""
    t = mask.shape[1] // 2
    order, subtree_end = mask[0, :t].long(), mask[:, t:]
    check_subtree_end_values(subtree_end)
    if not torch.equal(order.sort().values, torch.arange(t, device=order.device)):
        raise ValueError(
            "context-parallel attention_mask: its first T entries must be a permutation of the slots 0..T-1 "
            "(ContextParallelShard.attention_mask from megatron_tree.core.context_parallel.shard_micro_batch)"
        )
    s = t // size
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(t, device=order.device)
    return backend.prepare(subtree_end, order[rank * s : (rank + 1) * s], **extra), inverse


# Four entries of masks nobody holds: the micro-batch in flight plus one whose backward (and recompute) is
# pending, each with up to two masks (a model alternating sliding-window and full layers). The schedule holds the
# masks of the batch it last moved to the device (megatron_tree.mcore.schedule.device_copy: every pass over the same
# micro-batches reuses what was prepared). PREPARED_MASKS.clear() frees the cached masks.
PREPARED_MASKS = _PreparedMaskCache(capacity=4)


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    subtree_end: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    cp_group: torch.distributed.ProcessGroup | None = None,
    window: int | None = None,
    context: int = 0,
) -> torch.Tensor:
    """Attention of a DFS-laid-out tree micro-batch, Megatron layout.

    query [s, b, np, hn], key [s, b, ng, hn], value [s, b, ng, dv], subtree_end int [b, s] ->
    [s, b, np * dv] (dv = hn but in MLA). ``scale`` None means ``1 / sqrt(hn)``. With a ``cp_group``
    of more than one rank (context parallel, module docstring) the s slots are this rank's share of
    T = s * cp, b = 1, and ``subtree_end`` is the CP mask int ``[1, 2T]``. ``window`` (int >= 1, None =
    none): sliding window, key j visible to query i iff j is an ancestor-or-self of i and
    ``depth(i) - depth(j) < window`` (Hugging Face's ``sliding_window``). A named ``backend`` that is
    not proven on this call (its ``refusal``) raises ``ValueError`` with the reason; ``"auto"`` takes
    the fastest backend that is. ``context`` C > 0 (a chunk of a larger tree, :mod:`megatron_tree.core.chunks`):
    key / value are ``[C + s, ...]``, the C context slots first, ``subtree_end`` int ``[b, C + s]`` covers both,
    and the s queries are its slots ``C .. C + s - 1``.
    """
    check_window(window)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"expected query [s, b, np, hn], key [s, b, ng, hn] and value [s, b, ng, dv], got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    s, b, n_q, hn = query.shape
    if isinstance(subtree_end, torch.Tensor) and subtree_end.device != query.device:
        raise ValueError(
            f"attention_mask is on {subtree_end.device} but query is on {query.device}; move the "
            f"micro-batch to the model's device (TreeMicroBatch.to)"
        )
    if key.shape[0] != s + context or key.shape[1] != b or key.shape[3] != hn or n_q % key.shape[2]:
        raise ValueError(
            f"tree attention is self-attention over one micro-batch{f' behind {context} context slots' if context else ''}: "
            f"key/value must be [{s + context}, {b}, ng, {hn}] with {n_q} % ng == 0, got {tuple(key.shape)}"
        )
    impl = get_tree_attention_backend(backend)
    shape = AttentionShape(hn, value.shape[3], n_q // key.shape[2], query.dtype, device_generation(query.device),
                           windowed=window is not None)
    reason = impl.refusal(shape, batch=b, dropout_p=dropout_p)
    if reason is None and window is not None and not impl.windowed:
        reason = f"the {backend} backend takes no sliding window (registered without windowed=True)"
    if reason is not None:
        raise ValueError(
            f"tree attention backend {backend!r} does not run this call: {reason}. Use backend='auto' (the fastest "
            f"backend proven on each call) or 'dense' (the reference; any shape, dtype and device)"
        )
    cp = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
    if cp > 1 and context:
        raise ValueError(
            f"a chunk's context ({context} slots kept by earlier chunks) cannot run under context parallel ({cp} "
            f"ranks): pack with MicroBatchSpec(chunk_trees=False) or run with context_parallel_size=1"
        )
    if cp > 1:
        from megatron_tree.core.context_parallel import gather_slots

        if isinstance(subtree_end, torch.Tensor) and (b != 1 or tuple(subtree_end.shape) != (1, 2 * s * cp)):
            raise ValueError(
                f"under context parallel ({cp} ranks) tree attention takes one micro-batch (b = 1, got {b}) and "
                f"attention_mask = the shard's int [1, 2T] = [1, {2 * s * cp}] (ContextParallelShard.attention_mask), "
                f"got shape {tuple(getattr(subtree_end, 'shape', ()))}"
            )
        check_subtree_end(subtree_end, 1, 2 * s * cp)
        prepared, inverse = PREPARED_MASKS.get(impl, subtree_end, (torch.distributed.get_rank(cp_group), cp), window)
        # All T keys / values in DFS order: gathered in CP-rank order, then permuted back.
        key, value = (gather_slots(x, cp_group).index_select(0, inverse) for x in (key, value))
    else:
        check_subtree_end(subtree_end, b, s + context)
        prepared = PREPARED_MASKS.get(impl, subtree_end, window=window, context=context)
    out = impl.attend(
        query.permute(1, 2, 0, 3),
        key.permute(1, 2, 0, 3),
        value.permute(1, 2, 0, 3),
        prepared,
        scale=1.0 / math.sqrt(hn) if scale is None else scale,
        dropout_p=dropout_p,
    )
    return out.permute(2, 0, 1, 3).reshape(s, b, n_q * value.shape[3])

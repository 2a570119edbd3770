"""Tree attention through cuDNN frontend's interval-mask ("flex") attention kernels (Hopper, Blackwell).

Shape legend: b = batch (1), h = query heads, hkv = key/value heads (h % hkv == 0), T = slots (keys),
Tq = query rows (T, a context-parallel rank's share, or a chunk's queries behind its context), d / dv = q-k / v
head dims, M = intervals per query row.

Mask: key j is visible to query i iff ``j <= i < subtree_end[j]`` (:mod:`megatron_tree.core.masks`). In DFS
order the keys a query sees are its root path, a union of runs of consecutive slots: a run breaks where the
path enters a child that does not follow its parent directly (a later sibling). cuDNN frontend's
``cudnn.flex_attention`` takes exactly that, per query row: ``mask_func`` int32 ``[1, 2M - 1, Tq]``, the
endpoints of M sorted half-open intervals ``[0, F0) U [F1, F2) U ...``. :func:`tree_intervals` builds it
from ``subtree_end`` on the device, vectorised (one pass per interval level, not per token); a GRPO prompt
and its samples need M = 2, a deep multi-turn tree one interval per branch taken off the first-child path.

Each tree is its own sequence: a micro-batch's trees (every slot a query) go to the kernels' varlen (THD) call, one
sequence per tree (:func:`tree_segments`; a run of one-slot trees such as the padding is one more), with the intervals
local to each sequence (:func:`segment_intervals`). A varlen kernel tiles each sequence from its own first slot, so no
tree's rows visit a tile it shares with the tree before it (on the 32k GRPO micro-batch of ``attention_bench.py``
1,026 -> 897 partly masked tiles, tile ceiling 0.913 -> 0.930). Query rows other than the slots (context parallel, a chunk behind its context) are
one sequence.

The kernels are the ``nvidia-cudnn-frontend`` package's (pinned to :data:`CUDNN_FRONTEND_VERSION`; they are
CuTe DSL kernels, like FlashAttention-4's, with a persistent compile cache): a *mask plan* classifies the
(query, key) tiles once per micro-batch and attention shape (``create_mask_plan``; host syncs) and materialises
the mask of the partial ones; full tiles skip the mask, empty tiles are never loaded; forward and backward read the
same plan. Plans are built on first use per (head counts, head dims, dtype, backward) and
kept in the :class:`CudnnFlexTreeMask`, so the layers of a model share one; so are the kernel launches of each tensor
geometry, resolved once by the frontend's own code and then launched without its per-call Python
(:mod:`megatron_tree.attention.cudnn_flex_kernels`).

The mask's and the plans' host syncs (the trees' first slots, the interval count, the plan's tile counts) would wait
for everything queued on the compute stream, the previous micro-batch's backward included, and leave the GPU idle
while the host then builds the plan. A mask that came with its host copy (``TreeMicroBatch.to`` notes it,
:mod:`megatron_tree.core.host_checks`) is built off that stream: intervals and segments on the CPU, copied to the
GPU and planned on a side stream, so each sync waits only for the build's own kernels while the compute stream runs
on. The compute stream waits for the build on the GPU (no host sync), and the build's tensors are recorded as used by
it (``record_stream``), so their memory is not reused while its kernels may still read them.

bf16 / fp16 only (the kernels have no fp32 path). Trusted only where a GPU test compared its gradients
(:data:`PROVEN`); every other call is refused and ``auto`` sends it to a backend proven there. No sliding
window, no attention dropout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from megatron_tree.attention.availability import pinned_import_problem, unavailable_reason
from megatron_tree.attention.flex import _check_qkv, _check_subtree_end
from megatron_tree.attention.shapes import AttentionShape, ProvenShapes
from megatron_tree.core import host_checks
from megatron_tree.core.masks import tree_depths

__all__ = [
    "CUDNN_FRONTEND_VERSION",
    "CudnnFlexTreeMask",
    "PROVEN",
    "WINDOW_REFUSAL",
    "attend",
    "cudnn_flex_available",
    "cudnn_flex_tree_attention",
    "cudnn_flex_tree_mask",
    "cudnn_flex_unavailable_reason",
    "intervals_to_mask",
    "prepare",
    "refusal",
    "segment_intervals",
    "tree_intervals",
    "tree_segments",
]

CUDNN_FRONTEND_VERSION = "1.32.0"
"""The ``nvidia-cudnn-frontend`` release this module is written against (its API is new and still moving)."""

_PROVEN_EVIDENCE = (
    "nvidia-cudnn-frontend 1.32.0, torch 2.11, out / dQ / dK / dV against the dense fp64 reference (the rule: 2x dense "
    "bf16's error), on an H100: benchmarks/results/te/conformance_cudnn_flex_per_tree_h100.json (raw kernels, head dims "
    "64 / 128 at GQA 1 / 2 / 4 / 8 on a GRPO and a multi-turn tree, one varlen sequence per tree, and on GRPO query "
    "slots as one sequence: at most 1.50x) and te/cudnn_flex_tests_per_tree_h100.txt (GRPO, multi-turn and eight-tree "
    "micro-batches with padding, 16/8 heads d 128 and 8/8 d 64); context-parallel query slots also on an H200, "
    "te/conformance_cudnn_flex.json (at most 1.48x)"
)
PROVEN = ProvenShapes.grid(head_dims=(64, 128), gqa_ratios=(1, 2, 4, 8), dtypes=(torch.bfloat16,), devices=("sm90",),
                           evidence=_PROVEN_EVIDENCE)
"""Where the kernels of :data:`CUDNN_FRONTEND_VERSION` were proven exact, in both of this module's calls (one varlen
sequence per tree; query slots as one sequence) (forward and backward against the dense fp64 reference,
:mod:`megatron_tree.attention.conformance`): bf16 on Hopper, head dims 64 and 128 with MHA and GQA 2:1, 4:1, 8:1.
Every other call (other head dims, fp16, a v head dim of its own, other GPU generations) is refused. The launches of
:mod:`megatron_tree.attention.cudnn_flex_kernels` were checked against the frontend's own call on an H100
(te/cudnn_flex_tests_launch_h100.txt). ``auto`` does not pick it: on an H100 its per-tree call is 2-16% faster than
FA4's, but the 0.6B shape's tree step is 1% faster to 5% slower on GRPO trees and 12-17% slower on multi-turn trees
(with the launches too, by the fastest steps of a noisy machine: 4% and 9% slower; with the mask also built off the
compute stream, 3% faster on GRPO and even on multi-turn, one noisy H100: not settled; docs/results.md)."""


def tree_intervals(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None) -> torch.Tensor:
    """The keys each query row sees, as sorted half-open slot intervals: int32 ``[1, 2M - 1, Tq]``.

    ``subtree_end`` int [T] or [1, T] (``j < subtree_end[j] <= T``, not re-checked); ``query_slots`` int [Tq] (the
    slot of each query row) or None (row i is slot i). Row r's intervals are ``[0, F[0, 0, r])`` and
    ``[F[0, 2u - 1, r], F[0, 2u, r])`` for u = 1 .. M - 1: its root path, outermost first; rows with fewer than M
    runs lead with empty intervals ``[0, 0)``.

    A *run start* is a slot whose parent is not the slot before it (a root, or a child after a sibling's
    subtree); the runs of a query's path begin at its run-start ancestors-or-self, and a run ends one past the
    parent of the next run's start. Host syncs: the run starts and branch slots (counts), M and whether a root run needs
    a leading empty interval.
    """
    end = _check_subtree_end(subtree_end).long()
    t = end.shape[0]
    slot = torch.arange(t, device=end.device)
    depth = tree_depths(end)
    starts = torch.ones_like(slot, dtype=torch.bool)
    starts[1:] = end[:-1] <= slot[1:]  # the slot before is not its parent (not an ancestor at all)
    first = slot[starts]
    parent = torch.full_like(slot, -1)  # set at the run starts, the only slots whose parent is read below
    parent[first] = _run_start_parents(end, depth, first)
    # runs[i]: run starts among i's ancestors-or-self (j <= i < end[j]); +1 at j, -1 at end[j], prefix sum.
    delta = torch.zeros(t + 1, dtype=torch.long, device=end.device)
    delta.index_add_(0, first, torch.ones_like(first))
    delta.index_add_(0, end[first], -torch.ones_like(first))
    runs = delta.cumsum(0)[:t]
    run_start = torch.where(starts, slot, -1).cummax(0).values  # the run holding each slot begins here
    root = torch.where(depth == 0, slot, -1).cummax(0).values  # the root of each slot's tree
    rows = slot if query_slots is None else query_slots.reshape(-1).long()
    runs, tq = runs[rows], rows.shape[0]
    top = runs.max()
    most, lead = (int(x) for x in torch.stack([top, ((runs == top) & (root[rows] > 0)).any()]).tolist())
    m = most + lead  # interval 0 begins at 0: a row of M runs whose root is not slot 0 needs an empty one first
    begin = torch.zeros(m, tq, dtype=torch.long, device=end.device)
    finish = torch.zeros_like(begin)
    cur_start, cur_end = run_start[rows], rows + 1
    for level in range(most):  # innermost run first, placed last
        live = runs > level
        col = m - 1 - level
        begin[col] = torch.where(live, cur_start, 0)
        finish[col] = torch.where(live, cur_end, 0)
        up = parent[cur_start].clamp_min(0)
        cur_end, cur_start = up + 1, run_start[up]
    endpoints = torch.empty(2 * m - 1, tq, dtype=torch.int32, device=end.device)
    endpoints[0] = finish[0]
    endpoints[1::2] = begin[1:]
    endpoints[2::2] = finish[1:]
    return endpoints[None]


def _run_start_parents(end: torch.Tensor, depth: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The parent slot (-1 for a root) of each run start ``first`` int64 [R] (slots whose parent is not the slot
    before), from ``end`` int64 [T] and ``depth`` (:func:`~megatron_tree.core.masks.tree_depths`) [T].

    A non-root run start s of depth d is a later child: its parent is the last slot before s of depth d - 1
    (DFS pre-order, as :func:`~megatron_tree.core.masks.window_starts` finds ancestors), and that slot has two
    children or more (s and the slot after it). So the search runs over those *branch slots*, sorted by (depth,
    slot), not over every slot: at 16k slots a few dozen of them (one host sync, the count)."""
    t = end.shape[0]
    slot = torch.arange(t - 1, device=end.device)
    # j branches: j + 1 is its child (end[j] > j + 1) and j's subtree goes on after that child's (end[j + 1] < end[j])
    branch = slot[(end[:-1] > slot + 1) & (end[1:] < end[:-1])]
    key = torch.cat([end.new_full((1,), -1), (depth[branch] * (t + 1) + branch).sort().values])  # -1: below all
    d = depth[first]
    target = (d - 1).clamp_min(0) * (t + 1)
    found = key[torch.searchsorted(key, target + first) - 1] - target  # the last key below (d - 1, s)
    return torch.where(d > 0, found, -1)


def tree_segments(subtree_end: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` int32 ``[S + 1]`` cutting ``subtree_end``'s slots (int [T] or [1, T], not re-checked) at every
    tree's first slot, a run of one-slot trees (the padding) kept in one segment: each tree one sequence of a varlen
    call. ``cu_seqlens[0] = 0``, ``cu_seqlens[-1] = T``."""
    end = subtree_end.reshape(-1).long()
    t = end.shape[0]
    root = tree_depths(end) == 0
    single_root = root & (end - torch.arange(t, device=end.device) == 1)
    after_single_root = torch.zeros_like(root)
    after_single_root[1:] = single_root[:-1]
    starts = root & ~(single_root & after_single_root)
    starts[0] = True
    first = torch.nonzero(starts).reshape(-1)
    return torch.cat([first, first.new_tensor([t])]).to(torch.int32)


def _row_segments(cu_seqlens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, length)`` int64 [rows]: the first slot and the length of each row's segment of ``cu_seqlens``
    (``rows`` = its last entry, T)."""
    lengths = cu_seqlens.diff().long()
    return (torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=rows),
            torch.repeat_interleave(lengths, lengths, output_size=rows))


def segment_intervals(subtree_end: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """:func:`tree_intervals`' endpoints ``[1, 2M - 1, T]`` made local to each row's segment of ``cu_seqlens``
    (:func:`tree_segments`): its first slot subtracted, the empty leading intervals ``[0, 0)`` left at 0. Row r of
    segment s sees the segment's keys ``[0, F[0, 0, r])`` and ``[F[0, 2u - 1, r], F[0, 2u, r])``."""
    intervals = tree_intervals(subtree_end)
    first = _row_segments(cu_seqlens, intervals.shape[-1])[0]
    return (intervals - first.to(torch.int32)).clamp_min(0).to(torch.int32).contiguous()


def intervals_to_mask(intervals: torch.Tensor, num_slots: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The dense mask ``[Tq, T]`` bool (True = attend) of ``[1, 2M - 1, Tq]`` endpoints: :func:`tree_intervals`' (keys
    numbered from slot 0), or with ``cu_seqlens`` :func:`segment_intervals`' (keys numbered from each row's segment
    start, Tq = T, no key outside the row's segment)."""
    f = intervals[0].long()
    key = torch.arange(num_slots, device=f.device)[None, None]
    if cu_seqlens is None:
        key_local, inside = key, True
    else:
        first, length = (x[None, :, None] for x in _row_segments(cu_seqlens, f.shape[1]))
        key_local = key - first
        inside = (key_local >= 0) & (key_local < length)
    begin = torch.cat([torch.zeros_like(f[:1]), f[1::2]])  # [M, Tq]
    finish = f[0::2]
    return ((key_local >= begin[..., None]) & (key_local < finish[..., None]) & inside).any(0)


def cudnn_flex_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the cudnn_flex backend cannot run on ``device`` (default: the current CUDA device), None if it can."""
    device = None if device is None else torch.device(device)
    missing = pinned_import_problem("nvidia-cudnn-frontend", CUDNN_FRONTEND_VERSION, "cudnn.flex_attention")
    return unavailable_reason("cudnn_flex", device, missing, "cudnn_flex")


def cudnn_flex_available(device: torch.device | None = None) -> bool:
    """True when :func:`cudnn_flex_tree_attention` runs on ``device``."""
    return cudnn_flex_unavailable_reason(device) is None


@dataclass
class CudnnFlexTreeMask:
    """One micro-batch's tree mask for the cuDNN flex kernels (built once, shared by all layers).

    ``intervals``: int32 ``[1, 2M - 1, Tq]``, :func:`segment_intervals`' when ``cu_seqlens`` is set (int32 [S + 1],
    :func:`tree_segments`: the varlen call, one sequence per tree, ``max_seqlen`` its longest), else
    :func:`tree_intervals`' (one sequence); ``num_slots`` T, ``num_queries`` Tq; ``plans``: the cuDNN mask plans built
    so far, by (h, hkv, d, dv, dtype, with backward); ``launches``: the kernel launches resolved for them so far
    (:func:`megatron_tree.attention.cudnn_flex_kernels.flex_attention`); ``stream``: the side stream the mask was
    copied to the GPU on and its plans are built on (module docstring), None for the current stream.
    """

    intervals: torch.Tensor
    num_slots: int
    num_queries: int
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    plans: dict = field(default_factory=dict)
    launches: dict = field(default_factory=dict)
    stream: torch.cuda.Stream | None = None

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool):
        """The mask plan for q ``[1, Tq, h, d]``, k ``[1, T, hkv, d]``, v ``[1, T, hkv, dv]`` (BSHD); one with backward
        payloads serves forward-only calls too. The plan reads only q / k / v's shapes, so it may be built on
        :attr:`stream` while the compute stream is still writing them."""
        shape = (q.shape[2], k.shape[2], q.shape[3], v.shape[3], q.dtype)
        found = self.plans.get((*shape, True)) or (None if backward else self.plans.get((*shape, False)))
        if found is None:
            if self.stream is None:
                found = self._build_plan(q, k, v, backward)
            else:
                with torch.cuda.stream(self.stream):
                    found = self._build_plan(q, k, v, backward)
                _hand_over(found, self.stream, torch.cuda.current_stream(q.device))
            self.plans[(*shape, backward)] = found
        return found

    def _build_plan(self, q, k, v, backward: bool):
        from cudnn.flex_attention import create_mask_plan

        if self.cu_seqlens is None:
            return create_mask_plan(self.intervals, q, k, v, build_backward=backward)
        return create_mask_plan(self.intervals, *(x.squeeze(0) for x in (q, k, v)),  # THD [T, heads, d]
                                cu_seqlens_q=self.cu_seqlens, cu_seqlens_k=self.cu_seqlens,
                                max_seqlen_q=self.max_seqlen, max_seqlen_k=self.max_seqlen, build_backward=backward)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream per device for the masks built from a host copy (module docstring)."""
    return torch.cuda.Stream(device)


def _device_tensors(obj, device: torch.device) -> list[torch.Tensor]:
    """Every tensor on ``device`` that ``obj`` holds, through attributes, slots, tuples, lists and dicts (each object
    once)."""
    found, seen, todo = [], set(), [obj]
    while todo:
        item = todo.pop()
        if id(item) in seen or item is None or isinstance(item, (str, bytes, int, float, bool, torch.dtype,
                                                                   torch.device, type)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.device == device:
                found.append(item)
        elif isinstance(item, (tuple, list, set, frozenset)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        else:
            todo.extend(vars(item).values() if hasattr(item, "__dict__") else ())
            todo.extend(getattr(item, name, None) for cls in type(item).__mro__
                        for name in getattr(cls, "__slots__", ()))
    return found


def _hand_over(obj, side: torch.cuda.Stream, main: torch.cuda.Stream) -> None:
    """Let ``main`` use what was built on ``side``: ``main`` waits for ``side``'s work so far (on the GPU, no host
    sync) and every tensor of ``obj`` on its device is recorded as used by ``main`` (its memory is not reused before
    ``main``'s work queued so far is done)."""
    main.wait_stream(side)
    for tensor in _device_tensors(obj, main.device):
        tensor.record_stream(main)


def cudnn_flex_tree_mask(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None) -> CudnnFlexTreeMask:
    """The cuDNN flex mask of a tree micro-batch: ``subtree_end`` int [T] or [1, T], ``query_slots`` int [Tq] or None
    (None: one varlen sequence per tree; query slots: one sequence). Host syncs: the interval count; without query
    slots also the trees' first slots (:func:`tree_segments`) and the longest tree. A CUDA ``subtree_end`` whose host
    copy ``TreeMicroBatch.to`` noted, without query slots, is built from that copy on a side stream (module
    docstring): no sync with the compute stream."""
    end = _check_subtree_end(subtree_end)
    if query_slots is not None:
        intervals = tree_intervals(end, query_slots)
        return CudnnFlexTreeMask(intervals, end.shape[0], intervals.shape[-1])
    host = host_checks.recall(subtree_end, "host_copy") if end.is_cuda else None
    source = end if host is None else _check_subtree_end(host)
    cu = tree_segments(source)
    intervals, longest = segment_intervals(source, cu), int(cu.diff().max())
    if host is None:
        return CudnnFlexTreeMask(intervals, end.shape[0], end.shape[0], cu, longest)
    side = _side_stream(end.device)
    with torch.cuda.stream(side):
        intervals, cu = (x.pin_memory().to(end.device, non_blocking=True) for x in (intervals, cu))
    _hand_over((intervals, cu), side, torch.cuda.current_stream(end.device))
    return CudnnFlexTreeMask(intervals, end.shape[0], end.shape[0], cu, longest, stream=side)


def _flex(query, key, value, mask: CudnnFlexTreeMask, softmax_scale: float) -> torch.Tensor:
    """The kernels as they are (the conformance harness measures them raw): query [1, h, Tq, d], key [1, hkv, T, d],
    value [1, hkv, T, dv] -> [1, h, Tq, dv]. Launched per call without the frontend's Python
    (:mod:`megatron_tree.attention.cudnn_flex_kernels`)."""
    from megatron_tree.attention.cudnn_flex_kernels import flex_attention

    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # BSHD views, last dim contiguous
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    plan = mask.plan(q, k, v, backward)
    if mask.cu_seqlens is None:
        return flex_attention(q, k, v, plan, softmax_scale, mask.launches).transpose(1, 2)
    # squeeze, not [0]: select's backward would allocate, zero and copy into a whole new dQ / dK / dV
    thd = (x.squeeze(0) for x in (q, k, v))
    return flex_attention(*thd, plan, softmax_scale, mask.launches).unsqueeze(0).transpose(1, 2)


def cudnn_flex_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: CudnnFlexTreeMask,
    *,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Tree attention by cuDNN frontend's flex kernels, on the shapes they are proven on. Differentiable.

    query [1, h, Tq, d], key [1, hkv, T, d], value [1, hkv, T, dv] (bf16, CUDA), ``mask`` from
    :func:`cudnn_flex_tree_mask`; ``softmax_scale`` None = ``1 / sqrt(d)``. Returns [1, h, Tq, dv]. A call
    :data:`PROVEN` does not hold is refused (``ValueError``, with what to use).
    """
    _check_qkv(query, key, value, mask.num_slots, mask.num_queries)
    reason = refusal(AttentionShape.of(query, key, value), batch=query.shape[0], dropout_p=0.0)
    if reason is not None:
        raise ValueError(f"{reason}. Use backend='auto' (it sends such calls to a backend proven there) or 'dense'")
    if mask.intervals.device != query.device:
        raise ValueError(f"the cudnn_flex tree mask is on {mask.intervals.device} but query is on {query.device}")
    return _flex(query, key, value, mask, query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)


WINDOW_REFUSAL = "the cudnn_flex backend has no sliding-window mask (the window is not written into its intervals)"
"""Why a windowed call does not run on cudnn_flex."""


def refusal(shape: AttentionShape, *, batch: int, dropout_p: float) -> str | None:
    """Backend ``refusal``: why the cudnn_flex backend does not compute a call of ``shape`` exactly, None when it does."""
    if shape.windowed:
        return WINDOW_REFUSAL
    if dropout_p:
        return f"the cudnn_flex backend has no attention dropout (attention_dropout={dropout_p})"
    if shape.dtype not in (torch.bfloat16, torch.float16):
        return f"cuDNN frontend's flex kernels run bf16/fp16, not {shape.dtype}"
    if batch != 1:
        return f"the cudnn_flex backend takes one micro-batch (b = 1), got b = {batch}"
    unavailable = cudnn_flex_unavailable_reason(None if shape.device.startswith("sm") else torch.device(shape.device))
    if unavailable is not None:
        return unavailable
    if not PROVEN.proves(shape):
        return (f"cuDNN frontend {CUDNN_FRONTEND_VERSION}'s flex attention is proven exact (forward and backward against "
                f"the dense reference) {PROVEN.describe()}; this call is {shape}")
    return None


def prepare(subtree_end: torch.Tensor, query_slots: torch.Tensor | None = None) -> CudnnFlexTreeMask:
    """Backend ``prepare``: :func:`cudnn_flex_tree_mask` (b = 1)."""
    if subtree_end.dim() != 2 or subtree_end.shape[0] != 1:
        raise ValueError(f"the cudnn_flex tree attention backend takes one micro-batch mask [1, T], got shape "
                         f"{tuple(subtree_end.shape)}")
    return cudnn_flex_tree_mask(subtree_end, query_slots)


def attend(query, key, value, prepared, *, scale, dropout_p):
    """Backend ``attend``: query ``[1, np, Tq, hn]``, key ``[1, ng, T, hn]``, value ``[1, ng, T, dv]`` -> ``[1, np, Tq, dv]``."""
    if dropout_p:
        raise ValueError(f"the cudnn_flex backend has no attention dropout (attention_dropout={dropout_p}); use 'dense'")
    return cudnn_flex_tree_attention(query, key, value, prepared, softmax_scale=scale)

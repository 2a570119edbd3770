"""Context parallel for tree micro-batches: the slots of one micro-batch split over CP ranks.

Shape legend: T = slots of the micro-batch (a multiple of ``cp * CP_CHUNKS``), cp = CP ranks,
s = T / cp slots per rank, N = next-token targets of the micro-batch, n = its sequences,
N_r / n_r = the targets / sequences whose predicting / last slot lives on rank r.

Layout. T is cut into ``cp * k`` equal chunks (k in 1, 2, 4, 8 chunks per rank) and each rank
gets k of them, so every rank holds s slots (the linear layers' work is even) and the sum of
its slots' attention work is balanced: slot i attends to its root path, ``depth_i + 1`` keys
(a padding slot to itself), so deep slots cost more than shallow ones. Chunks go to ranks by
longest-processing-time first with k per rank; the k with the least imbalance wins (fewer
chunks on a tie within 1%). A rank's slots keep their DFS order.

``slot_order`` [T] lists the global slot of every position in CP-rank order: rank r's local
slot i is global slot ``slot_order[r * s + i]``. Tree attention on rank r all-gathers K/V over
the CP group (``gather_slots``: all-gather forward, reduce-scatter backward), puts them back into
DFS order, and attends with its s queries to all T keys under the interval mask: key j is
visible to (global) query g iff ``j <= g < subtree_end[j]``. The model therefore takes, under
CP, ``attention_mask`` = ``cat(slot_order, subtree_end)`` int32 ``[1, 2T]``
(:attr:`ContextParallelShard.attention_mask`).

Outputs. The last stage of rank r computes the log-probs (values, ...) of the targets whose
predicting slot it holds; :func:`gather_targets` puts them into the full ``[N]`` layout on every
CP rank (one SUM all-reduce of N numbers; its backward takes the rank's own entries). Each CP
rank then computes the same loss from the same ``[N]`` vector; backpropagating it reaches the
rank's own slots only, and Megatron's DDP sums gradients over the data- and context-parallel
ranks, so the sum is the full gradient. No Megatron import here: process groups are arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tree.core.microbatch import TreeMicroBatch

__all__ = [
    "CP_CHUNKS",
    "ContextParallelShard",
    "context_parallel_layout",
    "gather_slots",
    "gather_targets",
    "padded_slots",
    "shard_micro_batch",
    "slot_multiple",
]

CP_CHUNKS = 8
"""Most chunks per CP rank; a CP micro-batch's slot count is a multiple of ``cp * CP_CHUNKS``."""


def _assign(work: torch.Tensor, cp: int, k: int) -> tuple[list[list[int]], list[int]]:
    """Chunks of ``work`` [T] (``cp * k`` equal ones) to ranks, k each, longest first to the least
    loaded rank with room. Returns (chunk ids per rank, ascending; work per rank)."""
    per_chunk = work.view(cp * k, -1).sum(1).tolist()
    ranks: list[list[int]] = [[] for _ in range(cp)]
    loads = [0] * cp
    for c in sorted(range(cp * k), key=lambda c: (-per_chunk[c], c)):
        r = min((r for r in range(cp) if len(ranks[r]) < k), key=lambda r: (loads[r], r))
        ranks[r].append(c)
        loads[r] += per_chunk[c]
    return [sorted(chunks) for chunks in ranks], loads


def slot_multiple(*, cp: int = 1, sequence_parallel: int = 1) -> int:
    """The multiple every micro-batch's slot count is padded to (the one padding rule): ``sequence_parallel``
    (the TP size when sequence parallel splits the slots over TP ranks, else 1) times ``cp * CP_CHUNKS``
    under context parallel (``cp > 1``)."""
    return sequence_parallel * (cp * CP_CHUNKS if cp > 1 else 1)


def padded_slots(num_slots: int, multiple: int) -> int:
    """``num_slots`` rounded up to a multiple of ``multiple`` (:func:`slot_multiple`)."""
    return -(-num_slots // multiple) * multiple


def context_parallel_layout(position_ids: torch.Tensor, num_tokens: int, cp: int) -> tuple[torch.Tensor, list[int]]:
    """``(slot_order [T] int64, attention pairs per rank)`` for a micro-batch of T slots over ``cp`` ranks.

    ``position_ids`` [T] or [1, T] are the slots' depths; slots ``[num_tokens, T)`` are padding.
    T must be a multiple of ``cp * CP_CHUNKS``. Deterministic: every CP rank computes the same layout.
    """
    depth = position_ids.reshape(-1).to("cpu", torch.int64)
    t = depth.numel()
    if t % (cp * CP_CHUNKS):
        raise ValueError(
            f"a context-parallel micro-batch needs a slot count that is a multiple of cp * {CP_CHUNKS} = "
            f"{cp * CP_CHUNKS}, got {t}; pad it with mb.padded_to(...)"
        )
    work = depth + 1
    work[num_tokens:] = 1  # a padding slot sees only itself
    best = None
    for k in (1, 2, 4, 8):
        ranks, loads = _assign(work, cp, k)
        imbalance = max(loads) / (sum(loads) / cp)
        if best is None or imbalance < best[0] - 0.01:
            best = (imbalance, k, ranks, loads)
    _, k, ranks, loads = best
    size = t // (cp * k)
    chunk_slots = torch.arange(t).view(cp * k, size)
    order = torch.cat([chunk_slots[chunks].reshape(-1) for chunks in ranks])
    return order, loads


@dataclass(frozen=True, kw_only=True)
class ContextParallelShard:
    """Rank ``rank``'s part of a tree micro-batch under context parallel (module docstring).

    Model inputs (device tensors; move with :meth:`to`):
      input_ids       LongTensor [1, s]   tokens of this rank's slots.
      position_ids    LongTensor [1, s]   their depths (RoPE positions).
      attention_mask  IntTensor  [1, 2T]  int32 ``cat(slot_order, subtree_end)``: the CP interval encoding.
      multiplicity    LongTensor [1, s]   sequences through each of this rank's slots (0 = padding).
    Output gather:
      target_slots    LongTensor [N_r]    local slot predicting each of this rank's targets.
      target_labels   LongTensor [N_r]    their labels.
      target_index    LongTensor [N_r]    their index in the micro-batch's ``[N]`` log-prob layout.
      last_slots      LongTensor [n_r]    local slot of the last token of the sequences ending here.
      last_index      LongTensor [n_r]    their index in the micro-batch's sequence order.
    Host ints: ``rank``, ``size`` (cp), ``num_targets`` (N), ``num_sequences`` (n), ``pairs`` (attention
    (query, key) pairs per rank), ``tokens`` (unpadded slots per rank).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    multiplicity: torch.Tensor
    target_slots: torch.Tensor
    target_labels: torch.Tensor
    target_index: torch.Tensor
    last_slots: torch.Tensor
    last_index: torch.Tensor
    rank: int
    size: int
    num_targets: int
    num_sequences: int
    pairs: list[int]
    tokens: list[int]

    @property
    def num_slots(self) -> int:
        """s: this rank's slots."""
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ContextParallelShard":
        """Copy with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


def shard_micro_batch(mb: TreeMicroBatch, cp: int, rank: int) -> ContextParallelShard:
    """Rank ``rank`` of ``cp``'s :class:`ContextParallelShard` of ``mb`` (T a multiple of ``cp * CP_CHUNKS``;
    pad with ``mb.padded_to``). Host-side work on ``mb``'s tensors (move the shard with ``.to``)."""
    if not (isinstance(cp, int) and cp >= 1 and isinstance(rank, int) and 0 <= rank < cp):
        raise ValueError(f"need 0 <= rank < cp, got rank={rank!r}, cp={cp!r}")
    cpu = mb.to("cpu")
    order, pairs = context_parallel_layout(cpu.position_ids, cpu.num_tokens, cp)
    t = cpu.num_slots
    s = t // cp
    position = torch.empty_like(order)
    position[order] = torch.arange(t)  # rank-order position of every global slot
    owner, local = position // s, position % s
    mine = order[rank * s : (rank + 1) * s]
    own_targets = (owner[cpu.logprob_slots] == rank).nonzero().reshape(-1)
    own_last = (owner[cpu.last_slots] == rank).nonzero().reshape(-1)
    real = (order < cpu.num_tokens).view(cp, s).sum(1).tolist()
    return ContextParallelShard(
        input_ids=cpu.input_ids[:, mine],
        position_ids=cpu.position_ids[:, mine],
        attention_mask=torch.cat([order.to(torch.int32), cpu.attention_mask[0].to(torch.int32)])[None],
        multiplicity=cpu.multiplicity[:, mine],
        target_slots=local[cpu.logprob_slots[own_targets]],
        target_labels=cpu.logprob_labels[own_targets],
        target_index=own_targets,
        last_slots=local[cpu.last_slots[own_last]],
        last_index=own_last,
        rank=rank,
        size=cp,
        num_targets=cpu.logprob_slots.numel(),
        num_sequences=cpu.last_slots.numel(),
        pairs=pairs,
        tokens=real,
    )


# torch >= 2.13 names them *_single (the *_tensor names warn); older torch has only the latter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSlots(torch.autograd.Function):
    """[s, ...] per rank -> [cp * s, ...] in rank order; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        _all_gather(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter(out, grad, group=ctx.group)
        return out, None


def gather_slots(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather ``x`` [s, ...] over the CP ``group`` into [cp * s, ...] (rank r's rows at ``[r*s, (r+1)*s)``);
    differentiable: each rank's gradient is the sum over ranks of the gradient of its rows."""
    return _GatherSlots.apply(x, group)


class _GatherTargets(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, total: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(index)
        full = x.new_zeros((total, *x.shape[1:]))
        full[index] = x
        dist.all_reduce(full, group=group)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad[index], None, None, None


def gather_targets(x: torch.Tensor, index: torch.Tensor, total: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's entries ``x`` [N_r, ...] at ``index`` [N_r] of a ``[total, ...]`` vector that the CP ranks
    fill disjointly -> the full vector on every rank (one SUM all-reduce). Differentiable, for a loss that
    every CP rank computes identically from the result: the backward returns the rank's own entries of the
    gradient, no collective."""
    return _GatherTargets.apply(x, index, total, group)

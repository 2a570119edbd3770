"""Per-sequence next-token log-probs (and entropy) from vocab-parallel tree logits.

Shape legend: T = slots of the micro-batch, R = predicting rows (``R <= T``; rows
``[R, T)`` are padding: never read, zero gradient), V_l = vocabulary shard of this rank
(rank r of ``tp_group`` holds vocab ids ``[r * V_l, (r + 1) * V_l)``, V = V_l * tp),
N = (slot, label) targets. N can be much larger than T: a shared prefix slot predicts
one target per sequence (and per child) that passes through it.

Math, for row s with ``x = logits[s] / temperature`` over the full vocabulary::

    m[s] = max_v x_v       S[s] = sum_v exp(x_v - m)       A[s] = sum_v exp(x_v - m) (x_v - m)
    lse[s] = m + log S     entropy[s] = log S - A / S      logprob_k = x[slot_k, label_k] - lse[slot_k]

Each rank reduces its own shard. Per call: one MAX all-reduce (m), one SUM all-reduce
(S, A and the N target logits, packed together), and one tiny MAX all-reduce of
validation scalars; none per sequence. Backward needs no collective: every logit lives
on one rank, and with lse and entropy saved per row its gradient is local::

    d out / d x[s, v] = sum_{k: slot_k = s, label_k = v} g_k - p_v (G[s] + GH[s] (log p_v + entropy[s]))

with ``G[s]``, ``GH[s]`` the sums of the log-prob and entropy output gradients of the
targets predicted at s. The output layer's backward (Megatron's column-parallel linear)
sums the partial input gradients across ranks, so the loss built on the returned values
must be the same on every rank of ``tp_group`` (it is when computed from them alone).

Memory and speed: rows are processed in chunks of ``chunk_rows``. On CUDA each chunk's math
is one compiled (Inductor) kernel that reads the chunk once and keeps nothing in fp32;
elsewhere it runs eagerly with a few fp32 chunk-sized temporaries. The backward's
``[T, V_l]`` gradient is a new tensor, or with ``inplace_backward`` the logits' own memory
(saving one ``[T, V_l]`` buffer at the loss, where memory peaks); otherwise the caller's
logits are never written to.

Layers: ``_forward_kernel`` / ``_backward_kernel`` (flat tensors) -> ``_TreeLogprobs``
(autograd) -> ``vocab_parallel_logprobs`` / ``gather_tree_logprobs`` (validate, dispatch).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from megatron_tree.core import host_checks
from megatron_tree.core.microbatch import TreeMicroBatch

_CHUNK_ELEMENTS = 1 << 26
"""Default chunk budget off CUDA: 2^26 values (256 MiB per fp32 temporary) per chunk."""
_CHUNK_ELEMENTS_CUDA = 1 << 28
"""Default chunk budget on CUDA, where each chunk is one compiled kernel with no temporary."""


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    """In-place all-reduce over ``group``; ``group=None`` means a single rank (no-op)."""
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _shard_columns(labels: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local_col, owned)`` [N]: each label's column in this rank's vocabulary shard, and
    whether the shard holds it (``local_col`` is out of range where it does not)."""
    local_col = labels - vocab_start
    return local_col, (local_col >= 0) & (local_col < vocab_local)


def _chunk_sums(
    x: torch.Tensor, row_max: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(sum_v exp(y), sum_v exp(y) y or None)`` [c] fp32 of one chunk ``x [c, V_l]`` with
    ``y = x / temperature - row_max``."""
    e = (x.float() / temperature - row_max[:, None]).exp()
    # exp(y) * y == xlogy(e, e): 0, not nan, for a -inf logit.
    return e.sum(dim=-1), torch.special.xlogy(e, e).sum(dim=-1) if with_entropy else None


def _grad_values(x: torch.Tensor, terms: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``d out / d x [c, k]`` before the ``+ g_k`` of the targets: ``-p G`` or, with
    entropy, ``-(p log p GH + p (G + GH H))``, divided by ``temperature``.

    ``terms [c, 2]`` holds each row's ``(lse, G)``, or ``[c, 4]`` ``(lse, G, GH, H)`` with
    entropy; they broadcast over the ``k`` columns of ``x``.
    """
    p = (x.float() / temperature - terms[:, 0:1]).exp()
    if terms.shape[1] == 2:
        return -p * terms[:, 1:2] / temperature
    coef, coef_entropy, row_entropy = terms[:, 1:2], terms[:, 2:3], terms[:, 3:4]
    # xlogy keeps p = 0 (a -inf logit) at 0, not nan.
    return -(torch.special.xlogy(p, p) * coef_entropy + p * (coef + coef_entropy * row_entropy)) / temperature


def _chunk_grad_(x: torch.Tensor, terms: torch.Tensor, temperature: float) -> None:
    """Overwrite one chunk ``x [c, V_l]`` with its :func:`_grad_values` (``terms [c, 2|4]``)."""
    x.copy_(_grad_values(x, terms, temperature))


@functools.cache
def _compiled(fn):
    """``fn(x [c, V_l], per_row [c, ...], *constants)`` compiled once for every chunk length ``c``: the rows of both
    tensors are marked dynamic before each call, so Dynamo's first compile is already the symbolic-length one
    (unmarked, it compiles a static kernel first and a dynamic one at the first other length, the last chunk of the
    first call: two cold Inductor compiles per kernel in the first step instead of one)."""
    compiled = torch.compile(fn)

    def run(x: torch.Tensor, per_row: torch.Tensor, *constants):
        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(per_row, 0)
        return compiled(x, per_row, *constants)

    return run


def _kernel(fn, device: torch.device):
    """``fn`` compiled into one fused kernel per chunk on CUDA (one read of the chunk, no fp32
    copy in memory; :func:`_compiled`); eager elsewhere."""
    return _compiled(fn) if device.type == "cuda" else fn


def default_chunk_rows(vocab_local: int, device: torch.device) -> int:
    """Rows per chunk: ~2^28 logits on CUDA (compiled chunks hold no fp32 copy), ~2^26
    elsewhere (eager chunks make a few fp32 temporaries of that size)."""
    return max(1, (_CHUNK_ELEMENTS_CUDA if device.type == "cuda" else _CHUNK_ELEMENTS) // vocab_local)


def _forward_kernel(
    logits: torch.Tensor,
    slots: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    rows: int,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int,
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Forward over flat inputs.

    logits [T, V_l] float (read only), slots [N] long in ``[0, rows)``, labels [N] long
    global vocab ids. Returns ``(logprobs [N], entropy [N] or None, lse [R], row_entropy
    [R] or None)``, all fp32 and identical on every rank of ``tp_group``.
    """
    vocab_local = logits.shape[1]
    # max commutes with division by a positive temperature (rounding is monotone).
    row_max = logits[:rows].amax(dim=-1).float().div_(temperature)
    _all_reduce(row_max, dist.ReduceOp.MAX, tp_group)

    sums = _kernel(_chunk_sums, logits.device)
    sum_exp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sum_exp_shifted = torch.empty_like(sum_exp) if with_entropy else None
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        chunk_sum, chunk_shifted = sums(logits[start:end], row_max[start:end], temperature, with_entropy)
        sum_exp[start:end] = chunk_sum
        if with_entropy:
            sum_exp_shifted[start:end] = chunk_shifted

    local_col, owned = _shard_columns(labels, vocab_start, vocab_local)
    target = logits[slots, local_col.clamp(0, vocab_local - 1)].float().div_(temperature)
    target.masked_fill_(~owned, 0.0)

    parts = [sum_exp, target] + ([sum_exp_shifted] if with_entropy else [])
    packed = torch.cat(parts)
    _all_reduce(packed, dist.ReduceOp.SUM, tp_group)
    sum_exp, target, *rest = packed.split([p.numel() for p in parts])

    log_sum_exp = sum_exp.log()
    lse = row_max + log_sum_exp
    logprobs = target - lse[slots]
    if not with_entropy:
        return logprobs, None, lse, None
    row_entropy = log_sum_exp - rest[0] / sum_exp
    return logprobs, row_entropy[slots], lse, row_entropy


def _backward_kernel(
    logits: torch.Tensor,
    slots: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    row_entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    chunk_rows: int,
    inplace: bool,
    whole_vocab: bool,
) -> torch.Tensor:
    """Gradient wrt the local shard ``logits [T, V_l]`` (same dtype), computed locally.

    lse / row_entropy [R] fp32 from the forward; grad_logprobs / grad_entropy [N] or None
    (an output that did not reach the loss). ``inplace`` writes the gradient over ``logits``
    (each chunk after reading it) and returns ``logits``; else over a copy of them. ``whole_vocab``: the shard is the
    whole vocabulary (no tensor parallelism), so every label is in it.
    """
    rows, vocab_local = lse.numel(), logits.shape[1]
    grad = logits if inplace else logits.clone()  # each chunk is then overwritten in place
    grad[rows:].zero_()

    def per_row(values: torch.Tensor | None) -> torch.Tensor:
        total = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        return total if values is None else total.index_add_(0, slots, values.float())

    # Row terms [R, 2 | 4]: (lse, G) or, with an entropy gradient, (lse, G, GH, H).
    terms = [lse, per_row(grad_logprobs)]
    if grad_entropy is not None:
        terms += [per_row(grad_entropy), row_entropy]
    terms = torch.stack(terms, dim=1)
    if grad_logprobs is not None:
        # The + g_k at (slot_k, label_k): summed per distinct position of this shard (a shared
        # prefix slot predicts the same label for every sequence through it), read before
        # the chunks overwrite an in-place grad, and written once after them.
        local_col, owned = _shard_columns(labels, vocab_start, vocab_local)
        if whole_vocab:  # every label in this shard: no host sync (no size that depends on the data)
            target_row, target_col = slots, local_col
            target_grad = _position_sums(slots * vocab_local + local_col, grad_logprobs.float())
        else:
            keys, inverse = torch.unique((slots * vocab_local + local_col)[owned], return_inverse=True)
            target_grad = torch.zeros(keys.numel(), dtype=torch.float32, device=logits.device)
            target_grad.index_add_(0, inverse, grad_logprobs.float()[owned])
            target_row, target_col = keys // vocab_local, keys % vocab_local
        target_logit = logits[target_row, target_col]

    chunk_grad_ = _kernel(_chunk_grad_, logits.device)
    for start in range(0, rows, chunk_rows):
        chunk = slice(start, min(start + chunk_rows, rows))
        chunk_grad_(grad[chunk], terms[chunk], temperature)
    if grad_logprobs is not None:  # targets at one position write the same value
        value = _grad_values(target_logit[:, None], terms[target_row], temperature)[:, 0]
        grad[target_row, target_col] = (value + target_grad / temperature).to(grad.dtype)
    return grad


def _position_sums(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[N]``: for each entry, the sum of ``values`` over every entry with its key (``keys`` int ``[N]``), in fp32;
    sorted by key and summed per run, without a host sync."""
    ordered, order = keys.sort(stable=True)  # a run keeps its entries in order: the sums add as index_add_ does
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    run = first.cumsum(0) - 1  # each sorted entry's run
    sums = torch.zeros(keys.numel(), dtype=torch.float32, device=keys.device).index_add_(0, run, values[order])
    return torch.empty_like(sums).index_put_((order,), sums[run])


class _TreeLogprobs(torch.autograd.Function):
    """Autograd wrapper of the two kernels; inputs are already validated."""

    @staticmethod
    def forward(
        ctx, logits, slots, labels, vocab_start, rows, temperature, with_entropy, chunk_rows, tp_group, inplace
    ):
        ctx.set_materialize_grads(False)
        logprobs, entropy, lse, row_entropy = _forward_kernel(
            logits, slots, labels, vocab_start, rows, temperature, with_entropy, chunk_rows, tp_group
        )
        ctx.save_for_backward(logits, slots, labels, lse, row_entropy)
        ctx.vocab_start, ctx.temperature, ctx.chunk_rows, ctx.inplace = vocab_start, temperature, chunk_rows, inplace
        ctx.whole_vocab = tp_group is None or dist.get_world_size(tp_group) == 1
        return (logprobs, entropy) if with_entropy else logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 10
        logits, slots, labels, lse, row_entropy = ctx.saved_tensors
        grad = _backward_kernel(
            logits, slots, labels, ctx.vocab_start, lse, row_entropy,
            grad_logprobs, grad_entropy, ctx.temperature, ctx.chunk_rows, ctx.inplace, ctx.whole_vocab,
        )  # fmt: skip
        return (grad,) + (None,) * 9


def _check_across_ranks(
    logits: torch.Tensor, slots: torch.Tensor, labels: torch.Tensor, rows: int, tp_group: dist.ProcessGroup | None
) -> int:
    """Check shard sizes agree across ``tp_group`` and slots / labels are in range.

    One MAX all-reduce of 8 int64 scalars and one host sync; every rank sees the same
    result, so all ranks raise together instead of some hanging in a later collective. Without
    tensor parallelism, slots and labels whose ranges ``TreeMicroBatch.to`` measured on the host
    (:mod:`megatron_tree.core.host_checks`) are checked without either.
    Returns this rank's index in ``tp_group``.
    """
    num_slots, vocab_local = logits.shape
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    known = [host_checks.recall(t, "value_range") for t in (labels, slots)] if slots.numel() else [(0, -1)] * 2
    if tp_size == 1 and None not in known:  # ranges measured on the host (TreeMicroBatch.to): no sync
        (lab_min, lab_max), (slot_min, slot_max) = known
        _check_ranges(lab_min, lab_max, slot_min, slot_max, vocab_local, tp_size, rows)
        return tp_rank
    stats = torch.tensor([vocab_local, -vocab_local, num_slots, -num_slots, 0, -1, 0, -1], device=logits.device)  # N = 0 passes
    if slots.numel():
        stats[4:] = torch.stack([-labels.min(), labels.max(), -slots.min(), slots.max()])
    _all_reduce(stats, dist.ReduceOp.MAX, tp_group)
    v_max, v_min, t_max, t_min, lab_min, lab_max, slot_min, slot_max = stats.tolist()
    v_min, t_min, lab_min, slot_min = -v_min, -t_min, -lab_min, -slot_min
    if v_min != v_max:
        raise ValueError(
            f"vocab shards differ across the {tp_size} ranks of tp_group: V_local from {v_min} to {v_max}. "
            "Pass each rank's own [.., V/tp] logits of the same model, and the tensor-parallel group it was built with."
        )
    if t_min != t_max:
        raise ValueError(
            f"ranks of tp_group hold different micro-batches: T from {t_min} to {t_max}. "
            "Every tensor-parallel rank must process the same micro-batch."
        )
    _check_ranges(lab_min, lab_max, slot_min, slot_max, vocab_local, tp_size, rows)
    return tp_rank


def _check_ranges(lab_min: int, lab_max: int, slot_min: int, slot_max: int, vocab_local: int, tp_size: int,
                  rows: int) -> None:
    """Raise unless the labels lie in the vocabulary and the slots in the rows that predict tokens."""
    vocab = vocab_local * tp_size
    if lab_min < 0 or lab_max >= vocab:
        raise ValueError(
            f"labels range over [{lab_min}, {lab_max}] but the vocabulary is [0, {vocab}) "
            f"(V_local={vocab_local} x tp={tp_size}). Check the tokenizer/model pairing and that tp_group "
            "is the group the output layer is sharded over."
        )
    if slot_min < 0 or slot_max >= rows:
        raise ValueError(
            f"slots range over [{slot_min}, {slot_max}] but only rows [0, {rows}) predict tokens. "
            "Slots index the T dimension of logits, before padding."
        )


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    slots: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows: int | None = None,
    chunk_rows: int | None = None,
    inplace_backward: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits[slots] / temperature)[labels]`` over a vocabulary sharded across ``tp_group``.

    Args:
      logits:   [T, V_l] float (any float dtype; math in fp32), this rank's vocab shard
                ``[rank * V_l, (rank + 1) * V_l)``. Not modified (but see ``inplace_backward``).
      slots:    [N] int, row of ``logits`` predicting each target, in ``[0, rows)``.
      labels:   [N] int, global vocab id of each target, in ``[0, V_l * tp)``.
      tp_group: tensor-parallel group the vocab is sharded over; ``None`` = one rank (TP 1).
      temperature: > 0; logits are divided by it.
      with_entropy: also return the entropy of each target's predicting distribution.
      rows:     only rows ``[0, rows)`` are read (default T); later rows (padding) get zero grad.
      chunk_rows: rows per work chunk (default :func:`default_chunk_rows`: ~2^28 / V_l on CUDA,
                ~2^26 / V_l elsewhere).
      inplace_backward: the backward writes the logits' gradient over ``logits`` (saves a
                ``[T, V_l]`` buffer). Only when nothing reads ``logits`` after this call's
                backward (true of :func:`~megatron_tree.mcore.schedule.tree_forward_step`), and not
                with ``retain_graph``; else the caller's logits are never modified.

    Returns:
      logprobs [N] fp32, or ``(logprobs [N], entropy [N])`` fp32; identical on every rank
      of ``tp_group``, differentiable wrt ``logits``.

    Raises ValueError / TypeError on bad inputs. The range and cross-rank checks cost one
    all-reduce of 8 scalars and one host sync per call.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.ndim != 2:
        got = f"{type(logits).__name__} {getattr(logits, 'dtype', '')} shape {tuple(getattr(logits, 'shape', ()))}"
        raise ValueError(f"logits must be a float tensor [T, V_local]; got {got}.")
    num_slots, vocab_local = logits.shape
    if vocab_local == 0:
        raise ValueError("logits have an empty vocab shard (V_local = 0); pass the output layer's logits.")
    for name, idx in (("slots", slots), ("labels", labels)):
        if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.is_complex() or idx.ndim != 1:
            got = f"{type(idx).__name__} {getattr(idx, 'dtype', '')} shape {tuple(getattr(idx, 'shape', ()))}"
            raise ValueError(f"{name} must be a 1-D integer tensor [N]; got {got}.")
        if idx.device != logits.device:
            raise ValueError(
                f"{name} is on {idx.device} but logits on {logits.device}; move it with .to(logits.device)."
            )
    if slots.numel() != labels.numel():
        raise ValueError(f"slots and labels must pair up: {slots.numel()} slots vs {labels.numel()} labels.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a Python float; got {type(temperature).__name__}.")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0; got {temperature}.")
    rows = num_slots if rows is None else rows
    if not 0 <= rows <= num_slots:
        raise ValueError(f"rows must be in [0, T={num_slots}]; got {rows}.")
    chunk_rows = default_chunk_rows(vocab_local, logits.device) if chunk_rows is None else chunk_rows
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int; got {chunk_rows!r}.")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool; got {type(inplace_backward).__name__}.")
    if tp_group is not None and not dist.is_initialized():
        raise ValueError("tp_group was given but torch.distributed is not initialised; pass tp_group=None for TP 1.")

    slots, labels = slots.long(), labels.long()
    tp_rank = _check_across_ranks(logits, slots, labels, rows, tp_group)
    return _TreeLogprobs.apply(
        logits, slots, labels, tp_rank * vocab_local, rows, float(temperature), with_entropy, chunk_rows, tp_group,
        inplace_backward,
    )  # fmt: skip


def gather_tree_logprobs(
    logits: torch.Tensor,
    mb: TreeMicroBatch,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
    inplace_backward: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence next-token log-probs of a tree micro-batch, from its vocab-parallel logits.

    Args:
      logits: [1, T, V_l] float, as ``GPTModel`` returns them without labels; this rank's
              vocab shard over ``tp_group`` (``None`` = TP 1). Not modified (the backward
              overwrites them with their gradient only under ``inplace_backward``).
      mb:     the micro-batch the logits were computed from (on the logits' device).
      temperature, with_entropy, chunk_rows, inplace_backward: as in :func:`vocab_parallel_logprobs`.

    Returns:
      logprobs [N] fp32: for each sequence of ``mb.sequence_ids`` in order, its ``len - 1``
      values ``log p(s[t+1] | s[:t+1])`` (sequence k at ``mb.cu_targets[k]:mb.cu_targets[k+1]``);
      with ``with_entropy``, ``(logprobs [N], entropy [N])``, the entropy of each
      predicting distribution (at ``temperature``).
    """
    if not isinstance(mb, TreeMicroBatch):
        raise TypeError(f"mb must be a TreeMicroBatch (from pack_trees); got {type(mb).__name__}.")
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[:2] != (1, mb.num_slots):
        raise ValueError(
            f"logits must be [1, T={mb.num_slots}, V_local] for this micro-batch; got shape "
            f"{tuple(getattr(logits, 'shape', ()))}. Pass GPTModel's output for mb.input_ids (batch dim 1)."
        )
    num_targets = sum(mb.target_counts)
    if mb.logprob_slots.numel() != num_targets:
        raise ValueError(
            f"mb holds {mb.logprob_slots.numel()} targets but its seq_lens imply {num_targets}; "
            "build it with pack_trees."
        )
    return vocab_parallel_logprobs(
        logits.squeeze(0),
        mb.logprob_slots,
        mb.logprob_labels,
        tp_group=tp_group,
        temperature=temperature,
        with_entropy=with_entropy,
        rows=mb.num_tokens,
        chunk_rows=chunk_rows,
        inplace_backward=inplace_backward,
    )

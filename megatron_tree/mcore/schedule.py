"""Tree micro-batches through megatron-core's pipeline schedules.

``get_forward_backward_func()`` pulls one item per micro-batch from a data iterator on
every pipeline stage (one iterator per model chunk under interleaved PP) and calls
``forward_step_func(data_iterator, model)``, which returns ``(output, loss_func)``; the
last stage calls ``loss_func(output)``. Here:

* :func:`tree_data_iterators` gives each model chunk its own iterator over the same
  micro-batches (moved to the device, padded to one length when the schedule needs it; once per
  micro-batch object: later passes over the same batch reuse the copy and its prepared masks, :func:`device_copy`);
* :func:`tree_forward_step` runs the model with the tree mask and depths as positions,
  and its loss function gathers per-sequence log-probs (vocab-parallel; or, with ``head=``,
  a critic's per-token values or a reward model's scores) and applies the user's loss;
* :func:`tree_forward_backward` does both and calls the schedule.

Loss normalisation. The user's ``loss_fn(logprobs, mb)`` (or values, scores) returns ``(loss_sum, count)``:
a SUM over what it normalises by, and how many of those there are (tokens for a per-token
mean, sequences for a per-sequence mean). Megatron then divides the summed loss by the
count summed over all micro-batches (and, with its DDP, over data-parallel ranks) —
``config.calculate_per_token_loss=True``. The result is the same whatever the
micro-batching, so a tree step equals the flat step on the same sequences exactly;
without that flag Megatron averages per-micro-batch means, which depends on how
sequences fall into micro-batches, and :func:`tree_forward_backward` refuses it.

Context parallel (CP > 1): every CP rank holds the same micro-batches; each is padded to a
multiple of ``cp * CP_CHUNKS`` slots and split by :func:`~megatron_tree.core.context_parallel.shard_micro_batch`
(the model sees the rank's shard, ``loss_fn`` the whole micro-batch). The head's outputs are
gathered into the whole ``[N]`` layout on every CP rank, every CP rank computes the same loss,
and its count is counted once (on CP rank 0), so the division by the global count stays exact.

Megatron divides the gradients by that count, and reduces them over data-parallel ranks,
only in ``config.finalize_model_grads_func`` (megatron-core's ``finalize_model_grads``,
which Megatron's training loop sets), on a model wrapped in its ``DistributedDataParallel``.
:func:`tree_forward_backward` sets it when it is unset and the model is so wrapped (it never
replaces a function the user set), and refuses to train an unwrapped model without one:
the gradients would be sums, never divided. On a DDP model that overlaps its gradient reduction it also sets
``config.no_sync_func`` / ``grad_sync_func`` when unset (:func:`~megatron_tree.mcore.data_parallel.configure_grad_sync`:
only the last micro-batch's backward starts the reduction, whatever the number of tree micro-batches).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_tree.core.context_parallel import (
    ContextParallelShard,
    gather_targets,
    padded_slots,
    shard_micro_batch,
    slot_multiple,
)
from megatron_tree.attention.dispatch import PREPARED_MASKS
from megatron_tree.ops.logprobs import gather_tree_logprobs, vocab_parallel_logprobs
from megatron_tree.ops.losses import sequence_parts
from megatron_tree.core.microbatch import TreeMicroBatch
from megatron_tree.core.packing import build_micro_batch
from megatron_tree.mcore.chunk_schedule import ChunkedTree, release_chunks, run_chunked_tree, schedule_steps
from megatron_tree.mcore.data_parallel import configure_grad_sync
from megatron_tree.mcore.packed_seq import thd_backward_refusal, thd_packed_seq_params
from megatron_tree.mcore.model_check import check_tree_model
from megatron_tree.mcore.router_stats import tree_padding_mask
from megatron_tree.ops.values import gather_tree_scores, gather_tree_values

LossFn = Callable[[torch.Tensor, TreeMicroBatch], tuple[torch.Tensor, torch.Tensor | int]]
"""``loss_fn(outputs, mb) -> (loss_sum scalar, count)``; ``outputs`` is what the head gives
(:data:`HEADS`), see the module docstring."""

HEADS = ("logprobs", "values", "scores")
"""What the model's output becomes before ``loss_fn`` sees it, per micro-batch (``head=``):

- ``"logprobs"`` (language-model head, default): ``logprobs [N]`` fp32 in the varlen layout of
  :func:`~megatron_tree.ops.logprobs.gather_tree_logprobs`; ``(logprobs [N], entropy [N])`` with
  ``with_entropy=True``.
- ``"values"`` (value head ``[1, T, 1]``, a critic): ``values [N]`` in the same layout
  (:func:`~megatron_tree.ops.values.gather_tree_values`).
- ``"scores"`` (value head, a reward model): ``scores [n]``, the value at each sequence's last
  token (:func:`~megatron_tree.ops.values.gather_tree_scores`).
"""

_log = logging.getLogger(__name__)
_ANNOUNCED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


_DEVICE_COPIES: dict[int, tuple[weakref.ref, dict[tuple, tuple[tuple[int | None, ...], Any]]]] = {}
"""``id(host micro-batch) -> (a weak reference to it, {key: (its tensors' versions, its device copy)})``
(:func:`device_copy`)."""
_FREED_COPIES: list[dict[tuple, tuple[tuple[int | None, ...], Any]]] = []
"""Device copies of freed host micro-batches whose masks the next pass releases (:func:`keep_device_copies_of`; not the
weak reference's callback: that may run inside the mask cache's own bookkeeping, from the garbage collector)."""


def device_copy(mb: TreeMicroBatch, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()`` (``mb`` padded and moved to the device: the schedule's item for it), made by the first pass over
    ``mb`` under ``key`` (what, padded length, device) and returned again to every later pass over the same micro-batch
    object while it lives, its tensors are not edited in place and no pass over other micro-batches ran in between
    (:func:`keep_device_copies_of`): the passes of an RL step (old and reference log-probs, values, scores, updates)
    move each micro-batch once, and what the attention backends prepared from its mask is prepared once
    (:data:`~megatron_tree.attention.PREPARED_MASKS` holds the copy's masks while the copy is kept). Moves are
    non-blocking: a blocking copy of host (pageable) memory synchronises the stream, the host waiting for the GPU."""
    entry = _DEVICE_COPIES.get(id(mb))
    if entry is None or entry[0]() is not mb:
        entry = _DEVICE_COPIES[id(mb)] = (weakref.ref(mb, functools.partial(_forget_device_copies, id(mb))), {})
    copies = entry[1]
    tensors = [t for t in vars(mb).values() if isinstance(t, torch.Tensor)]
    versions = tuple(None if t.is_inference() else t._version for t in tensors)  # inference tensors have none
    if key in copies and copies[key][0] != versions:  # mb's tensors were edited in place since: copy again
        PREPARED_MASKS.release(_masks(copies.pop(key)[1]))
    if key not in copies:
        copies[key] = (versions, make())
        PREPARED_MASKS.hold(_masks(copies[key][1]))
    return copies[key][1]


def keep_device_copies_of(mbs: Sequence[TreeMicroBatch]) -> None:
    """Before a pass over ``mbs``: forget the device copies of every other micro-batch (a new batch replaces the last
    one), so the GPU holds the copies of one batch at most, however many packed batches the caller keeps."""
    keep = {id(mb) for mb in mbs}
    for ident in [i for i in _DEVICE_COPIES if i not in keep]:
        _FREED_COPIES.append(_DEVICE_COPIES.pop(ident)[1])
    while _FREED_COPIES:  # with those of freed micro-batches
        for _, copy in _FREED_COPIES.pop().values():
            PREPARED_MASKS.release(_masks(copy))


def _forget_device_copies(ident: int, ref: weakref.ref) -> None:
    """The host micro-batch ``ident`` was freed: its device copies go, their masks with the next pass."""
    entry = _DEVICE_COPIES.get(ident)
    if entry is not None and entry[0] is ref:
        _FREED_COPIES.append(_DEVICE_COPIES.pop(ident)[1])


def _masks(item: Any) -> list[torch.Tensor]:
    """The tensors of a schedule item that prepared attention masks (and scan layouts) are keyed on."""
    parts = item if isinstance(item, tuple) else (item,)
    names = ("attention_mask", "context_mask", "cu_seqlens_q")
    return [t for part in parts for name in names if isinstance(t := getattr(part, name, None), torch.Tensor)]


def tree_data_iterators(
    mbs: Sequence[TreeMicroBatch],
    num_model_chunks: int = 1,
    *,
    device: torch.device | str,
    pad_to: int | None = None,
    pad_multiple: int = 1,
    cp: tuple[int, int] | None = None,
    uniform_chunks: list[tuple[bool, ...]] | None = None,
) -> Iterator | list[Iterator]:
    """Data iterator(s) for ``forward_backward_func``: one over ``mbs`` per model chunk
    (a plain iterator when there is one chunk). ``pad_to`` pads every micro-batch to that
    many slots (fixed-length schedules); otherwise each is padded to a multiple of
    ``pad_multiple`` slots (sequence parallel splits the slots over TP ranks; context parallel
    needs a multiple of ``cp * CP_CHUNKS``). Items are the micro-batches, or with ``cp = (rank,
    size)`` pairs ``(micro-batch, its ContextParallelShard for this rank)``; the chunks of a tree
    larger than a micro-batch are one item, a :class:`~megatron_tree.mcore.chunk_schedule.ChunkedTree`.
    ``uniform_chunks`` (expert parallel), per item: every item is a ``ChunkedTree`` run uniformly, padded with
    empty chunks to as many as the tuple holds, whose flags say which chunks run their forward again."""

    def ready(mb: TreeMicroBatch) -> TreeMicroBatch:
        length = _padded_length(mb, pad_to, pad_multiple)
        return device_copy(mb, ("tree", length, str(device)),
                           lambda: mb.padded_to(length).to(device, non_blocking=True))

    def ready_shard(mb: TreeMicroBatch) -> tuple[TreeMicroBatch, ContextParallelShard]:
        length = _padded_length(mb, pad_to, pad_multiple)
        return device_copy(mb, ("cp", length, str(device), cp), lambda: (
            ready(mb), shard_micro_batch(mb.padded_to(length), cp[1], cp[0]).to(device, non_blocking=True)))

    keep_device_copies_of(mbs)
    steps = schedule_steps(list(mbs))
    moved = []
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if uniform_chunks is not None:
            chunks = step if isinstance(step, list) else [step]
            chunks = chunks + [build_micro_batch([], []) for _ in range(len(uniform_chunks[i]) - len(chunks))]
            moved.append(ChunkedTree([ready(mb) for mb in chunks], uniform=True, last=last,
                                     recompute=uniform_chunks[i]))
        elif isinstance(step, list):
            moved.append(ChunkedTree([ready(mb) for mb in step], last=last))
        else:
            moved.append(ready(step) if cp is None else ready_shard(step))
    its = [iter(moved) for _ in range(num_model_chunks)]
    return its[0] if num_model_chunks == 1 else its


def tree_forward_step(
    loss_fn: LossFn,
    *,
    tp_group: torch.distributed.ProcessGroup | None = None,
    temperature: float = 1.0,
    head: str = "logprobs",
    with_entropy: bool = False,
    cp_group: torch.distributed.ProcessGroup | None = None,
    forward_only: bool = False,
    collect: bool = False,
) -> Callable:
    """A ``forward_step_func`` for megatron-core schedules over :class:`TreeMicroBatch` items
    (under context parallel, ``(micro-batch, ContextParallelShard)`` items and the ``cp_group``;
    :class:`~megatron_tree.mcore.chunk_schedule.ChunkedTree` items, the chunks of a tree larger than a
    micro-batch, run as :func:`~megatron_tree.mcore.chunk_schedule.run_chunked_tree` does, with their
    backwards unless ``forward_only``; ``collect``: the schedule collects outputs, not losses).

    The model must be built with tree attention and per-token RoPE (see
    ``patch_bridge_for_tree_training`` / ``tree_layer_spec`` + ``convert_to_tree_model``);
    :func:`~megatron_tree.mcore.model_check.check_tree_model` refuses any other.
    Its loss function returns Megatron's triple ``(loss_sum, count, {"loss": [loss_sum, count]})``
    from ``loss_fn(head outputs, mb)`` (``head``, ``with_entropy``: :data:`HEADS`).
    """

    def loss_func_for(mb, shard=None):
        return tree_loss_func(
            loss_fn, mb, tp_group=tp_group, temperature=temperature, head=head, with_entropy=with_entropy,
            shard=shard, cp_group=cp_group,
        )  # fmt: skip

    def forward_step(data_iterator, model):
        item = next(data_iterator)
        check_tree_model(model)  # walks each chunk once
        config = get_model_config(model)
        moe = bool(config.num_moe_experts)
        # Logits stay in the model's precision (bf16): the log-prob kernel reads them in fp32 math, and
        # Megatron's fp32 copy of [T, V] would only cost memory (the values are the same bf16 numbers).
        kwargs = {"fp32_output": False} if head == "logprobs" and _half_precision(model) else {}
        if isinstance(item, ChunkedTree):

            def forward(mb, mask):
                padding_mask = tree_padding_mask(mb) if moe else None
                return model(mb.input_ids, mb.position_ids, mask, padding_mask=padding_mask, **kwargs)

            return run_chunked_tree(item, forward, loss_func_for, config, train=not forward_only, collect=collect)
        mb, shard = item if isinstance(item, tuple) else (item, None)
        if shard is None:
            # MoE routers weigh each slot by the sequences through it (megatron_tree.mcore.router_stats).
            padding_mask = tree_padding_mask(mb) if moe else None
            output = model(mb.input_ids, mb.position_ids, mb.attention_mask, padding_mask=padding_mask, **kwargs,
                           **mb.model_inputs())
        else:  # the rank's shard of the slots, weighted as in the whole micro-batch
            padding_mask = tree_padding_mask(mb, shard) if moe else None
            output = model(shard.input_ids, shard.position_ids, shard.attention_mask, padding_mask=padding_mask,
                           **kwargs)  # fmt: skip
        return output, loss_func_for(mb, shard)

    return forward_step


def _half_precision(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a wrapper inside it, e.g. under DDP) is megatron-core's ``Float16Module``,
    whose ``forward`` takes ``fp32_output``."""
    from megatron.core.transformer.module import Float16Module

    while not isinstance(model, Float16Module):
        if not isinstance(getattr(model, "module", None), torch.nn.Module):
            return False
        model = model.module
    return True


def thd_schedule_inputs(
    mbs: Sequence[TreeMicroBatch],
    num_model_chunks: int,
    loss_fn: LossFn,
    *,
    device: torch.device | str,
    pad_to: int | None,
    pad_multiple: int,
    tp_group: torch.distributed.ProcessGroup | None,
    temperature: float,
    head: str = "logprobs",
    with_entropy: bool = False,
) -> tuple[Callable, Iterator | list[Iterator]]:
    """``(forward_step_func, data_iterator)`` of flat micro-batches run as packed THD sequences
    (:func:`~megatron_tree.mcore.packed_seq.thd_packed_seq_params`): padded as :func:`tree_data_iterators`
    pads, the model called with ``packed_seq_params`` and no mask or positions."""
    def ready(mb: TreeMicroBatch) -> tuple[TreeMicroBatch, PackedSeqParams]:
        padded = mb.padded_to(_padded_length(mb, pad_to, pad_multiple))
        params = thd_packed_seq_params(padded)
        params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.to(device, non_blocking=True)  # both roles
        return padded.to(device, non_blocking=True), params

    keep_device_copies_of(mbs)
    items = [device_copy(mb, ("thd", _padded_length(mb, pad_to, pad_multiple), str(device)), lambda mb=mb: ready(mb))
             for mb in mbs]

    def forward_step(data_iterator, model):
        mb, params = next(data_iterator)
        output = model(mb.input_ids, None, None, packed_seq_params=params)
        return output, tree_loss_func(
            loss_fn, mb, tp_group=tp_group, temperature=temperature, head=head, with_entropy=with_entropy
        )

    its = [iter(items) for _ in range(num_model_chunks)]
    return forward_step, its[0] if num_model_chunks == 1 else its


def _head_outputs(
    output: torch.Tensor,
    mb: TreeMicroBatch,
    head: str,
    *,
    tp_group: torch.distributed.ProcessGroup | None,
    temperature: float,
    with_entropy: bool,
    inplace_backward: bool,
    shard: ContextParallelShard | None = None,
    cp_group: torch.distributed.ProcessGroup | None = None,
):
    """The model's ``output`` for ``mb`` through ``head`` (:data:`HEADS`); under context parallel
    ``output`` covers ``shard``'s slots and the result is gathered over ``cp_group``."""
    if shard is not None:
        return _shard_head_outputs(
            output, shard, head, cp_group, tp_group=tp_group, temperature=temperature, with_entropy=with_entropy,
            inplace_backward=inplace_backward,
        )  # fmt: skip
    if head == "logprobs":
        return gather_tree_logprobs(
            output, mb, tp_group=tp_group, temperature=temperature, with_entropy=with_entropy,
            inplace_backward=inplace_backward,
        )  # fmt: skip
    return (gather_tree_values if head == "values" else gather_tree_scores)(output, mb)


def _shard_head_outputs(output, shard, head, cp_group, *, tp_group, temperature, with_entropy, inplace_backward):
    """:func:`_head_outputs` of one CP rank's shard: its own targets (sequences, for scores), then the
    whole micro-batch's layout on every CP rank (:func:`~megatron_tree.core.context_parallel.gather_targets`)."""
    s = shard.num_slots
    if not isinstance(output, torch.Tensor) or output.ndim != 3 or output.shape[:2] != (1, s):
        raise ValueError(
            f"under context parallel the model output must be [1, s={s}, ...] for this rank's shard; got shape "
            f"{tuple(getattr(output, 'shape', ()))}"
        )
    if head == "logprobs":
        outs = vocab_parallel_logprobs(
            output.squeeze(0), shard.target_slots, shard.target_labels, tp_group=tp_group, temperature=temperature,
            with_entropy=with_entropy, rows=s, inplace_backward=inplace_backward,
        )  # fmt: skip
        outs = outs if with_entropy else (outs,)
        full = tuple(gather_targets(o, shard.target_index, shard.num_targets, cp_group) for o in outs)
        return full if with_entropy else full[0]
    if output.shape[2] != 1:
        raise ValueError(
            f"head={head!r} needs a value head's output [1, s, 1]; got shape {tuple(output.shape)}. A [1, s, V] "
            f"output is a language-model head: build the model with a value head (mbridge's make_value_model callback)."
        )
    values = output.reshape(s)
    if head == "values":
        return gather_targets(values[shard.target_slots], shard.target_index, shard.num_targets, cp_group)
    return gather_targets(values[shard.last_slots], shard.last_index, shard.num_sequences, cp_group)


def tree_loss_func(
    loss_fn: LossFn | None,
    mb: TreeMicroBatch,
    *,
    tp_group: torch.distributed.ProcessGroup | None,
    temperature: float,
    head: str = "logprobs",
    with_entropy: bool = False,
    shard: ContextParallelShard | None = None,
    cp_group: torch.distributed.ProcessGroup | None = None,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]:
    """The ``loss_func`` a forward step returns for ``mb``: the model's output (logits ``[b, T, V/tp]``,
    or a value head's ``[b, T, 1]``) -> Megatron's triple ``(loss_sum, count, {"loss": [loss_sum, count]})``
    from ``loss_fn(outputs, mb)``, ``outputs`` as ``head`` and ``with_entropy`` make them (:data:`HEADS`).
    Called with ``non_loss_data=True`` (the schedule's ``collect_non_loss_data``) it returns the
    detached outputs instead, and ``loss_fn`` may be None. Under context parallel ``output`` covers
    ``shard`` (this rank's part of ``mb``), ``loss_fn`` still sees the whole micro-batch's outputs,
    and the count goes to the schedule on CP rank 0 only (each CP rank backpropagates the same loss
    through its own slots; the loss dict reports the full count everywhere)."""

    def loss_func(output: torch.Tensor, non_loss_data: bool = False):
        # The logits feed nothing else: their memory takes their gradient in the backward.
        outputs = _head_outputs(
            output, mb, head, tp_group=tp_group, temperature=temperature, with_entropy=with_entropy,
            inplace_backward=not non_loss_data, shard=shard, cp_group=cp_group,
        )  # fmt: skip
        if non_loss_data:
            return tuple(o.detach() for o in outputs) if isinstance(outputs, tuple) else outputs.detach()
        parts = mb.target_starts is not None and (any(mb.target_starts) or not all(mb.sequence_ends or []))
        with sequence_parts(parts):
            result = loss_fn(outputs, mb)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ValueError(
                f"loss_fn must return (loss_sum, count), got {type(result).__name__}"
                f"{'' if not isinstance(result, tuple) else f' of length {len(result)}'}"
            )
        loss, count = result
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss_fn's loss_sum must be a scalar tensor (a sum over the batch's tokens or "
                f"sequences), got shape {tuple(getattr(loss, 'shape', ()))}"
            )
        count = (count.to(loss.device, torch.int, non_blocking=True) if isinstance(count, torch.Tensor)
                 else torch.full((), int(count), dtype=torch.int, device=loss.device)).reshape(())
        loss = loss.reshape(())
        report = torch.stack([loss.detach().float(), count.float()])
        if shard is not None and shard.rank:
            count = torch.zeros_like(count)
        return loss, count, {"loss": report}

    return loss_func


def _all_reduce_max(values: list[int], device: torch.device) -> list[int]:
    """Element-wise MAX of ``values`` over all ranks (one all-reduce, one host sync)."""
    t = torch.tensor(values, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def _check_same_across_context_parallel(mbs: Sequence[TreeMicroBatch], device: torch.device) -> None:
    """Raise unless every context-parallel rank holds the same micro-batches: their count, slots and
    sequences, and a fingerprint of their token ids and trees (position-weighted sums); one MAX
    all-reduce over the CP group."""
    mine = [len(mbs), sum(mb.num_slots for mb in mbs), sum(len(mb.sequence_ids) for mb in mbs), 0, 0]
    for k, mb in enumerate(mbs):
        weights = (torch.arange(mb.num_slots, dtype=torch.int64) * 40503 + 7919 * (k + 1)) % 65521
        mine[3] += int((mb.input_ids[0].to("cpu", torch.int64) * weights).sum())
        mine[4] += int((mb.attention_mask[0].to("cpu", torch.int64) * weights).sum())
    t = torch.tensor(mine + [-v for v in mine], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_context_parallel_group())
    most, least = t[: len(mine)].tolist(), [-v for v in t[len(mine) :].tolist()]
    if most != least:
        raise ValueError(
            f"context-parallel ranks hold different micro-batches (micro-batches, slots, sequences, token and tree "
            f"fingerprints: this rank {mine}, smallest in the group {least}, largest {most}): every rank of a "
            f"context-parallel group must pass the same micro-batches (the same data as its data-parallel rank; "
            f"pack with dp_group=parallel_state.get_data_parallel_group())"
        )


def schedule_slot_multiple(chunk: torch.nn.Module) -> int:
    """The slot multiple the schedule pads ``chunk``'s micro-batches to in the current parallel state
    (:func:`~megatron_tree.core.context_parallel.slot_multiple`: sequence parallel, context parallel)."""
    config = get_model_config(chunk)
    tp = parallel_state.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    return slot_multiple(cp=parallel_state.get_context_parallel_world_size(), sequence_parallel=tp)


def _padded_length(mb: TreeMicroBatch, pad_to: int | None, pad_multiple: int) -> int:
    """Slots ``mb`` is padded to: ``pad_to`` (fixed-length schedules), else its own length rounded
    up to a multiple of ``pad_multiple`` (sequence parallel splits the slots over TP ranks)."""
    return pad_to or padded_slots(mb.num_slots, pad_multiple)


def _check_token_ids(chunk: torch.nn.Module, mbs: Sequence[TreeMicroBatch]) -> None:
    """Raise unless every token id is below the model's vocabulary (the embedding would index out of
    range: an IndexError on CPU, a device-side assert on GPUs)."""
    module = chunk
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    vocab = getattr(module, "vocab_size", None)
    if vocab is None:
        return
    tops = [int(mb.input_ids.max()) for mb in mbs]
    top = max(tops)
    if top >= vocab:
        bad = tops.index(top)
        raise ValueError(
            f"micro-batch {bad} holds token id {top}, but the model's vocabulary has {vocab} tokens (ids 0..{vocab - 1}); "
            f"tokenize with the model's own tokenizer"
        )


def _finalize_grads_for_training(chunks: list[torch.nn.Module], config) -> None:
    """Make ``config.finalize_model_grads_func`` divide the gradients by the global count and
    reduce them over data-parallel ranks.

    A function already set is kept (the user's own, or megatron-core's). Unset on chunks wrapped
    in Megatron's DDP (or anything with its ``finish_grad_sync`` / ``scale_gradients``): set to
    megatron-core's ``finalize_model_grads``, as Megatron's training loop does, and logged (INFO).
    Unset on other chunks: ``ValueError``, since the schedule would leave the gradients as
    undivided sums.
    """
    # Megatron DDP's gradient buffers (lists; a plain module's `buffers` is nn.Module's method).
    ddp_buffers = [
        buffer
        for chunk in chunks
        for name in ("buffers", "expert_parallel_buffers")
        if isinstance(getattr(chunk, name, None), list)
        for buffer in getattr(chunk, name)
    ]
    scales = sorted({float(buffer.gradient_scaling_factor) for buffer in ddp_buffers})
    if any(scale != 1.0 for scale in scales):
        raise ValueError(
            f"the model's DDP gradient buffers scale gradients by {scales} before reducing them: it was wrapped "
            f"in Megatron's DistributedDataParallel before calculate_per_token_loss=True was set (or with "
            f"average_in_collective=True), so gradients would also be divided by the data-parallel size. Set "
            f"calculate_per_token_loss=True before wrapping (bridge.set_extra_args(calculate_per_token_loss=True) "
            f"before bridge.get_model(wrap_with_ddp=True); build_tree_model does) and average_in_collective=False"
        )
    if config.finalize_model_grads_func is not None:
        return
    wrapped = [hasattr(c, "finish_grad_sync") and hasattr(c, "scale_gradients") for c in chunks]
    unwrapped = [type(c).__name__ for c, ok in zip(chunks, wrapped) if not ok]
    if unwrapped:
        raise ValueError(
            f"cannot train: config.finalize_model_grads_func is unset and the model ({', '.join(unwrapped)}) is not "
            f"wrapped in Megatron's DistributedDataParallel, so the gradients would be sums over the batch, never "
            f"divided by the global count nor reduced over data-parallel ranks. Wrap it "
            f"(bridge.get_model(wrap_with_ddp=True) or build_tree_model(..., wrap_with_ddp=True); "
            f"tree_forward_backward then sets megatron.core.distributed.finalize_model_grads), or set "
            f"config.finalize_model_grads_func to your own fn(model_chunks, num_tokens, pg_collection=None, "
            f"force_all_reduce=False) that does both; forward_only=True needs neither"
        )
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    _log.info(
        "config.finalize_model_grads_func was unset: set to megatron.core.distributed.finalize_model_grads, as "
        "Megatron's training loop does (gradients divided by the global count and reduced over data-parallel ranks)"
    )


def tree_forward_backward(
    model: torch.nn.Module | list[torch.nn.Module],
    mbs: Sequence[TreeMicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool = False,
    temperature: float = 1.0,
    tp_group: torch.distributed.ProcessGroup | None = None,
    head: str = "logprobs",
    with_entropy: bool = False,
) -> list[dict]:
    """Run one step of ``mbs`` through ``get_forward_backward_func()``; returns Megatron's
    per-micro-batch loss dicts (on the last pipeline stage; empty elsewhere).

    ``loss_fn(outputs, mb)`` gets what ``head`` makes of the model's output (:data:`HEADS`):
    log-probs (default; with ``with_entropy``, ``(logprobs, entropy)``), a critic's per-token
    ``values`` or a reward model's per-sequence ``scores``; the normalisation is the same
    ``(sum, count)`` for all (module docstring). For log-probs etc. without a loss, use
    :func:`~megatron_tree.mcore.forward_only.tree_forward_only`.

    Validates what the schedule needs: a tree model (tree attention and per-token RoPE in
    every chunk, :func:`~megatron_tree.mcore.model_check.check_tree_model`),
    ``calculate_per_token_loss``, a micro-batch count that interleaved PP accepts, the same
    micro-batches on every context-parallel rank (module docstring). To train (``forward_only=False``) it needs ``config.finalize_model_grads_func``:
    set to megatron-core's ``finalize_model_grads`` when unset on a model wrapped in Megatron's
    DDP (logged, INFO, logger ``megatron_tree.mcore.schedule``), else ``ValueError`` (see the module
    docstring). The first call for a model logs its parameters' dtype (INFO).
    With pipeline parallel, or MoE over expert-parallel ranks, and ``variable_seq_lengths``
    off, every micro-batch on every rank is padded to one slot length (one MAX all-reduce
    over the world); otherwise each keeps its own length.
    ``tp_group`` defaults to Megatron's tensor-parallel group.
    """
    chunks = model if isinstance(model, list) else [model]
    check_tree_model(chunks)
    return _run_schedule(
        chunks, mbs, loss_fn, forward_only, temperature, tp_group, thd=False, head=head, with_entropy=with_entropy
    )


def flat_forward_backward(
    model: torch.nn.Module | list[torch.nn.Module],
    mbs: Sequence[TreeMicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool = False,
    temperature: float = 1.0,
    tp_group: torch.distributed.ProcessGroup | None = None,
    head: str = "logprobs",
    with_entropy: bool = False,
) -> list[dict]:
    """The flat baseline Megatron users run: :func:`tree_forward_backward` for flat micro-batches
    (``pack_trees(..., share_prefixes=False)``) through an upstream model (``build_tree_model(path,
    tree=False)``), each sequence one segment of a packed THD row
    (:func:`~megatron_tree.mcore.packed_seq.thd_packed_seq_params`): Transformer Engine's fused
    attention per segment and RoPE restarting at each segment, as Megatron's sequence packing
    does. Same loss path, normalisation and padding as the tree step; needs Transformer Engine.
    """
    chunks = model if isinstance(model, list) else [model]
    return _run_schedule(
        chunks, mbs, loss_fn, forward_only, temperature, tp_group, thd=True, head=head, with_entropy=with_entropy
    )


def _run_schedule(
    chunks, mbs, loss_fn, forward_only, temperature, tp_group, *, thd: bool, head: str, with_entropy: bool,
    collect: bool = False,
) -> list:
    """Validate, pad and run the schedule. ``collect`` (with ``forward_only``): the schedule returns each
    micro-batch's detached head outputs (megatron-core's ``collect_non_loss_data``), not loss dicts."""
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}; got {head!r}")
    if with_entropy and head != "logprobs":
        raise ValueError(f"with_entropy=True needs head='logprobs' (a language-model head); got head={head!r}")
    config = get_model_config(chunks[0])
    if thd and not forward_only and (why := thd_backward_refusal(config.kv_channels)):
        raise ValueError(why)
    if not config.calculate_per_token_loss and not collect:
        raise ValueError(
            "tree training needs TransformerConfig.calculate_per_token_loss=True: the loss is "
            "normalised by counts summed over all micro-batches, so tree and flat steps agree exactly "
            "(set it, e.g. bridge.set_extra_args(calculate_per_token_loss=True))"
        )
    if not forward_only:
        _finalize_grads_for_training(chunks, config)
        configure_grad_sync(chunks)  # overlap_grad_reduce: DDP's no_sync for all but the last micro-batch
    if chunks[0] not in _ANNOUNCED:
        _ANNOUNCED.add(chunks[0])
        _log.info("model parameters are %s (log-probs in fp32 from the logits)", next(chunks[0].parameters()).dtype)
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1 and thd:
        raise ValueError(
            f"the THD flat path (flat_forward_backward / flat_forward_only) does not run under context parallel "
            f"(size {cp}): it would need Transformer Engine's CP attention and Megatron's THD sharding; run the "
            f"flat baseline as chains through the tree path (pack_trees(..., share_prefixes=False) and "
            f"tree_forward_backward) or with context_parallel_size=1"
        )
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if len(chunks) > 1:
        group = config.microbatch_group_size_per_vp_stage or pp
        if len(mbs) < group or len(mbs) % group:
            raise ValueError(
                f"interleaved pipeline parallel needs a micro-batch count that is a multiple of "
                f"microbatch_group_size_per_vp_stage={group} and at least it, got {len(mbs)}; "
                f"pack with MicroBatchSpec(n_mbs_divisor={group}, n_mbs={group})"
            )
    if not len(mbs):
        raise ValueError("got no micro-batches; pack_trees returns at least one")
    chunked = [mb for mb in mbs if mb.chunk is not None]
    if chunked:
        _check_chunks_runnable(chunked, pp=pp, cp=cp, thd=thd)
    steps = len(schedule_steps(list(mbs)))  # a chunked tree is one step
    _check_token_ids(chunks[0], mbs)
    device = next(chunks[0].parameters()).device
    if cp > 1:
        _check_same_across_context_parallel(mbs, device)
    length = max(mb.num_slots for mb in mbs)
    expert_parallel = bool(config.num_moe_experts) and parallel_state.get_expert_model_parallel_world_size() > 1
    # One length everywhere only where the schedule needs it: pipeline stages exchange
    # [length, 1, h] activations, and MoE's all-gather dispatcher gathers equal token counts
    # across expert-parallel ranks. Otherwise every micro-batch keeps its own length.
    fixed = not config.variable_seq_lengths and (pp > 1 or expert_parallel)
    if expert_parallel or fixed:
        # One MAX all-reduce for both: the micro-batch counts (expert-parallel ranks exchange
        # tokens in every micro-batch, so unequal counts would deadlock) and the slot length.
        most, neg_least, longest = _all_reduce_max([steps, -steps, length], device)
        if expert_parallel and most != -neg_least:
            raise ValueError(
                f"ranks hold between {-neg_least} and {most} micro-batches (this one {steps}; the chunks of a "
                f"tree count as one), but "
                f"expert-parallel ranks exchange tokens in every micro-batch and need the same count; pack with "
                f"pack_trees(..., dp_group=parallel_state.get_data_parallel_group()) on every data-parallel rank"
            )
        if fixed:
            length = longest
    uniform_chunks = _uniform_chunks(mbs, device) if expert_parallel else None
    # Sequence parallel splits every micro-batch's slots evenly over the TP ranks; context parallel
    # cuts them into cp * CP_CHUNKS equal chunks.
    multiple = schedule_slot_multiple(chunks[0])
    length = padded_slots(length, multiple)
    pad_to = length if fixed else None
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_group = tp_group if torch.distributed.get_world_size(tp_group) > 1 else None
    if thd:
        forward_step, data_iterator = thd_schedule_inputs(
            mbs, len(chunks), loss_fn, device=device, pad_to=pad_to, pad_multiple=multiple, tp_group=tp_group,
            temperature=temperature, head=head, with_entropy=with_entropy,
        )
    else:
        cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
        forward_step = tree_forward_step(
            loss_fn, tp_group=tp_group, temperature=temperature, head=head, with_entropy=with_entropy,
            cp_group=cp_group, forward_only=forward_only, collect=collect,
        )  # fmt: skip
        data_iterator = tree_data_iterators(
            mbs, len(chunks), device=device, pad_to=pad_to, pad_multiple=multiple,
            cp=(parallel_state.get_context_parallel_rank(), cp) if cp > 1 else None, uniform_chunks=uniform_chunks,
        )  # fmt: skip
    try:
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=steps,
            seq_length=length,
            micro_batch_size=1,
            forward_only=forward_only,
            collect_non_loss_data=collect,
        )
    finally:
        release_chunks()
    if collect:  # a chunked tree's step collected a list: one entry per chunk
        out = [x for item in out for x in (item if isinstance(item, list) else [item])]
    return out


def _check_chunks_runnable(chunked: list[TreeMicroBatch], *, pp: int, cp: int, thd: bool) -> None:
    """Refuse (one line: why, what to do) the layouts that cannot run chunks of a tree larger than a micro-batch."""
    why = None
    if pp > 1:
        why = (f"pipeline parallel ({pp} stages) runs each micro-batch's backward on its own schedule, but a chunk's "
               f"backward must wait for the later chunks that read its keys and values")
    elif cp > 1:
        why = f"context parallel ({cp} ranks) shards each micro-batch's slots, and a chunk's context is not sharded"
    elif thd:
        why = "the flat THD path (flat_forward_backward / flat_forward_only) has no tree attention to read a context"
    if why is not None:
        raise ValueError(
            f"{len(chunked)} micro-batch(es) are chunks of trees larger than max_tokens_per_mb (MicroBatchSpec("
            f"chunk_trees=True)), which cannot run here: {why}; pack with chunk_trees=False (and a max_tokens_per_mb "
            f"of at least the longest sequence) or run with pipeline and context parallel size 1"
        )


def _uniform_chunks(mbs: Sequence[TreeMicroBatch], device: torch.device) -> list[tuple[bool, ...]] | None:
    """Under expert parallel, per schedule step: for each chunk of the rank with the most, whether it runs its forward
    again on any rank (``TreeChunk.recompute_uniform``; two MAX all-reduces over the world, the step counts being
    equal); None when no rank has a chunked tree."""
    steps = [s if isinstance(s, list) else [s] for s in schedule_steps(list(mbs))]
    most = _all_reduce_max([len(s) for s in steps], device)
    if max(most) == 1:
        return None
    flags = [[mb.chunk is not None and mb.chunk.recompute_uniform for mb in s] + [False] * (n - len(s))
             for s, n in zip(steps, most)]
    anywhere = iter(_all_reduce_max([int(f) for step in flags for f in step], device))
    return [tuple(bool(next(anywhere)) for _ in range(n)) for n in most]

"""The chunks of a tree larger than a micro-batch as one step of Megatron's schedule.

A chunk's backward must follow the backwards of every later chunk that reads its keys and values
(their gradients flow into it, :mod:`megatron_tree.mcore.chunk_context`), while megatron-core's
no-pipelining schedule runs each micro-batch's backward right after its forward. So one schedule
step (:class:`ChunkedTree`, one item of the data iterator) is a whole chunked tree: its
``forward_step`` runs the chunks in DFS order as a stack,

* forward chunk c (its exported keys and values kept per layer, its graph kept);
* backward every chunk on top of the stack whose last reader has run (``TreeChunk.last_reader``),
  scaled as megatron-core's ``backward_step`` scales (``config.grad_scale_func``, the MoE aux-loss
  scale), inside DDP's ``no_sync`` when this is the schedule's last step;

and returns the first chunk's output, whose backward megatron-core then runs last; its loss function
reports the loss sums and counts of all chunks (Megatron divides by the global count, so per-token
normalisation is exact). Forward-only, chunks are dropped as soon as their readers have run.

A chunk marked ``recompute`` (``TreeChunk.recompute``, :func:`megatron_tree.core.chunks.recompute_plan`) runs its
first forward without a graph: it keeps only its exported keys and values (the leaves its readers read and
accumulate gradients into). Right before its backward it runs the forward again with the random-number states of
the first (dropout draws the same), finds the same leaves, and backpropagates its loss and the gradients they
accumulated. MoE router statistics are gathered where a graph is built (megatron-core's routers skip them without
grad), so once per chunk, in the second forward.

Memory: the stack holds the chunks whose readers are still to come, each with its graph (under full
activation recompute only its layer inputs, ``[T, h]`` per layer; none when marked ``recompute``) and its exported
keys and values
(``E x 2 x ng x hn`` per attention layer, E <= its depth) plus their gradients; in a Gated DeltaNet layer the
recurrent states and conv windows at its state exports (``Q x (Hv x dk x dv + (K - 1) x D)``, Q the parents of
later chunks' slots: one for a chain, one per branch point that later chunks hang from); beyond the stack, one chunk's
activations. A chain (one long sequence) keeps every chunk until the end; a prompt with many
samples keeps the prompt's chunks and one sample's.

Expert parallel: EP ranks exchange tokens in every forward and backward, so every rank must run the
same sequence of them. There every step runs its chunks' forwards, then their backwards in reverse
(``uniform``), padded with empty chunks to the largest chunk count of that step on any rank: the
stack is the whole tree: a chunk runs its forward again where ``TreeChunk.recompute_uniform`` (planned for this
order, within the same budget) says so on any rank (``ChunkedTree.recompute``).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_tree.core.microbatch import TreeChunk, TreeMicroBatch
from megatron_tree.mcore.chunk_context import ChunkLink, drop_chunk_link, register_chunk_link

__all__ = ["ChunkedTree", "release_chunks", "run_chunked_tree", "schedule_steps"]


FORWARD_RANGE, RECOMPUTE_RANGE = "megatron_tree.chunk_forward", "megatron_tree.chunk_recompute"
BACKWARD_RANGE = "megatron_tree.chunk_backward"
"""``torch.profiler`` ranges around each chunk's forward, the second forward of a chunk marked ``recompute``, and
the backwards this module runs (all but the first chunk's, which megatron-core runs)."""


@dataclass(frozen=True)
class ChunkedTree:
    """One schedule step: the chunks of one tree in DFS order (micro-batches on the model's device).

    uniform    all forwards, then all backwards in reverse (expert parallel; module docstring).
    last       this is the schedule's last step (DDP's overlapped gradient reduction starts after it).
    recompute  per chunk, whether it runs its forward again before its backward (module docstring); None: as
               each chunk's ``TreeChunk.recompute`` says.
    """

    chunks: list[TreeMicroBatch]
    uniform: bool = False
    last: bool = False
    recompute: tuple[bool, ...] | None = None

    def recomputed(self) -> list[bool]:
        """Whether each chunk runs its forward again before its backward."""
        if self.recompute is not None:
            return list(self.recompute)
        return [mb.reruns_forward for mb in self.chunks]


def schedule_steps(mbs: list[TreeMicroBatch]) -> list[TreeMicroBatch | list[TreeMicroBatch]]:
    """``mbs`` with the consecutive chunks of each tree gathered into one list (one step of the schedule)."""
    steps: list = []
    for mb in mbs:
        if mb.chunk is not None and mb.chunk.index > 0:
            steps[-1].append(mb)
        else:
            steps.append([mb] if mb.chunk is not None else mb)
    return steps


def run_chunked_tree(
    item: ChunkedTree,
    forward: Callable[[TreeMicroBatch, torch.Tensor], torch.Tensor],
    loss_func_for: Callable[[TreeMicroBatch], Callable],
    config,
    *,
    train: bool,
    collect: bool = False,
) -> tuple[torch.Tensor, Callable]:
    """Run ``item`` (module docstring); returns ``(first chunk's output, its loss function)`` for megatron-core.

    ``forward(mb, attention_mask)`` runs the model on a chunk; ``loss_func_for(mb)`` is the loss function
    of a micro-batch (``tree_loss_func``). ``train``: run the backwards (else forward only); ``collect``: the
    schedule collects outputs (``collect_non_loss_data``), not losses. The returned loss function gives the
    first chunk's loss with the count and report of all chunks, or with ``non_loss_data=True`` the list of every
    chunk's outputs in order. The first chunk's keys and values stay until the next step (or
    :func:`release_chunks`): its backward and recompute come after this returns.
    """
    release_chunks()
    links: list[ChunkLink] = []
    masks: list[torch.Tensor] = []
    stack: list[int] = []
    pending: dict[int, torch.Tensor] = {}  # chunk -> loss whose backward is to come
    counts, reports, collected = [], [], []
    root = None
    again = [train and not collect and flag for flag in item.recomputed()]
    rng: dict[int, tuple] = {}  # chunk to run again -> the random-number states its first forward started from

    def losses(c: int, output: torch.Tensor) -> None:
        loss, count, report = loss_func_for(item.chunks[c])(output)
        pending[c] = loss
        counts.append(count)
        reports.append(report["loss"])

    def rerun(c: int) -> torch.Tensor:
        with _started_from(rng.pop(c)), torch.profiler.record_function(RECOMPUTE_RANGE):
            return forward(item.chunks[c], masks[c])

    def backward(c: int) -> None:
        if c in rng:
            losses(c, rerun(c))
        if train and c in pending:
            _backward(pending.pop(c), config, item.last)
        drop_chunk_link(masks[c])

    for c, mb in enumerate(item.chunks):
        info = mb.chunk
        context = [] if info is None else [(links[s].store, k) for s, k in info.sources]
        mask = mb.attention_mask if mb.context_mask is None else mb.context_mask
        links.append(ChunkLink(context=context, export_slots=mb.export_slots,
                               **({} if info is None else _recurrent_link(info, links, mask.device))))
        masks.append(mask)
        _HELD.append(mask)
        register_chunk_link(mask, links[-1])
        if again[c]:
            rng[c] = _random_states()
        with torch.profiler.record_function(FORWARD_RANGE), torch.no_grad() if again[c] else contextlib.nullcontext():
            output = forward(mb, mask)
        if c == 0 and not again[c]:
            root = output
        elif collect:
            collected.append(loss_func_for(mb)(output, non_loss_data=True))
        elif not again[c]:  # a chunk run again takes its losses from its second forward
            losses(c, output)
        del output
        stack.append(c)
        while not item.uniform and len(stack) > 1 and _readers_done(item.chunks[stack[-1]], c):
            backward(stack.pop())
    while len(stack) > 1:
        backward(stack.pop())
    output = rerun(0) if 0 in rng else root
    first = loss_func_for(item.chunks[0])

    def loss_func(output: torch.Tensor, non_loss_data: bool = False):
        if non_loss_data:
            return [first(output, non_loss_data=True), *collected]
        loss, count, report = first(output)
        return loss, count + sum(counts), {"loss": report["loss"] + sum(reports)}

    return output, loss_func


_HELD: list[torch.Tensor] = []
"""Masks of the chunks registered since the last :func:`release_chunks`: the first chunk's link outlives
:func:`run_chunked_tree` (megatron-core runs its backward), and a step that raised leaves the others'."""


def release_chunks() -> None:
    """Drop the first chunks' links (and kept keys, values and states), and those a failed step left: call once
    their backwards have run."""
    while _HELD:
        drop_chunk_link(_HELD.pop())


def _recurrent_link(info: TreeChunk, links: list[ChunkLink], device: torch.device) -> dict:
    """A chunk's ``ChunkLink`` fields for recurrent layers: its state exports, and its carried states as
    ``(source store, rows)`` per source chunk (``info.carried`` is root first, so each source's rows are
    consecutive)."""
    carried = [(links[s].store, torch.tensor([row for _, row in rows]).to(device, non_blocking=True))  # no host sync
               for s, rows in itertools.groupby(info.carried, key=lambda pair: pair[0])]
    return {"state_exports": info.state_exports, "carried": carried}


def _readers_done(mb: TreeMicroBatch, current: int) -> bool:
    """Whether every chunk that reads ``mb``'s exported keys and values has run (forward and backward)."""
    return mb.chunk is None or mb.chunk.last_reader <= current


def _random_states() -> tuple:
    """The random-number states now: torch's CPU generator, the current CUDA device's (None without CUDA) and
    megatron-core's CUDA tracker's (dropout inside tensor-parallel regions)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


@contextlib.contextmanager
def _started_from(states: tuple):
    """Run the body from the random-number states ``states`` (:func:`_random_states`), then restore those it found."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def put(cpu, cuda, tracker):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        get_cuda_rng_tracker().set_states(tracker)

    found = _random_states()
    put(*states)
    try:
        yield
    finally:
        put(*found)


def _backward(loss: torch.Tensor, config, last: bool) -> None:
    """megatron-core's ``backward_step`` for a chunk's loss: scaled by ``config.grad_scale_func``, the MoE aux
    losses by the same scale; inside DDP's ``no_sync`` when the schedule's own ``no_sync`` is not open (its last
    step), so that the gradient reduction starts only after the first chunk's backward."""
    if not loss.requires_grad:
        return
    if config.num_moe_experts:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        one = torch.ones(1, device=loss.device)
        MoEAuxLossAutoScaler.set_loss_scale(config.grad_scale_func(one) if config.grad_scale_func else one)
    if config.grad_scale_func is not None:
        loss = config.grad_scale_func(loss)
    no_sync = config.no_sync_func if last and config.no_sync_func is not None else contextlib.nullcontext
    with no_sync(), torch.profiler.record_function(BACKWARD_RANGE):
        torch.autograd.backward(loss)

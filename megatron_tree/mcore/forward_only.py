"""Forward-only tree passes that return results: old-policy and reference log-probs, critic
values, reward scores.

:func:`tree_forward_only` runs tree micro-batches through megatron-core's schedule
(``forward_only``, ``collect_non_loss_data``: PP, VPP, TP, EP, DP, CP as in training) under
``torch.no_grad``, and returns per-sequence results in the caller's sequence order (the ids
``pack_trees`` gave: ``mb.sequence_ids`` index the sequences passed to it) on every rank of
the pipeline. The last pipeline stage computes them; one broadcast over the pipeline group
hands them to the other stages. Tensor-parallel ranks compute identical results. Each
data-parallel rank gets the results of its own sequences; context-parallel ranks all get the
whole micro-batches' results.

Memory is O(tokens): log-probs go through the chunked vocab-parallel gather, values and
scores read one number per slot.
"""

from __future__ import annotations

from typing import Sequence

import torch
from megatron.core import parallel_state

from megatron_tree.core.microbatch import TreeMicroBatch
from megatron_tree.mcore.model_check import check_tree_model
from megatron_tree.mcore.schedule import _run_schedule

__all__ = ["flat_forward_only", "tree_forward_only"]


def _sizes(mb: TreeMicroBatch, head: str, with_entropy: bool) -> list[int]:
    """Entries per sequence of ``mb`` in its flat head output (host ints, no device sync)."""
    if head == "scores":
        return [int(end) for end in (mb.sequence_ends or [True] * len(mb.sequence_ids))]
    return [n * (2 if with_entropy else 1) for n in mb.target_counts]


def _flatten(output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], mb: TreeMicroBatch, head: str) -> torch.Tensor:
    """One micro-batch's head output as fp32 ``[sum of _sizes]``: per sequence, its log-probs then
    (with entropy) its entropies, so each sequence is one contiguous range (scores: of the sequences that
    end here)."""
    if head == "scores" and mb.sequence_ends is not None:
        ends = [i for i, end in enumerate(mb.sequence_ends) if end]  # an index, not a bool mask: no host sync
        return output.float()[torch.tensor(ends, dtype=torch.long).to(output.device, non_blocking=True)]
    if not isinstance(output, tuple):
        return output.float()
    logprobs, entropy = (o.float() for o in output)
    counts = mb.target_counts
    pairs = zip(logprobs.split(counts), entropy.split(counts))
    return torch.cat([torch.cat(pair) for pair in pairs]) if counts else logprobs


def tree_forward_only(
    model: torch.nn.Module | list[torch.nn.Module],
    mbs: Sequence[TreeMicroBatch],
    *,
    head: str = "logprobs",
    with_entropy: bool = False,
    temperature: float = 1.0,
    tp_group: torch.distributed.ProcessGroup | None = None,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]] | torch.Tensor:
    """Per-sequence outputs of a tree model on ``mbs``, on every rank, in the caller's order.

    Args:
      model: the model chunks of this rank (built for tree training: ``check_tree_model``), a
             language model for ``head="logprobs"``, a value model (mbridge's
             ``make_value_model``) for ``"values"`` / ``"scores"``. Every rank of the job calls it.
      mbs:   every micro-batch ``pack_trees`` returned for this rank's sequences (their
             ``sequence_ids`` must cover ``0 .. n-1`` once each).
      head:  ``"logprobs"`` | ``"values"`` | ``"scores"`` (:data:`~megatron_tree.mcore.schedule.HEADS`).
      with_entropy: log-probs only; also the entropy of each predicting distribution.
      temperature: log-probs only; logits are divided by it.
      tp_group: defaults to Megatron's tensor-parallel group.

    Returns, on the model's device, fp32, sequence i of the caller's batch at index i:
      ``"logprobs"``: n tensors ``[L_i - 1]``, ``log p(s[t+1] | s[:t+1])``; with ``with_entropy``,
      ``(logprobs, entropies)``, two such lists. ``"values"``: n tensors ``[L_i - 1]``, the value
      of each state ``s[:t+1]`` (aligned with the log-probs). ``"scores"``: ``[n]``, the value
      at each sequence's last token.

    Runs under ``torch.no_grad``; the modules' training flags are left as they are (call
    ``model.eval()`` first if the model has dropout). ``calculate_per_token_loss`` is not needed.
    """
    chunks = model if isinstance(model, list) else [model]
    check_tree_model(chunks)
    return _forward_only(chunks, mbs, head, with_entropy, temperature, tp_group, thd=False)


def flat_forward_only(
    model: torch.nn.Module | list[torch.nn.Module],
    mbs: Sequence[TreeMicroBatch],
    *,
    head: str = "logprobs",
    with_entropy: bool = False,
    temperature: float = 1.0,
    tp_group: torch.distributed.ProcessGroup | None = None,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]] | torch.Tensor:
    """:func:`tree_forward_only` for the flat baseline: flat micro-batches (``pack_trees(...,
    share_prefixes=False)``) through an upstream model, each sequence a THD segment, as
    :func:`~megatron_tree.mcore.schedule.flat_forward_backward` runs them (needs Transformer Engine)."""
    chunks = model if isinstance(model, list) else [model]
    return _forward_only(chunks, mbs, head, with_entropy, temperature, tp_group, thd=True)


def _forward_only(chunks, mbs, head, with_entropy, temperature, tp_group, *, thd: bool):
    # A sequence through several chunks of a tree has a part in each (in DFS order, so in order).
    ids = [sid for mb in mbs for sid, end in zip(mb.sequence_ids, mb.sequence_ends or [True] * len(mb.sequence_ids))
           if end]
    if sorted(ids) != list(range(len(ids))) or {sid for mb in mbs for sid in mb.sequence_ids} != set(ids):
        raise ValueError(
            f"the micro-batches hold sequence ids {sorted(ids)[:8]}{'...' if len(ids) > 8 else ''}, not each of "
            f"0..{len(ids) - 1} once: pass every micro-batch pack_trees returned for this rank's sequences"
        )
    with torch.no_grad():
        collected = _run_schedule(
            chunks, mbs, None, True, temperature, tp_group, thd=thd, head=head, with_entropy=with_entropy,
            collect=True,
        )  # fmt: skip
    sizes = [_sizes(mb, head, with_entropy) for mb in mbs]
    total = sum(map(sum, sizes))
    device = next(chunks[0].parameters()).device
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        flat = torch.cat([_flatten(out, mb, head) for out, mb in zip(collected, mbs)])
        assert flat.numel() == total, (flat.numel(), total)
    else:
        flat = torch.empty(total, dtype=torch.float32, device=device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            flat,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )

    parts: list[list[torch.Tensor]] = [[] for _ in ids]
    for mb, mb_sizes, pieces in zip(mbs, sizes, flat.split([sum(s) for s in sizes])):
        for sid, piece in zip(mb.sequence_ids, pieces.split(mb_sizes)):
            parts[sid].append(piece)
    if head == "scores":
        return torch.cat([p for seq in parts for p in seq]) if ids else flat
    if with_entropy:
        halves = [[piece.chunk(2) if piece.numel() else (piece, piece) for piece in seq] for seq in parts]
        return [torch.cat([h[0] for h in seq]) for seq in halves], [torch.cat([h[1] for h in seq]) for seq in halves]
    return [torch.cat(seq) for seq in parts]

"""Per-sequence values and scores from a value head's output on a tree micro-batch.

Shape legend (as in :mod:`megatron_tree.ops.logprobs`): T = slots of the micro-batch, n = sequences
held, N = their next-token targets. A value head (mbridge's ``make_value_model``: the output
layer replaced by a ``[hidden, 1]`` linear) makes ``GPTModel`` return ``values [1, T, 1]``, the
same on every tensor-parallel rank (mbridge's head gathers sequence-parallel shards itself).

The value at a slot depends only on its prefix (the root path to it), so a shared slot's value
is every sequence's value there. Layouts:

- :func:`gather_tree_values` -> ``[N]``, the log-prob layout: entry j of sequence k is the
  value of the state ``s[:j+1]`` (read at the slot predicting ``s[j+1]``, ``mb.logprob_slots``),
  aligned with ``log p(s[j+1] | s[:j+1])``; sequence k at ``mb.cu_targets[k]:mb.cu_targets[k+1]``.
- :func:`gather_tree_scores` -> ``[n]``: the value at each sequence's last token
  (``mb.last_slots``), a reward model's score, in ``mb.sequence_ids`` order.

Both are differentiable (the gradient scatters back onto the slots, summing over the
sequences that share one), import no Megatron and run on any device.
"""

from __future__ import annotations

import torch

from megatron_tree.core.microbatch import TreeMicroBatch


def _slot_values(values: torch.Tensor, mb: TreeMicroBatch) -> torch.Tensor:
    """``values [1, T, 1]`` (or ``[1, T]``) -> ``[T]``, checked against ``mb``."""
    if not isinstance(mb, TreeMicroBatch):
        raise TypeError(f"mb must be a TreeMicroBatch (from pack_trees); got {type(mb).__name__}.")
    shape = tuple(getattr(values, "shape", ()))
    if (
        not isinstance(values, torch.Tensor)
        or not values.is_floating_point()
        or values.ndim not in (2, 3)
        or shape[:2] != (1, mb.num_slots)
        or (values.ndim == 3 and shape[2] != 1)
    ):
        raise ValueError(
            f"values must be a float tensor [1, T={mb.num_slots}, 1] (a value head's output for mb.input_ids); "
            f"got {type(values).__name__} {getattr(values, 'dtype', '')} shape {shape}. A [1, T, V] output is a "
            "language-model head: build the model with a value head (mbridge's make_value_model callback)."
        )
    if values.device != mb.logprob_slots.device:
        raise ValueError(f"values are on {values.device} but mb on {mb.logprob_slots.device}; move mb with mb.to().")
    return values.reshape(mb.num_slots)


def gather_tree_values(values: torch.Tensor, mb: TreeMicroBatch) -> torch.Tensor:
    """Per-sequence per-token values ``[N]`` in the log-prob layout (module docstring).

    Args:
      values: [1, T, 1] (or [1, T]) float, the value head's output for ``mb`` (padding slots
              are never read).
      mb:     the micro-batch, on the values' device.

    Returns:
      [N] in the values' dtype: for each sequence of ``mb.sequence_ids`` in order, its ``len - 1``
      values ``V(s[:j+1])``, j = 0 .. len - 2, laid out as :func:`~megatron_tree.gather_tree_logprobs`
      lays out log-probs (``mb.cu_targets``).
    """
    return _slot_values(values, mb)[mb.logprob_slots]


def gather_tree_scores(values: torch.Tensor, mb: TreeMicroBatch) -> torch.Tensor:
    """One score per sequence ``[n]``: the value head at each sequence's last token.

    Args as in :func:`gather_tree_values`. Returns ``[n]`` in ``mb.sequence_ids`` order, the
    values' dtype: ``values[0, mb.last_slots[k], 0]`` for sequence k (a reward model's score of
    the whole sequence).
    """
    return _slot_values(values, mb)[mb.last_slots]

"""One packed tree micro-batch: the tensors a model step needs, and the host-side bookkeeping.

Shape legend: T = slots of the micro-batch (unique tokens + trailing padding),
n = sequences held, N = sum over held sequences of (len - 1) next-token targets.

Mask convention (the interval encoding, see ``megatron_tree.core.tree``): slots are in DFS
pre-order, so every subtree is one contiguous range. ``attention_mask[0, j]`` is the end
(exclusive) of the subtree of slot j, and key j is visible to query i iff
``j <= i < attention_mask[0, j]``. A padding slot j has ``attention_mask[0, j] == j + 1``:
it sees only itself and nobody sees it.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class TreeMicroBatch:
    """A micro-batch of prefix trees laid out in DFS pre-order.

    Device tensors (all on CPU when built; move with :meth:`to`):
      input_ids      LongTensor  [1, T]  token of each slot, ``pad_token_id`` after ``num_tokens``.
      position_ids   LongTensor  [1, T]  depth of each slot = its position in its sequence
                                         (0 for padding). Feed it to RoPE.
      attention_mask IntTensor   [1, T]  int32 subtree end of each slot (interval encoding above);
                                         what ``GPTModel(..., attention_mask=...)`` takes when the
                                         model is built with tree attention.
      cu_targets     IntTensor   [n+1]   int32 offsets of each sequence's *targets* in the 1-D log-prob
                                         output [N] (FlashAttention's cu_seqlens convention, over targets,
                                         not tokens): sequence k's are ``out[cu_targets[k]:cu_targets[k+1]]``,
                                         ``len_k - 1`` of them. (``cu_seqlens``: its 0.1 name, deprecated.)
      logprob_slots  LongTensor  [N]     slot whose logits predict each target (a node with several
                                         children predicts a different token for each child).
      logprob_labels LongTensor  [N]     the target token ``s[t+1]`` predicted at depth ``t``.
      multiplicity   LongTensor  [1, T]  how many held sequences pass through each slot (the original
                                         tokens it stands for; 0 for padding). Weighs MoE router statistics.
      last_slots     LongTensor  [n]     slot of each held sequence's last token, in output order: the
                                         sequence is the root path to it (slot j is on it iff
                                         ``j <= last_slots[k] < attention_mask[0, j]``).

    Host-side ints (never need a device sync):
      sequence_ids   list[int]   input sequences held here, in output order (the order of cu_targets).
      seq_lens       list[int]   their lengths (original tokens).
      num_tokens     int         unique (unpadded) tokens; slots ``[num_tokens, T)`` are padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    cu_targets: torch.Tensor
    logprob_slots: torch.Tensor
    logprob_labels: torch.Tensor
    multiplicity: torch.Tensor
    last_slots: torch.Tensor
    sequence_ids: list[int]
    seq_lens: list[int]
    num_tokens: int

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Deprecated name of :attr:`cu_targets` (it indexes targets, not tokens)."""
        warnings.warn("TreeMicroBatch.cu_seqlens is now TreeMicroBatch.cu_targets (offsets of each sequence's "
                      "targets in the log-prob output)", DeprecationWarning, stacklevel=2)
        return self.cu_targets

    @property
    def num_slots(self) -> int:
        """T: slots including padding."""
        return self.input_ids.shape[1]

    @property
    def num_original_tokens(self) -> int:
        """Tokens the held sequences have before prefix sharing."""
        return sum(self.seq_lens)

    def padded_to(self, length: int, pad_token_id: int = 0) -> "TreeMicroBatch":
        """Copy padded with extra slots up to ``length`` slots (each padding slot sees only itself)."""
        t = self.num_slots
        if length < t:
            raise ValueError(f"cannot pad a micro-batch of {t} slots down to {length}; use a length >= {t}")
        if length == t:
            return self
        extra = length - t
        dev = self.input_ids.device
        return dataclasses.replace(
            self,
            input_ids=torch.cat([self.input_ids, self.input_ids.new_full((1, extra), pad_token_id)], 1),
            position_ids=torch.cat([self.position_ids, self.position_ids.new_zeros((1, extra))], 1),
            attention_mask=torch.cat(
                [self.attention_mask, torch.arange(t + 1, length + 1, dtype=torch.int32, device=dev)[None]], 1
            ),
            multiplicity=torch.cat([self.multiplicity, self.multiplicity.new_zeros((1, extra))], 1),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TreeMicroBatch":
        """Copy of this micro-batch with every tensor field on ``device`` (host-side fields shared)."""
        moved = {
            f.name: value.to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

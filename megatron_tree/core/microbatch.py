"""One packed tree micro-batch: the tensors a model step needs, and the host-side bookkeeping.

Shape legend: T = slots of the micro-batch (unique tokens + trailing padding),
n = sequences held, N = sum over held sequences of (len - 1) next-token targets.

Mask convention (the interval encoding, see ``megatron_tree.core.tree``): slots are in DFS
pre-order, so every subtree is one contiguous range. ``attention_mask[0, j]`` is the end
(exclusive) of the subtree of slot j, and key j is visible to query i iff
``j <= i < attention_mask[0, j]``. A padding slot j has ``attention_mask[0, j] == j + 1``:
it sees only itself and nobody sees it.

Chunks (a tree larger than a micro-batch, ``MicroBatchSpec(chunk_trees=True)``): the tree is cut in DFS
order into contiguous slot ranges, one micro-batch each. A chunk's own fields describe its own slots
(``attention_mask`` is its own forest: slots whose parent lies in an earlier chunk are its roots);
``context_mask`` adds its *context*, the C ancestors of its first slot that earlier chunks computed
(a root path, root first), in front: ``[C context slots | T own slots]`` is again a DFS pre-order
tree, and the chunk's queries (slots ``C..C+T-1`` there) attend to the context's keys and values
that the earlier chunks' forwards kept (:class:`TreeChunk`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from megatron_tree.core import host_checks


@dataclass(frozen=True)
class TreeChunk:
    """Where a chunk micro-batch sits in its tree (host-side ints; module docstring).

    group        which chunked tree of the pack (0, 1, ...); its chunks are consecutive in ``pack_trees``'s list.
    index        the chunk's position in its tree (DFS order), ``0 .. size - 1``.
    size         how many chunks the tree has.
    sources      the context, root first: ``(earlier chunk index, k)`` pairs, each the first k of that
                 chunk's exported slots (``export_slots``); ``sum(k) = C``.
    last_reader  the last chunk of the tree whose context holds some of this chunk's exported slots
                 (``index`` when none does): this chunk's backward must wait for that one's.
    state_exports  own slots (ascending, a subset of the exported ones) that are the parent of a later chunk's
                 slot: recurrent layers keep their state (and conv window) there for that chunk.
    carried      the context slots that are the parent of one of this chunk's own slots, root first (distinct):
                 ``(earlier chunk index, i)`` pairs, each the i-th of that chunk's ``state_exports``; recurrent
                 layers start the own slots hanging from them from what that chunk kept.
    recompute    the chunk keeps only its exported keys and values (and recurrent states) while it waits for its
                 readers, and runs its forward again right before its backward (``chunks.recompute_plan``).
    recompute_uniform  the same in expert parallel's order (every forward, then every backward in reverse).
    """

    group: int
    index: int
    size: int
    sources: tuple[tuple[int, int], ...]
    last_reader: int
    state_exports: tuple[int, ...] = ()
    carried: tuple[tuple[int, int], ...] = ()
    recompute: bool = False
    recompute_uniform: bool = False

    @property
    def context_len(self) -> int:
        """C: the context slots in front of the chunk's own (``context_mask``)."""
        return sum(k for _, k in self.sources)


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
      context_mask   IntTensor   [1, C+T] chunks only (else None): the interval vector of the C context
                                         slots followed by the T own slots; run the chunk with it as
                                         ``attention_mask`` (module docstring).
      export_slots   LongTensor  [E]     chunks only: the own slots later chunks read as context (the
                                         ancestors of the next chunk's first slot, root first); None when none.

    Host-side ints (never need a device sync):
      sequence_ids   list[int]   input sequences held here, in output order (the order of cu_targets).
      seq_lens       list[int]   their lengths (original tokens).
      num_tokens     int         unique (unpadded) tokens; slots ``[num_tokens, T)`` are padding.
      chunk          TreeChunk | None  where a chunk sits in its tree (None: a micro-batch of whole trees).
      target_starts  list[int] | None  chunks: each held sequence's part here begins at its target
                                 ``target_starts[k]`` (its depth); ``seq_lens[k]`` are the part's tokens.
                                 None: every sequence whole (all 0).
      sequence_ends  list[bool] | None chunks: whether each held part holds its sequence's last token (the
                                 part then has ``seq_lens[k] - 1`` targets, else ``seq_lens[k]``). None: all True.
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
    context_mask: torch.Tensor | None = None
    export_slots: torch.Tensor | None = None
    chunk: TreeChunk | None = None
    target_starts: list[int] | None = None
    sequence_ends: list[bool] | None = None

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
    def reruns_forward(self) -> bool:
        """A chunk that runs its forward again right before its backward (``TreeChunk.recompute``)."""
        return self.chunk is not None and self.chunk.recompute

    @property
    def num_original_tokens(self) -> int:
        """Tokens the held sequences (parts of sequences, in a chunk) have before prefix sharing."""
        return sum(self.seq_lens)

    @property
    def target_counts(self) -> list[int]:
        """Targets of each held sequence (part) here, host ints: ``cu_targets.diff()`` without a device sync."""
        ends = self.sequence_ends or [True] * len(self.seq_lens)
        return [n - int(e) for n, e in zip(self.seq_lens, ends)]

    def target_index(self, offsets) -> "np.ndarray":
        """Where this micro-batch's ``[N]`` targets lie in a per-target array of all sequences: ``offsets[i]`` is
        where sequence i's ``len_i - 1`` targets begin there (int64 ``[N]``, host). Index per-target rollout
        data (loss masks, old log-probs) with it; a chunk holds parts of sequences (``target_starts``)."""
        starts = self.target_starts or [0] * len(self.seq_lens)
        counts = np.asarray(self.target_counts, np.int64)
        first = np.asarray(offsets, np.int64)[np.asarray(self.sequence_ids, np.int64)] + np.asarray(starts, np.int64)
        seg = np.cumsum(counts) - counts
        return np.repeat(first - seg, counts) + np.arange(int(counts.sum()), dtype=np.int64)

    def gather_targets(self, per_sequence) -> torch.Tensor:
        """``[N]``: each held sequence's entries here out of ``per_sequence[i]``, a ``[len_i - 1]`` tensor per input
        sequence i (old log-probs, advantages, loss masks), concatenated in output order (a chunk's parts:
        their ``target_starts`` onwards)."""
        starts = self.target_starts or [0] * len(self.seq_lens)
        pieces = [per_sequence[i][s : s + n] for i, s, n in zip(self.sequence_ids, starts, self.target_counts)]
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword inputs the model's forward takes besides ``(input_ids, position_ids, attention_mask)``: none
        (a :class:`~megatron_tree.core.vision_packing.VisionMicroBatch` adds its images)."""
        return {}

    def padded_to(self, length: int, pad_token_id: int = 0) -> "TreeMicroBatch":
        """Copy padded with extra slots up to ``length`` slots (each padding slot sees only itself)."""
        t = self.num_slots
        if length < t:
            raise ValueError(f"cannot pad a micro-batch of {t} slots down to {length}; use a length >= {t}")
        if length == t:
            return self
        extra = length - t
        dev = self.input_ids.device
        context = {}
        if self.context_mask is not None:
            c = self.context_mask.shape[1] - t
            pad = torch.arange(c + t + 1, c + length + 1, dtype=torch.int32, device=dev)[None]
            context["context_mask"] = torch.cat([self.context_mask, pad], 1)
        return dataclasses.replace(
            self,
            **context,
            input_ids=torch.cat([self.input_ids, self.input_ids.new_full((1, extra), pad_token_id)], 1),
            position_ids=torch.cat([self.position_ids, self.position_ids.new_zeros((1, extra))], 1),
            attention_mask=torch.cat(
                [self.attention_mask, torch.arange(t + 1, length + 1, dtype=torch.int32, device=dev)[None]], 1
            ),
            multiplicity=torch.cat([self.multiplicity, self.multiplicity.new_zeros((1, extra))], 1),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TreeMicroBatch":
        """Copy of this micro-batch with every tensor field on ``device`` (host-side fields shared). Moving from the
        CPU, the masks' interval check and the log-prob slots' and labels' ranges are computed on the CPU copy and
        noted on the moved tensors (:mod:`~megatron_tree.core.host_checks`): the kernels' input checks then need no
        host sync. The attention mask's host copy is noted too (``host_copy``): the cudnn_flex backend builds its
        mask from it off the compute stream."""
        moved = {
            f.name: value.to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        for name, tensor in moved.items():
            source = getattr(self, name)
            if tensor is source or source.device.type != "cpu":
                continue
            if name in ("attention_mask", "context_mask") and host_checks.interval_vector_ok(source):
                host_checks.remember(tensor, interval_vector=True)
                if name == "attention_mask":  # what a backend may build its mask from without a host sync
                    host_checks.remember(tensor, host_copy=source.clone())
            elif name in ("logprob_slots", "logprob_labels"):
                host_checks.remember(tensor, value_range=host_checks.value_range(source))
        return dataclasses.replace(self, **moved)

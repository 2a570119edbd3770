"""MicroBatchSpec: how a batch of sequences is cut into tree micro-batches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

PACKING_ALGORITHMS = ("ffd", "kk")


@dataclass(frozen=True, kw_only=True)
class MicroBatchSpec:
    """Validated at construction; copy with overrides through :meth:`new`.

    max_tokens_per_mb  capacity of one micro-batch in unique (tree) tokens; without ``chunk_trees``
                       a sequence longer than this cannot be packed.
    n_mbs              at least this many micro-batches per step.
    n_mbs_divisor      the micro-batch count is a multiple of this (pipeline parallel: PP size,
                       or ``microbatch_group_size_per_vp_stage`` for interleaved PP).
    granularity        runs of ``granularity`` adjacent input sequences (0..g-1, g..2g-1, ...)
                       always land in the same micro-batch (e.g. the samples of one prompt).
    packing_algorithm  "ffd" (first-fit decreasing, then least-loaded placement) or "kk"
                       (Karmarkar–Karp differencing; falls back to "ffd" rather than overflow).
    chunk_trees        a tree (prefix group) larger than a micro-batch is cut in DFS order into chunks of
                       at most ``max_tokens_per_mb`` slots that read their ancestors' keys and values from
                       the earlier chunks (every unique token computed once; any sequence length). False:
                       such a tree is split at branch points, each part recomputing the path above it,
                       and a sequence longer than a micro-batch is refused. Chunks run through
                       ``tree_forward_backward`` / ``tree_forward_only`` without pipeline or context parallel.
    max_kept_tokens    with ``chunk_trees``: the most slots of activations that chunks waiting for a later
                       chunk's backward keep (a chunk's backward follows those of the chunks that read its keys
                       and values). Beyond that, the waiting chunks keep only their exported keys and values and
                       run their forward once more right before their backward. Training memory: one chunk's
                       activations, plus at most this many slots', plus the waiting chunks' exported keys and
                       values. None: ``max_tokens_per_mb``; 0: the least memory; more than the largest tree: no
                       recomputation. Forward-only steps never keep activations.
    """

    max_tokens_per_mb: int
    n_mbs: int = 1
    n_mbs_divisor: int = 1
    granularity: int = 1
    packing_algorithm: str = "ffd"
    chunk_trees: bool = False
    max_kept_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_trees, bool):
            raise ValueError(f"MicroBatchSpec.chunk_trees must be a bool, got {self.chunk_trees!r}")
        kept = self.max_kept_tokens
        if kept is not None and (isinstance(kept, bool) or not isinstance(kept, int) or kept < 0):
            raise ValueError(f"MicroBatchSpec.max_kept_tokens must be None or an int >= 0, got {kept!r}")
        if kept is not None and not self.chunk_trees:
            raise ValueError(f"MicroBatchSpec.max_kept_tokens={kept} bounds what the chunks of trees larger than a "
                             f"micro-batch keep, but chunk_trees is False; set chunk_trees=True or drop max_kept_tokens")
        for name in ("max_tokens_per_mb", "n_mbs", "n_mbs_divisor", "granularity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MicroBatchSpec.{name} must be a positive int, got {value!r}")
        if self.packing_algorithm not in PACKING_ALGORITHMS:
            raise ValueError(
                f"MicroBatchSpec.packing_algorithm must be one of {PACKING_ALGORITHMS}, "
                f"got {self.packing_algorithm!r}"
            )

    @classmethod
    def new(cls, spec: "MicroBatchSpec", **overrides: Any) -> "MicroBatchSpec":
        """Copy of ``spec`` with ``overrides`` applied (validated again)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown MicroBatchSpec field(s) {sorted(unknown)}; valid: {cls.field_names()}")
        return dataclasses.replace(spec, **overrides)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "MicroBatchSpec":
        """Build from a mapping (e.g. the ``micro_batch`` section of a YAML config)."""
        if not isinstance(values, Mapping):
            raise ValueError(f"micro-batch config must be a mapping of {cls.field_names()}, got {values!r}")
        unknown = set(values) - set(cls.field_names())
        if unknown:
            raise ValueError(f"unknown micro-batch config key(s) {sorted(unknown)}; valid: {cls.field_names()}")
        if "max_tokens_per_mb" not in values:
            raise ValueError("micro-batch config needs max_tokens_per_mb")
        return cls(**values)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

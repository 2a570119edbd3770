"""Packing metrics, the numbers to log per step (no Megatron import)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from megatron_tree.core.microbatch import TreeMicroBatch


@dataclass(frozen=True, kw_only=True)
class BalanceStats:
    """Balance of a list of loads (tokens per micro-batch, or tree cost per rank).

    spread = max - min; imbalance = max / mean (1.0 is perfect); std and cv = std / mean;
    utilisation = sum / (count * capacity) (NaN without a capacity).
    """

    count: int
    total: float
    max: float
    min: float
    spread: float
    imbalance: float
    std: float
    cv: float
    utilisation: float

    @classmethod
    def of(cls, loads: Sequence[float], capacity: float | None = None) -> "BalanceStats":
        a = np.asarray(loads, dtype=np.float64)
        if a.size == 0:
            raise ValueError("BalanceStats.of needs at least one load")
        mean = a.mean()
        return cls(
            count=int(a.size),
            total=float(a.sum()),
            max=float(a.max()),
            min=float(a.min()),
            spread=float(a.max() - a.min()),
            imbalance=float(a.max() / mean) if mean > 0 else 1.0,
            std=float(a.std()),
            cv=float(a.std() / mean) if mean > 0 else 0.0,
            utilisation=float(a.sum() / (a.size * capacity)) if capacity else float("nan"),
        )


@dataclass(frozen=True, kw_only=True)
class PackingStats:
    """What one step's packing did.

    num_sequences     distinct input sequences (a sequence through several chunks counts once).
    original_tokens   tokens of the sequences before sharing.
    tree_tokens       unique tokens actually computed (sum over micro-batches).
    tree_token_ratio  tree_tokens / original_tokens (lower is better; 1.0 = no sharing).
    recomputed_tokens tokens of chunks that run their forward a second time, right before their backward
                      (``TreeChunk.recompute``; ``MicroBatchSpec.max_kept_tokens``); not in ``tree_tokens``.
                      Under expert parallel the schedule runs its own choice (``recompute_uniform`` of any rank).
    padded_tokens     slots including padding; wasted_tokens = padded - tree.
    balance           BalanceStats of tree tokens per micro-batch against max_tokens_per_mb.
    """

    num_micro_batches: int
    num_sequences: int
    original_tokens: int
    tree_tokens: int
    tree_token_ratio: float
    recomputed_tokens: int
    padded_tokens: int
    wasted_tokens: int
    balance: BalanceStats

    @classmethod
    def of(cls, mbs: Sequence[TreeMicroBatch], max_tokens_per_mb: int | None = None) -> "PackingStats":
        original = sum(mb.num_original_tokens for mb in mbs)
        tree = sum(mb.num_tokens for mb in mbs)
        padded = sum(mb.num_slots for mb in mbs)
        return cls(
            num_micro_batches=len(mbs),
            num_sequences=len({i for mb in mbs for i in mb.sequence_ids}),
            original_tokens=original,
            tree_tokens=tree,
            tree_token_ratio=tree / original if original else 1.0,
            recomputed_tokens=sum(mb.num_tokens for mb in mbs if mb.reruns_forward),
            padded_tokens=padded,
            wasted_tokens=padded - tree,
            balance=BalanceStats.of([mb.num_tokens for mb in mbs], max_tokens_per_mb),
        )

    def as_log_dict(self, prefix: str = "packing/") -> dict[str, float]:
        """Flat ``{name: value}`` for a logger (balance fields as ``balance_<name>``)."""
        out = {k: v for k, v in asdict(self).items() if k != "balance"}
        out.update({f"balance_{k}": v for k, v in asdict(self.balance).items()})
        return {prefix + k: float(v) for k, v in out.items()}

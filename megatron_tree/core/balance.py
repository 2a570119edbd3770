"""Split a rollout batch across data-parallel ranks by tree cost (no Megatron import).

Every rank calls :func:`balance_across_ranks` on the same global batch and gets the same
answer (no collective): the plan depends only on the input. Work is balanced on the cost
of the trees each rank will build, not on original tokens:

    cost(tree) = unique_tokens + attention_weight * attention_pairs

``attention_pairs`` = sum over the tree's tokens of (depth + 1), the (query, key) pairs tree
attention computes. Per layer and token the linear layers cost about 24 h^2 FLOPs and one
(query, key) pair about 4 h, so ``attention_weight = 1 / (6 h)``; the default is h = 4096.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megatron_tree.core.packing import assign_bins, plan_items
from megatron_tree.core.tree import TokenForest, as_sequences, build_forest

BALANCE_ALGORITHMS = ("kk", "ffd", "round_robin")


def tree_cost(forest: TokenForest, attention_weight: float = 1 / (6 * 4096)) -> float:
    """Cost of computing ``forest`` once: unique tokens + attention_weight * (query, key) pairs."""
    return float(forest.num_tokens + attention_weight * float((forest.depth + 1).sum()))


def balance_across_ranks(
    sequences: Sequence | torch.Tensor,
    world_size: int,
    *,
    attention_mask: torch.Tensor | None = None,
    algorithm: str = "kk",
    attention_weight: float = 1 / (6 * 4096),
) -> list[np.ndarray]:
    """Split a batch over ``world_size`` ranks with balanced tree cost, keeping prefix groups whole
    unless splitting one lowers the busiest rank's cost.

    sequences  list of 1-D sequences, or padded ``input_ids`` [B, S] with ``attention_mask``.
    algorithm  "kk" (Karmarkar–Karp), "ffd" (decreasing, least-loaded rank first), or
               "round_robin" (sequence i to rank i % world_size: the tree-blind baseline).

    Returns one int64 index array per rank (ascending input indices); index any
    per-sequence data (rewards, advantages, old log-probs) with it. An empty batch gives
    ``world_size`` empty arrays (as :func:`~megatron_tree.core.packing.pack_trees` accepts one).

    Prefix groups (root trees) stay whole unless splitting lowers the largest rank's cost:
    the groups larger than a fair share (total unique tokens / world_size) are candidates,
    split at subtree boundaries, each piece carrying a copy of the shared path. The plans
    that split the 0, 1, 2, ... largest candidates are placed and the one whose busiest
    rank costs least wins (ties: fewer splits).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if algorithm not in BALANCE_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {BALANCE_ALGORITHMS}, got {algorithm!r}")
    if attention_weight < 0:
        raise ValueError(f"attention_weight must be >= 0, got {attention_weight}")
    if not len(sequences):
        return [np.zeros(0, np.int64) for _ in range(world_size)]
    seqs = as_sequences(sequences, attention_mask)
    if algorithm == "round_robin":
        return [np.arange(r, len(seqs), world_size, dtype=np.int64) for r in range(world_size)]
    forest = build_forest(seqs)
    fair = max(-(-forest.num_tokens // world_size), int(forest.seq_len.max()))
    groups, sizes = plan_items(forest, forest.num_tokens)  # capacity of everything: one item per root tree

    def cost(idx: np.ndarray) -> float:
        return tree_cost(build_forest([seqs[i] for i in idx.tolist()]), attention_weight)

    parts = [[g] for g in groups]  # each root tree's items: the whole tree, or its pieces once split
    part_costs = [[cost(g)] for g in groups]

    def place() -> tuple[float, list[np.ndarray]]:
        """(cost of the busiest rank, each rank's sequence indices) for the current parts."""
        items = [it for p in parts for it in p]
        bins = assign_bins([c for p in part_costs for c in p], world_size, float("inf"), algorithm)
        share = [np.sort(np.concatenate([items[i] for i in b])) if b else np.zeros(0, np.int64) for b in bins]
        return max(cost(idx) for idx in share if len(idx)), share

    best = place()
    for g in sorted((g for g, size in enumerate(sizes) if size > fair), key=lambda g: -sizes[g]):
        pieces, _ = plan_items(build_forest([seqs[i] for i in groups[g].tolist()]), fair)
        parts[g] = [groups[g][p] for p in pieces]
        part_costs[g] = [cost(it) for it in parts[g]]
        trial = place()
        if trial[0] < best[0]:
            best = trial
    return best[1]


def rank_costs(
    sequences: Sequence, assignment: Sequence[np.ndarray], attention_weight: float = 1 / (6 * 4096)
) -> list[float]:
    """Tree cost of each rank's share (0 for a rank with none): feed to ``BalanceStats.of``."""
    seqs = as_sequences(sequences)
    return [
        tree_cost(build_forest([seqs[i] for i in idx.tolist()]), attention_weight) if len(idx) else 0.0
        for idx in assignment
    ]

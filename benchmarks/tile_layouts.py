"""How the slot layout of a tree micro-batch moves the 128 x 128-tile ceiling of tree attention (CPU only, no kernels).

    python benchmarks/tile_layouts.py            # the GRPO and multi-turn micro-batches of attention_bench.py
    python benchmarks/tile_layouts.py --workloads grpo multi_turn long_multi_turn   # and its 128k tree

A tile that a node's boundary cuts holds pairs the mask hides, and a tile kernel computes them anyway
(``attention_bench.tile_ceiling``: useful pairs per visited tile pair, against the causal mask's on the same slots).
Two layout changes the packer does not make today, counted here on the fullest micro-batch of each workload:

- *largest first*: the trees of a micro-batch, and the children of every node, laid out by subtree size, largest
  first (every later sibling's rows visit the tile where its parent ends half-masked: the fewer such rows the better);
- *aligned*: padding slots (each attending to itself only) before every tree that would start inside a tile, so that
  no tree's rows visit a tile shared with the tree before it. The packer keeps padding after ``num_tokens`` only
  (``TreeMicroBatch``), so this needs padding inside a micro-batch.

And one call layout with no partly masked tile but the diagonal ones, counted apart:

- *root paths*: one varlen sequence per node (a maximal run of slots each the child of the slot before), its
  ancestors' keys and values copied before its own; every sequence is then bottom-right causal, which a dense varlen
  kernel (TE's cuDNN THD call) runs. Each node's rows are tiled from its own first row, so every node ends in a
  ragged row tile and its diagonal is off the key tiles by its ancestors' count.

Prints the slots (padding included, to a whole tile), partial tiles and the ceiling of each of the four layouts, then
the root-path layout's ceiling and copied keys.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from attention_bench import LONG_WORKLOADS, SLOTS, fullest_micro_batch, tile_ceiling, visited_tiles, workloads
from megatron_tree.core.masks import tree_depths, tree_parents

TILE = 128


def relayout(subtree_end: np.ndarray, largest_first: bool, aligned: bool) -> np.ndarray:
    """``subtree_end`` int [T] of the same forest (no padding slots) laid out again in DFS order: trees and each node's
    children largest subtree first if ``largest_first`` (else as given), and with self-attending padding slots before
    every tree that would start inside a tile if ``aligned``. Returns the new ``subtree_end`` (padding included)."""
    end = np.asarray(subtree_end, dtype=np.int64)
    size = end - np.arange(len(end))
    parent = tree_parents(torch.as_tensor(end)).numpy()
    children: dict[int, list[int]] = {}
    for child in np.flatnonzero(parent >= 0).tolist():
        children.setdefault(int(parent[child]), []).append(child)
    roots = np.flatnonzero(parent < 0).tolist()

    def ordered(nodes: list[int]) -> list[int]:
        return sorted(nodes, key=lambda j: -size[j]) if largest_first else nodes

    out: list[int] = []
    for root in ordered(roots):
        if aligned and len(out) % TILE:
            out.extend(range(len(out) + 1, len(out) + 1 + TILE - len(out) % TILE))
        start, order, stack = len(out), [], [root]
        while stack:  # DFS, first child on top of the stack
            j = stack.pop()
            order.append(j)
            stack.extend(reversed(ordered(children.get(j, []))))
        out.extend(start + i + int(size[j]) for i, j in enumerate(order))
    return np.asarray(out, dtype=np.int64)


def root_paths(subtree_end: np.ndarray, tree_pairs: int) -> dict:
    """Ceiling and copied keys of the root-path layout: node n has lq own rows and a ancestors (the depth of its first
    slot); row tile r of it visits key tiles 0 .. (a + its last row) // TILE; against causal on the slots padded to a
    whole tile."""
    end = torch.as_tensor(subtree_end)
    slot = torch.arange(end.shape[0])
    starts = tree_parents(end) != slot - 1
    starts[0] = True  # its parent, -1, is "the slot before"
    first = torch.nonzero(starts).reshape(-1)
    lq = torch.cat([first[1:], first.new_tensor([end.shape[0]])]) - first
    ancestors = tree_depths(end)[first]
    tiles = -(-lq // TILE)
    node = torch.repeat_interleave(torch.arange(lq.shape[0]), tiles)
    r = torch.arange(int(tiles.sum())) - torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles)
    last_row = torch.minimum(lq[node], (r + 1) * TILE) - 1
    visited = int(((ancestors[node] + last_row) // TILE + 1).sum())
    slots = -(-len(subtree_end) // TILE) * TILE
    return dict(nodes=len(first), copied_keys=int(ancestors.sum()), ceiling=tile_ceiling(tree_pairs, visited, slots, TILE))


def ceiling(subtree_end: np.ndarray, tree_pairs: int) -> dict:
    """Slots (padded with self-attending slots to a whole tile), partial tiles and ``tile_ceiling`` of a layout."""
    slots = -(-len(subtree_end) // TILE) * TILE
    partial, visited = visited_tiles(torch.as_tensor(subtree_end, dtype=torch.int32), TILE)
    return dict(slots=slots, partial_tiles=partial, ceiling=tile_ceiling(tree_pairs, visited, slots, TILE))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", nargs="+", default=["grpo", "multi_turn"], choices=sorted(workloads(0)))
    args = ap.parse_args()
    batches = workloads(args.seed)
    for name in args.workloads:
        mb = fullest_micro_batch(batches[name], LONG_WORKLOADS.get(name, SLOTS))
        end = mb.attention_mask[0, : mb.num_tokens].numpy().astype(np.int64)
        pairs = int((end - np.arange(len(end))).sum())
        for largest_first in (False, True):
            for aligned in (False, True):
                row = ceiling(relayout(end, largest_first, aligned), pairs)
                layout = ("largest first" if largest_first else "as packed") + (", aligned" if aligned else "")
                print(f"{name:10s} {layout:24s} slots {row['slots']:6d}  partial tiles {row['partial_tiles']:5d}  "
                      f"ceiling {row['ceiling']:.3f}")
        row = root_paths(end, pairs)
        print(f"{name:10s} {'root paths':24s} {row['nodes']} nodes, {row['copied_keys']} keys copied  "
              f"ceiling {row['ceiling']:.3f}")


if __name__ == "__main__":
    main()

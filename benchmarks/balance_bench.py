"""Tree-aware split of a rollout batch over data-parallel ranks (8 by default), on the CPU.

    python benchmarks/balance_bench.py --out benchmarks/results/balance.json

Per workload and algorithm (kk, ffd, round_robin): tree-cost imbalance over ranks
(max / mean; 1.0 is perfect) and the sharing kept, (original - sum of ranks' unique
tokens) / (original - unique tokens of one global trie), i.e. relative to one rank
holding everything.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from megatron_tree import BalanceStats, balance_across_ranks, build_forest
from megatron_tree.core.balance import rank_costs
from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch
from megatron_tree.core.tree import as_sequences


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/balance.json")
    ap.add_argument("--ranks", type=int, default=8)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    work = {
        "grpo_64x(8-16)": grpo_batch(
            rng, n_prompts=64, samples=(8, 16), prompt_len=(1024, 4096), response_len=(200, 2000), vocab=150000
        ),
        "multi_turn_48": multi_turn_batch(
            rng, n_conversations=48, turns=(4, 24), turn_len=(50, 400), fork_prob=0.2, system_len=1500, vocab=150000
        ),
    }
    rows = []
    for name, seqs in work.items():
        orig = sum(map(len, seqs))
        ideal = build_forest(as_sequences(seqs)).num_tokens
        for algo in ("kk", "ffd", "round_robin"):
            assignment = balance_across_ranks(seqs, args.ranks, algorithm=algo)
            stats = BalanceStats.of(rank_costs(seqs, assignment))
            tokens = sum(build_forest(as_sequences([seqs[i] for i in idx])).num_tokens for idx in assignment)
            kept = (orig - tokens) / (orig - ideal)
            rows.append(
                dict(workload=name, algorithm=algo, ranks=args.ranks, sequences=len(seqs), original_tokens=orig,
                     ideal_tree_tokens=ideal, ranks_tree_tokens=tokens, sharing_kept=kept,
                     cost_imbalance=stats.imbalance, cost_cv=stats.cv)
            )
            print(f"{name:16s} {algo:11s} imbalance={stats.imbalance:.4f} cv={stats.cv:.4f} sharing_kept={kept:.4f}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

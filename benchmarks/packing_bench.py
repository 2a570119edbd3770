"""Packing throughput and sharing kept, on the CPU.

    python benchmarks/packing_bench.py --out benchmarks/results/packing.json

For each workload: pack_trees wall time (median of --repeats) and tokens/s of original
tokens; ``tree_token_ratio``; and the sharing kept, (original - packed) / (original - ideal),
where ideal is the unique-token count of the single global trie.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from megatron_tree import MicroBatchSpec, build_forest, pack_trees
from megatron_tree.core.metrics import PackingStats
from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch, no_sharing_batch
from megatron_tree.core.tree import as_sequences


def workloads(rng):
    yield "grpo_64x16", grpo_batch(
        rng, n_prompts=64, samples=16, prompt_len=(1024, 4096), response_len=(200, 2000), vocab=150000
    ), 32768
    yield "grpo_small_256x8", grpo_batch(
        rng, n_prompts=256, samples=8, prompt_len=(64, 512), response_len=(16, 512), vocab=150000
    ), 8192
    yield "multi_turn_32", multi_turn_batch(
        rng, n_conversations=32, turns=(8, 24), turn_len=(50, 400), fork_prob=0.2, system_len=1500, vocab=150000
    ), 32768
    yield "no_sharing_1024", no_sharing_batch(rng, n=1024, length=(200, 2000), vocab=150000), 16384


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/packing.json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for name, seqs, cap in workloads(rng):
        for algo in ("ffd", "kk"):
            spec = MicroBatchSpec(max_tokens_per_mb=cap, n_mbs=4, n_mbs_divisor=2, packing_algorithm=algo)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                mbs = pack_trees(seqs, spec)
                times.append(time.perf_counter() - t0)
            stats = PackingStats.of(mbs, cap)
            ideal = build_forest(as_sequences(seqs)).num_tokens
            orig = stats.original_tokens
            kept = (orig - stats.tree_tokens) / (orig - ideal) if orig > ideal else 1.0
            row = dict(
                workload=name,
                algorithm=algo,
                sequences=len(seqs),
                original_tokens=orig,
                ideal_tree_tokens=ideal,
                packed_tree_tokens=stats.tree_tokens,
                tree_token_ratio=stats.tree_token_ratio,
                sharing_kept=kept,
                micro_batches=stats.num_micro_batches,
                balance_spread=stats.balance.spread,
                balance_imbalance=stats.balance.imbalance,
                utilisation=stats.balance.utilisation,
                seconds=float(np.median(times)),
                tokens_per_s=orig / float(np.median(times)),
            )
            rows.append(row)
            print(
                f"{name:18s} {algo:3s} seqs={len(seqs):5d} orig={orig:9d} ratio={row['tree_token_ratio']:.3f} "
                f"kept={kept:.4f} mbs={row['micro_batches']:3d} imb={row['balance_imbalance']:.3f} "
                f"t={row['seconds']*1e3:8.1f}ms  {row['tokens_per_s']/1e6:6.2f} M tok/s"
            )
    with open(args.out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

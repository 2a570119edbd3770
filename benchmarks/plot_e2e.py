"""Plot the end-to-end tree vs flat results (benchmarks/e2e_bench.py JSONs) into one PNG.

    python benchmarks/plot_e2e.py benchmarks/results/e2e_qwen3-0.6b.json benchmarks/results/e2e_qwen3-moe-2b.json \
        --out benchmarks/results/e2e_h200.png
    python benchmarks/plot_e2e.py benchmarks/results/te/e2e_chunks_grpo_{8k,16k}.json \
        --out benchmarks/results/te/e2e_chunks.png   # trees larger than a micro-batch
    python benchmarks/plot_e2e.py benchmarks/results/te/e2e_fewest_chunks_grpo_{8k_b,16k}.json \
        benchmarks/results/te/e2e_fewest_chunks_long_multi_turn_{8k,16k}.json \
        benchmarks/results/te/e2e_long_multi_turn_flat_40k.json --out benchmarks/results/te/e2e_fewest_chunks.png
    python benchmarks/plot_e2e.py benchmarks/results/te/e2e_chunks_long_multi_turn_{8192,16384}_{all,default}.json \
        benchmarks/results/te/e2e_long_multi_turn_flat_40k.json --out benchmarks/results/te/e2e_chunks_long.png

A tree-only run (``--modes tree``) is paired with a flat-only run of the same model and batch (same workload,
original and unique tokens, recompute) among the inputs: its speedup is the flat run's median step over its own.
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from e2e_bench import packed_flops  # noqa: E402


def packed_ideal(row: dict) -> float:
    """Flat FLOPs / ``e2e_bench.packed_flops`` (as ``finish_row``) for a tree-only row: the per-token and
    per-pair FLOPs solved from the row's flat and tree FLOPs (two equations in the two unknowns)."""
    tree = row["tree"]
    if not tree.get("recomputed_tokens"):
        return row["flop_ideal_speedup"]
    a, b, c, d = row["original_tokens"], row["flat_pairs"], row["unique_tokens"], row["tree_pairs"]
    det = a * d - b * c
    per_token = (row["flops_flat"] * d - b * row["flops_tree"]) / det
    per_pair = (a * row["flops_tree"] - c * row["flops_flat"]) / det
    return row["flops_flat"] / packed_flops(tree, per_token, per_pair)


def kept_label(row: dict) -> str:
    """How much the waiting chunks kept (``max_kept_tokens``), for chunked rows that say."""
    if not row.get("chunk_trees") or "max_kept_tokens" not in row:
        return ""
    kept = row["max_kept_tokens"]
    if kept is None:
        return f"\n{row['tree'].get('recomputed_tokens', 0) // 1000}k fwd twice"
    return "\nkeep all" if kept >= row["unique_tokens"] else f"\nkept {kept // 1024}k"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = [json.load(open(path)) for path in args.inputs]
    rows = [r for res in results for r in res["rows"]]
    key = lambda r: (r["model"], r["workload"], r["original_tokens"], r["unique_tokens"], r["recompute"])  # noqa: E731
    flat_only = {key(r): r["flat"] for r in rows if "flat" in r and "tree" not in r}
    for r in rows:
        if "speedup" not in r and "tree" in r and key(r) in flat_only:  # tree-only: the flat run of the same batch
            r["speedup"] = flat_only[key(r)]["step_s"] / r["tree"]["step_s"]
            r.setdefault("packed_flop_ideal_speedup", packed_ideal(r))
            r["achieved_fraction_of_ideal"] = r["speedup"] / r["flop_ideal_speedup"]  # as e2e_bench.finish_row
    rows = [r for r in rows if "speedup" in r]  # complete rows only
    flat = {"te_thd_cudnn": "Megatron THD packing, TE cuDNN attention", "tree_kernel_chains": "chains, same kernel"}
    baselines = sorted({flat.get(res.get("baseline"), "chains, same kernel") for res in results})
    for res in results:  # which grouped GEMM the MoE experts ran, where the JSON says
        for r in res["rows"]:
            r["grouped_gemm"] = res.get("grouped_gemm")
    moe = lambda r: "\n" + r["grouped_gemm"] + " experts" if r["grouped_gemm"] and "moe" in r["model"] else ""  # noqa: E731
    labels = [f"{r['model']}\n{r['workload']}" + (f"\n{r['max_tokens_per_mb'] // 1024}k chunks" if r.get("chunk_trees") else "")
              + kept_label(r) + moe(r) for r in rows]
    devices = sorted({res.get("device", "?").replace("NVIDIA ", "") for res in results})
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(1.6 * len(rows) + 2, 9), 4))
    ax.bar([i - 0.27 for i in x], [r["flop_ideal_speedup"] for r in rows], width=0.27, label="FLOP-ideal speedup")
    # The ideal of the trees as packed: a tree split over micro-batches computes its prefix once per part.
    ax.bar([i for i in x], [r["packed_flop_ideal_speedup"] for r in rows], width=0.27,
           label="FLOP-ideal of the trees as packed")
    ax.bar([i + 0.27 for i in x], [r["speedup"] for r in rows], width=0.27, label="measured step speedup")
    for i, r in enumerate(rows):
        ax.text(i + 0.27, r["speedup"], f"{r['achieved_fraction_of_ideal']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("tree vs flat (x)")
    ax.set_title(f"Tree vs flat training step, one {' / '.join(devices)}, bf16 (flat: {'; '.join(baselines)}; "
                 f"label: achieved fraction of ideal)", fontsize=9)
    ax.set_ylim(0, 1.2 * max(max(r["flop_ideal_speedup"], r["speedup"]) for r in rows))
    ax.legend(loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()

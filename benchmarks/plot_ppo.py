"""Plot the launcher's whole PPO step, tree vs flat (JSONL records of ``--log-jsonl``), into one PNG.

    python benchmarks/plot_ppo.py benchmarks/results/te/ppo_tree.jsonl benchmarks/results/te/ppo_no.jsonl \
        --out benchmarks/results/te/ppo_h200.png

Bars: each step's wall time (``step_s``; the first step includes compilation); the title gives the
median speedup after the first step next to the FLOP ideal (flat / tree model FLOPs of a step, from the records'
``tflops_per_gpu``; older records: 1 / ``tree_token_ratio``).
"""

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from ppo_records import load, median_after_first, step_tflop  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tree", help="JSONL of the tree run")
    ap.add_argument("flat", help="JSONL of the --no-tree-training run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = {"tree": load(args.tree), "flat": load(args.flat)}
    med = {name: median_after_first(rows) for name, rows in runs.items()}
    last = {name: rows[-1] for name, rows in runs.items()}
    if all("tflops_per_gpu" in r for r in last.values()):  # the FLOP ideal: flat / tree model FLOPs of a step
        flops = {name: step_tflop(r) for name, r in last.items()}
        ideal, kind = flops["flat"] / flops["tree"], "FLOP ideal"
    else:  # records from before the launcher logged model FLOPs: the linear layers' ideal
        ideal, kind = 1 / last["tree"]["tree_token_ratio"], "token ideal"
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for k, (name, rows) in enumerate(runs.items()):
        ax.bar([r["step"] + 0.2 * (2 * k - 1) for r in rows], [r["step_s"] for r in rows], width=0.4,
               label=f"{name}: median {med[name]:.2f} s")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("whole PPO step, s")
    ax.set_yscale("log")
    ax.set_title(f"PPO step, tree vs flat: {med['flat'] / med['tree']:.2f}x ({kind} {ideal:.2f}x)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

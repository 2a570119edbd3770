"""Plot the long-context multi-turn end-to-end step (``PART=e2e bash benchmarks/gpu_fa4.sh``).

    python benchmarks/plot_e2e_long.py benchmarks/results/te

Reads ``e2e_long_fa4.json`` (flat TE THD and tree, ``auto`` = FA4) and ``e2e_long_flex.json`` (tree,
FlexAttention) there; writes ``e2e_long.png``: step time and model TFLOP/s per mode.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(folder: str) -> None:
    fa4 = json.load(open(os.path.join(folder, "e2e_long_fa4.json")))
    flex = json.load(open(os.path.join(folder, "e2e_long_flex.json")))
    row, flex_row = fa4["rows"][0], flex["rows"][0]
    modes = [("flat: TE THD (cuDNN)", row["flat"]), ("tree: FlexAttention", flex_row["tree"]),
             ("tree: FA4", row["tree"])]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([m for m, _ in modes], [r["step_s"] for _, r in modes], color=["gray", "tab:blue", "tab:green"])
    for bar, (_, r) in zip(bars, modes):
        ax.annotate(f"{r['step_s']:.2f} s\n{r['tflops_per_s']:.0f} TFLOP/s\n{r['peak_mem_gib']:.0f} GiB",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("training step (s)")
    ax.set_ylim(0, row["flat"]["step_s"] * 1.3)
    ax.set_title(f"{row['model']} long multi-turn ({row['original_tokens']} tokens, {row['unique_tokens']} unique), "
                 f"{fa4['device']}\nspeedup FA4 tree {row['speedup']:.2f}x, FLOP ideal {row['flop_ideal_speedup']:.2f}x",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "e2e_long.png"), dpi=120)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/te")

"""The launcher's ``--log-jsonl`` records of a PPO run, tree vs flat: the whole step and each model pass.

    python benchmarks/ppo_records.py benchmarks/results/te/ppo_tree.jsonl benchmarks/results/te/ppo_no.jsonl

Prints the model TFLOP/s of each mode and the FLOP ideal (flat / tree model FLOPs of a step, from the last records'
``tflops_per_gpu * step_s``) with the achieved fraction of it, the step's median after the first (the first
includes compilation) with the micro-batches of each mode, and each pass's median (``pass_<name>_s``: old and
reference log-probs, critic values, reward scores, actor and critic updates). ``gpu_rl_passes.sh`` prints this after
its PPO runs; ``plot_ppo.py`` and ``ppo_flops.py`` read records through :func:`load` and :func:`median_after_first`.
"""

from __future__ import annotations

import argparse
import json
import statistics

PASSES = ("old", "reference", "values", "scores", "actor", "critic")
"""The model passes of a PPO step whose time the launcher records as ``pass_<name>_s``."""


def load(path: str) -> list[dict]:
    """The step records (those with ``step_s``) of a ``--log-jsonl`` file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if '"step_s"' in line]


def median_after_first(records: list[dict], key: str = "step_s") -> float:
    """The median of ``key`` over every record but the first (its step compiles the kernels)."""
    if len(records) < 2:
        raise ValueError(f"{len(records)} step record(s): a median after the first step needs at least 2")
    return statistics.median(r[key] for r in records[1:])


def step_tflop(record: dict) -> float:
    """The model TFLOP of the step a record logs (its ``tflops_per_gpu`` times its ``step_s``)."""
    return record["tflops_per_gpu"] * record["step_s"]


def summary(tree: list[dict], flat: list[dict]) -> list[str]:
    """The lines :func:`main` prints for the tree and the flat run's records."""
    t, f = median_after_first(tree), median_after_first(flat)
    last_t, last_f = tree[-1], flat[-1]
    if "tflops_per_gpu" in last_t and "tflops_per_gpu" in last_f:
        tflop = {"tree": step_tflop(last_t), "flat": step_tflop(last_f)}
        ideal = tflop["flat"] / tflop["tree"]
        flops = (f"model TFLOP/s tree {tflop['tree'] / t:.0f}, flat {tflop['flat'] / f:.0f}; FLOP ideal {ideal:.2f}x, "
                 f"achieved {f / t / ideal:.2f}")
    else:
        flops = ("no tflops_per_gpu in these records (a launcher before it logged model FLOPs): "
                 "benchmarks/ppo_flops.py counts the FLOP ideal from the config")
    passes = {p: (median_after_first(tree, f"pass_{p}_s"), median_after_first(flat, f"pass_{p}_s")) for p in PASSES}
    return [
        flops,
        f"PPO step median after the first: tree {t:.2f} s, flat {f:.2f} s, flat/tree {f / t:.2f} (tree_token_ratio "
        f"{last_t.get('tree_token_ratio', float('nan')):.3f}; micro-batches tree / flat: updates "
        f"{last_t['micro_batches']} / {last_f['micro_batches']}, forward-only passes "
        f"{last_t.get('forward_micro_batches')} / {last_f.get('forward_micro_batches')})",
        "per pass, median after the first (s):  "
        + "  ".join(f"{p} {pt:.3f} / {pf:.3f} ({pf / pt:.2f}x)" for p, (pt, pf) in passes.items())
        + "  (tree / flat)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", help="JSONL of the tree run")
    ap.add_argument("flat", help="JSONL of the --no-tree-training run")
    args = ap.parse_args()
    print("\n".join(summary(load(args.tree), load(args.flat))))


if __name__ == "__main__":
    main()

"""Start-up: a fresh process's first training step, tree vs flat, every kernel cache cold, then warm.

A job's first step compiles kernels: FA4's tree kernels (CuTe DSL), Inductor / Triton's (the log-prob kernel,
megatron-core's fused functions), the CUDA driver's JIT of PTX; cuDNN builds its graphs (the flat THD path) in every
process. Each mode (``--tree-training``, ``--no-tree-training``) runs the launcher twice on cache folders of its own
(FA4's persistent cache, Inductor's, Triton's, the driver's): empty the first time (cold: a new machine or a new
software version) and as that run left them the second time (warm: every later job on the machine). Neither mode
finds what the other compiled (sharing the folders, the second mode to run would start warm: the launcher.md numbers
of 2026-12-03/04 compared a cold tree run with a flat run whose Inductor caches the tree run had filled).

    python benchmarks/startup_bench.py --config configs/ppo_qwen3_0.6b_shape.yaml --steps 3 \
        --out benchmarks/results/te/startup.json

JSON: per mode and run (``cold``, ``warm``) the first step's seconds (``first_step_s``), the seconds from launch to its
end (``to_first_step_end_s``: model building and the wait for FA4's warm-up included), the median of the later
steps (``later_step_s``), the process's wall seconds from start to exit (``wall_s``, model building included) and
what the cache folders hold afterwards (``cache_mb``); the summaries ``first_step_gap_s`` and ``to_first_step_end_gap_s``: tree minus flat, cold and
warm. Extra launcher flags after ``--``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHES = {
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "fa4",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "CUDA_CACHE_PATH": "cuda",
}
"""Environment variable -> the run's folder for that cache (under the mode's cache root)."""

MODES = {"tree": "--tree-training", "flat": "--no-tree-training"}


def cache_env(root: Path) -> dict[str, str]:
    """The environment of a launcher run whose kernel caches all live under ``root`` (FA4's persistent cache on)."""
    env = dict(os.environ, FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1", PYTHONUNBUFFERED="1")
    env.update({var: str(root / name) for var, name in CACHES.items()})
    return env


def folder_mb(root: Path) -> float:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 2**20


def run_launcher(config: str, mode: str, steps: int, root: Path, log: Path, extra: list[str]) -> dict:
    """One launcher process on the caches under ``root``; its steps' seconds from ``--log-jsonl``."""
    cmd = [sys.executable, "-m", "megatron_tree.train", "--config", config, "--steps", str(steps), MODES[mode],
           "--no-progress", "--log-jsonl", str(log), *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=cache_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, first_done = [], None
    for line in proc.stdout:  # the console's first "iteration" line: the first step has ended
        lines.append(line)
        if first_done is None and line.lstrip().startswith("iteration"):
            first_done = time.perf_counter() - start
    wall = time.perf_counter() - start
    if proc.wait():
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{''.join(lines)[-3000:]}")
    steps_s = [json.loads(line)["step_s"] for line in log.read_text().splitlines() if '"step_s"' in line]
    warmup = [line.strip() for line in lines if "FA4 kernel" in line]
    return dict(first_step_s=steps_s[0], later_step_s=statistics.median(steps_s[1:]) if len(steps_s) > 1 else None,
                steps_s=steps_s, to_first_step_end_s=first_done, wall_s=wall, cache_mb=round(folder_mb(root), 1),
                warmup=warmup[0] if warmup else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="launcher YAML config (the job to start)")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first, then the later ones' median)")
    ap.add_argument("--modes", default="tree,flat", help="which of tree,flat to run (each cold, then warm)")
    ap.add_argument("--out", required=True, help="JSON file")
    ap.add_argument("extra", nargs="*", help="more launcher flags (after --)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or args.steps < 1:
        ap.error(f"--modes takes a comma list of {sorted(MODES)} and --steps at least 1")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result: dict = dict(config=args.config, steps=args.steps, extra=args.extra, runs={})
    with tempfile.TemporaryDirectory(prefix="startup_bench_") as tmp:
        for mode in modes:
            root = Path(tmp) / mode
            for run in ("cold", "warm"):
                row = run_launcher(args.config, mode, args.steps, root, Path(tmp) / f"{mode}_{run}.jsonl", args.extra)
                result["runs"][f"{mode}_{run}"] = row
                print(f"{mode:4s} {run}: first step {row['first_step_s']:.2f} s (ended {row['to_first_step_end_s']:.1f} s "
                      f"after launch), later "
                      f"{row['later_step_s'] if row['later_step_s'] is None else round(row['later_step_s'], 2)} s, "
                      f"process {row['wall_s']:.1f} s, caches {row['cache_mb']} MB"
                      + (f"; {row['warmup']}" if row["warmup"] else ""), flush=True)
                Path(args.out).write_text(json.dumps(result, indent=1))
    if len(modes) == 2:
        runs = result["runs"]
        for key, label in (("first_step", "first step"), ("to_first_step_end", "launch to the first step's end")):
            gap = {run: runs[f"tree_{run}"][f"{key}_s"] - runs[f"flat_{run}"][f"{key}_s"] for run in ("cold", "warm")}
            result[f"{key}_gap_s"] = gap
            print(f"{label}, tree - flat: " + ", ".join(f"{k} {v:+.2f} s" for k, v in gap.items()))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

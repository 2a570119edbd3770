"""Where a whole PPO step's time goes, pass by pass: the launcher's step, tree vs flat, each model pass profiled.

The launcher times every pass of a PPO step (its records' ``pass_*_s``: old and reference log-probs, critic values,
reward scores, the actor's and the critic's forward + backward). This runs the same :class:`Trainer` on a config
(``--warmup`` steps first: compilation, caches), then one more step in which each pass runs under
``torch.profiler`` (:func:`step_profile.profile_step`): device busy vs idle time, kernel time by category, the host
ops the device waited on. Tree then flat (``--no-tree-training``), one process each, same config and data.

    python benchmarks/ppo_profile.py --config configs/ppo_qwen3_0.6b_shape.yaml \
        --out benchmarks/results/te/ppo_profile.json

JSON: per mode every step's record (``steps``, the last one the profiled step) and per pass the breakdown
(``passes``: ``wall_ms``, ``busy_ms``, ``kernels_ms``, ``idle_by_host_op``, ...; the profiler's host overhead widens
every gap alike, so read idle time relatively). Printed: per pass wall / busy / idle ms, tree and flat, and the rest of
the step (``step_s`` less its passes: packing, GAE, the optimizers, the records; median of the unprofiled steps after
the first). Needs a CUDA GPU (on CPU it runs, and profiles CPU ops: a smoke test of the harness).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import profile_step  # noqa: E402

PASSES = ("old", "reference", "values", "scores", "actor", "critic")
MODES = {"tree": "--tree-training", "flat": "--no-tree-training"}


def profile_mode(config: str, mode: str, warmup: int, extra: list[str]) -> dict:
    """In this process: ``warmup`` launcher steps of ``config`` in ``mode``, then one step with every pass profiled."""
    from megatron_tree.train import ppo
    from megatron_tree.train.__main__ import build_parser, config_from_args, persistent_kernel_cache
    from megatron_tree.train.trainer import Trainer

    persistent_kernel_cache()  # as the launcher: FA4's compiled kernels kept across runs

    args = build_parser().parse_args(["--config", config, "--steps", str(warmup + 1), MODES[mode], "--no-progress",
                                      *extra])  # fmt: skip
    cfg = config_from_args(args)
    if cfg.train.loss != "ppo":
        raise SystemExit(f"{config}: train.loss is {cfg.train.loss!r}; this profiles the passes of a ppo step")
    trainer = Trainer(cfg, config_source=config)
    passes: dict[str, dict] = {}
    steps: list[dict] = []
    timed = ppo.timed

    def profiled(times, name, device, fn):  # ppo.timed's signature; the pass runs under the profiler
        out = []
        passes[name] = profile_step(lambda: out.append(timed(times, name, device, fn)))
        return out[0]

    try:
        for step in range(warmup + 1):
            if step == warmup:
                ppo.timed = profiled
            steps += trainer.train_batch(trainer.source.next_batch())
    finally:
        ppo.timed = timed
        trainer.close()
    missing = [p for p in PASSES if p not in passes]
    if missing:
        raise SystemExit(f"passes {missing} were not run in the profiled step (ppo.timed names: {sorted(passes)})")
    return dict(steps=steps, passes=passes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="launcher YAML config with train.loss: ppo")
    ap.add_argument("--warmup", type=int, default=2, help="unprofiled steps before the profiled one")
    ap.add_argument("--modes", default="tree,flat", help="which of tree,flat to run")
    ap.add_argument("--out", required=True, help="JSON file")
    ap.add_argument("--mode-only", choices=sorted(MODES), help=argparse.SUPPRESS)  # one mode, this process
    ap.add_argument("extra", nargs="*", help="more launcher flags (after --)")
    args = ap.parse_args()
    if args.mode_only:
        result = profile_mode(args.config, args.mode_only, args.warmup, args.extra)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        return
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or args.warmup < 0:
        ap.error(f"--modes takes a comma list of {sorted(MODES)} and --warmup at least 0")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = dict(config=args.config, warmup=args.warmup, extra=args.extra, modes={})
    for mode in modes:  # one process per mode: nothing compiled or allocated by one is seen by the other
        part = out.with_suffix(f".{mode}.json")
        subprocess.run([sys.executable, __file__, "--config", args.config, "--warmup", str(args.warmup), "--out",
                        str(part), "--mode-only", mode, "--", *args.extra], check=True)  # fmt: skip
        result["modes"][mode] = json.loads(part.read_text())
        part.unlink()
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"{'pass':<10}" + "".join(f"{m + ' wall / busy / idle ms':>34}" for m in modes))
    for name in PASSES:
        cells = []
        for mode in modes:
            p = result["modes"][mode]["passes"][name]
            cells.append(f"{p['wall_ms']:10.1f} {p['busy_ms']:10.1f} {p['wall_ms'] - p['busy_ms']:10.1f}")
        print(f"{name:<10}" + "".join(f"{c:>34}" for c in cells))
    for mode in modes:  # the unprofiled steps after the first: the step outside its model passes
        later = result["modes"][mode]["steps"][1:-1]
        if later:
            rest = statistics.median(r["step_s"] - sum(r[f"pass_{p}_s"] for p in PASSES) for r in later)
            print(f"{mode}: rest of the step (packing, GAE, optimizers, records), median of {len(later)} unprofiled "
                  f"step(s): {rest * 1e3:.1f} ms")
    for mode in modes:
        for name in PASSES:
            idle = result["modes"][mode]["passes"][name].get("idle_by_host_op", {}).get("outermost", {})
            if idle:
                top = ", ".join(f"{op} {ms:.1f}" for op, ms in list(idle.items())[:3])
                print(f"{mode} {name}: idle by outermost host op (ms): {top}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Where a step's spread comes from, from ``e2e_bench.py`` JSON files run with ``--profile-steps`` > 1.

    python benchmarks/step_spread.py benchmarks/results/te/e2e_moe_multi_turn_mb32k_spread*_h100.json

Per file, workload and mode: the timed steps (ms) and their spread ((max - min) / median), the caching allocator's
``cudaMalloc`` calls and retries per timed step, and per profiled step its wall, device-busy and summed kernel time
(ms) with the spread of each over the profiled steps. A kernel sum that spreads like the wall time puts the spread
on the device (clocks, the experts' token counts); a stable kernel sum with a spreading idle time (wall - busy)
puts it on the host.
"""

from __future__ import annotations

import argparse
import json
import statistics


def spread(values: list[float]) -> float:
    """(max - min) / median; 0 where the median is 0 (no kernels on the CPU)."""
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else 0.0


def report(path: str) -> list[str]:
    """The lines :func:`main` prints for one JSON file."""
    result = json.load(open(path))
    lines = [f"{path} ({result['device']}, grouped GEMM {result.get('grouped_gemm')})"]
    for row in result["rows"]:
        for mode in ("flat", "tree"):
            if mode not in row:
                continue
            m = row[mode]
            times = [t * 1e3 for t in m["step_times"]]
            lines.append(f"  {row['workload']} {mode}: steps {[round(t) for t in times]} ms, spread {spread(times):.3f}; "
                         f"cudaMalloc per step {m.get('cuda_mallocs')}, retries {m.get('alloc_retries')}")
            profiled = m.get("profiled_steps")
            if profiled:
                columns = {key: [p[key] for p in profiled] for key in ("wall_ms", "busy_ms", "kernel_ms")}
                columns["idle_ms"] = [p["wall_ms"] - p["busy_ms"] for p in profiled]
                lines.append("    profiled: " + "; ".join(
                    f"{key[:-3]} {[round(v) for v in vals]} spread {spread(vals):.3f}" for key, vals in columns.items()))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    for path in ap.parse_args().files:
        try:
            lines = report(path)
        except (OSError, ValueError, KeyError) as exc:  # ValueError: not JSON; KeyError: not e2e_bench.py's
            raise SystemExit(f"step_spread: {path}: {type(exc).__name__}: {exc} (an e2e_bench.py --out JSON file?)")
        print("\n".join(lines))


if __name__ == "__main__":
    main()

"""benchmarks/ppo_flops.py: a PPO config's FLOP ideal and a run's model TFLOP/s from its records, on the CPU."""

import json

from dist_utils import run_python


def test_ppo_flops_reads_a_run_and_refuses_a_non_ppo_config(tmp_path):
    records = tmp_path / "tree.jsonl"
    records.write_text("".join(json.dumps({"step": i, "step_s": s}) + "\n" for i, s in enumerate((9.0, 2.0, 2.2), 1)))
    proc = run_python("benchmarks/ppo_flops.py", ["--config", "configs/ppo_qwen3_0.6b_shape.yaml",
                                                  "--tree-forward-max-tokens-per-mb", "65536", "--tree-jsonl", records])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    tree, flat = (json.loads(line.split(" ", 1)[1]) for line in lines[-3:-1])
    assert tree["forward_micro_batches"] == 1 and tree["micro_batches"] < flat["micro_batches"]
    assert tree["step_s"] == 2.1 and tree["tflops_per_s"] == tree["flops"] / 2.1 / 1e12  # median after the first
    ideal = flat["flops"] / tree["flops"]
    assert 2 < ideal < 3 and lines[-1] == f"FLOP ideal {ideal:.2f}x"
    sft = run_python("benchmarks/ppo_flops.py", ["--config", "configs/tiny_qwen3.yaml"])
    assert sft.returncode != 0 and "train.loss is 'sft'" in sft.stderr


def test_ppo_records_summary(tmp_path):
    """benchmarks/ppo_records.py: medians after the first step, the FLOP ideal from the last records' model FLOPs,
    each pass's median; records without model FLOPs say so; fewer than 2 steps is an error."""
    passes = ("old", "reference", "values", "scores", "actor", "critic")

    def write(name, step_times, tflops):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"step": i, "step_s": s, "micro_batches": 2, "tflops_per_gpu": tflops,
                                            **{f"pass_{p}_s": s / 10 for p in passes}}) + "\n"
                                for i, s in enumerate(step_times, 1)))
        return path

    # tree: 1 TFLOP per step at 2 s; flat: 3 TFLOP per step at 4 s -> ideal 3x, measured 2x, achieved 0.67
    tree, flat = write("tree", (9.0, 2.0, 2.0), 0.5), write("flat", (7.0, 4.0, 4.0), 0.75)
    proc = run_python("benchmarks/ppo_records.py", [tree, flat])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "model TFLOP/s tree 0, flat 1; FLOP ideal 3.00x, achieved 0.67"
    assert lines[1].startswith("PPO step median after the first: tree 2.00 s, flat 4.00 s, flat/tree 2.00")
    assert "old 0.200 / 0.400 (2.00x)" in lines[2]
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({"step": i, "step_s": 1.0, "micro_batches": 1,
                                       **{f"pass_{p}_s": 0.1 for p in passes}}) + "\n" for i in (1, 2)))
    proc = run_python("benchmarks/ppo_records.py", [old, old])
    assert proc.returncode == 0 and proc.stdout.startswith("no tflops_per_gpu in these records"), proc.stderr[-3000:]
    short = write("short", (9.0,), 0.5)
    proc = run_python("benchmarks/ppo_records.py", [short, flat])
    assert proc.returncode != 0 and "1 step record(s)" in proc.stderr

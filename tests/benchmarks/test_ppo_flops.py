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

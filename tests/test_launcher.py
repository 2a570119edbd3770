"""The launcher (megatron_tree.train) runs end to end on CPU; its config is validated with clear errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from dist_utils import REPO_ROOT, run_torchrun
from megatron_tree.train.config import RunConfig

LAUNCHER = REPO_ROOT / "examples" / "train_tree.py"


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_launcher_trains_and_loss_goes_down(tmp_path):
    out = tmp_path / "run.jsonl"
    subprocess.run(
        [sys.executable, str(LAUNCHER), "--config", "configs/tiny_qwen3.yaml", "--steps", "4", "--no-progress",
         "--log-jsonl", str(out)],
        cwd=REPO_ROOT, check=True, capture_output=True, timeout=600,
    )
    recs = records(out)
    assert len(recs) == 4
    losses = [r["loss"] for r in recs]
    assert losses[-1] < losses[0] - 0.3, losses
    assert 0 < recs[0]["tree_token_ratio"] < 0.8  # GRPO batch: prefixes are shared


def test_launcher_dp2_balances_ranks(tmp_path):
    out = tmp_path / "run.jsonl"
    run_torchrun(LAUNCHER, 2, ["--config", "configs/tiny_qwen3.yaml", "--steps", "2", "--no-progress",
                               "--log-jsonl", str(out)], timeout=600)
    for rec in records(out):
        a, b = rec["dp_micro_batches"]
        assert a == b, rec
        assert rec["dp_tree_token_imbalance"] < 1.2, rec


@pytest.mark.parametrize(
    "config, args",
    [("tiny_qwen3.yaml", ["--tp", "2", "--pp", "2"]), ("tiny_qwen3_moe.yaml", ["--ep", "2", "--pp", "2"])],
    ids=["tp2xpp2", "ep2xpp2-moe"],
)
def test_launcher_four_processes(tmp_path, config, args):
    """The four-GPU job's code path (TP x PP, EP x PP MoE), scaled down to 4 gloo processes."""
    out = tmp_path / "run.jsonl"
    run_torchrun(LAUNCHER, 4, ["--config", f"configs/{config}", "--steps", "2", "--no-progress",
                               "--log-jsonl", str(out), *args], timeout=600)
    recs = records(out)
    assert len(recs) == 2 and all(np.isfinite(r["loss"]) for r in recs)


def test_yaml_configs_load():
    for name in ("tiny_qwen3.yaml", "tiny_qwen3_4layers.yaml", "tiny_qwen3_moe.yaml"):
        cfg = RunConfig.from_yaml(str(REPO_ROOT / "configs" / name))
        assert cfg.micro_batch.max_tokens_per_mb > 0


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"trainer": {}}, "unknown section(s) ['trainer']"),
        ({"train": {"stepz": 3}}, "train: unknown key(s) ['stepz']"),
        ({"train": {"recompute": "partial"}}, "train.recompute must be one of"),
        ({"train": {"tree_training": "yes"}}, "train.tree_training must be true or false"),
        ({"parallel": {"tp": 0}}, "parallel.tp must be an int >= 1"),
        ({"parallel": {"vpp": 2}}, "parallel.vpp must be null or an int >= 2 with pp >= 2"),
        ({"micro_batch": {"max_tokens_per_mb": -1}}, "max_tokens_per_mb must be a positive int"),
        ({"micro_batch": {"n_mbs": 2}}, "needs max_tokens_per_mb"),
        ({"model": {"arch": "gpt2"}}, "model.arch must be one of"),
        ({"data": {"prompt_len": [5, 2]}}, "data.prompt_len must be [lo, hi]"),
    ],
)
def test_bad_config_values_are_named(raw, message):
    with pytest.raises(ValueError) as e:
        RunConfig.from_dict(raw, source="cfg.yaml")
    assert message in str(e.value) and "cfg.yaml" in str(e.value)

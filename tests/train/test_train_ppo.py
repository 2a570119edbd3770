"""The launcher's PPO step (train.loss: ppo): GAE against a per-step loop, and the whole step
(old / reference log-probs, critic values, reward scores, GAE, actor and critic updates) with
tree packing on and off giving the same numbers."""

import json

import pytest
import torch

from megatron_tree.train.__main__ import main
from megatron_tree.train.ppo import gae


def test_gae_matches_loop():
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 5, 1]
    rewards = torch.randn(sum(lengths), generator=gen, dtype=torch.float64)
    values = torch.randn(sum(lengths), generator=gen, dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, lengths, gamma=gamma, lam=lam)
    want, start = [], 0
    for n in lengths:
        r, v = rewards[start : start + n].tolist(), values[start : start + n].tolist() + [0.0]
        running, seq = 0.0, []
        for t in reversed(range(n)):
            running = r[t] + gamma * v[t + 1] - v[t] + gamma * lam * running
            seq.append(running)
        want += seq[::-1]
        start += n
    assert adv.tolist() == pytest.approx(want, rel=1e-12)
    assert ret.tolist() == pytest.approx((torch.tensor(want, dtype=torch.float64) + values).tolist(), rel=1e-12)


def test_ppo_step_tree_equals_flat(tmp_path):
    runs = {}
    for mode in ("--tree-training", "--no-tree-training"):
        out = tmp_path / f"{mode}.jsonl"
        status = main(["--config", "configs/tiny_qwen3.yaml", "--loss", "ppo", "--steps", "2", "--batch-size", "2", "--no-progress",
                       "--log-jsonl", str(out), mode])  # fmt: skip
        assert status == 0
        runs[mode] = [json.loads(line) for line in out.read_text().splitlines()]
    tree, flat = runs["--tree-training"], runs["--no-tree-training"]
    assert tree[0]["tree_token_ratio"] < 0.8 and flat[0]["tree_token_ratio"] == 1.0
    for t, f in zip(tree, flat, strict=True):
        for key in ("loss", "grad_norm", "critic_loss", "critic_grad_norm", "score_mean"):
            assert t[key] == pytest.approx(f[key], rel=1e-5), (key, t[key], f[key])
        assert t["kl_mean"] == pytest.approx(f["kl_mean"], abs=1e-6)
    assert tree[1]["kl_mean"] != 0  # the second step's old policy moved away from the reference
    passes = [f"pass_{name}_s" for name in ("old", "reference", "values", "scores", "actor", "critic")]
    for record in tree + flat:  # every model pass timed, within the step
        assert all(record[key] > 0 for key in passes) and sum(record[key] for key in passes) < record["step_s"]

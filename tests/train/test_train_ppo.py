"""The launcher's PPO step (train.loss: ppo): GAE against a per-step loop, and the whole step
(old / reference log-probs, critic values, reward scores, GAE, actor and critic updates) with
tree packing on and off giving the same numbers."""

import json

import pytest
import torch

from megatron_tree.train.__main__ import main
from megatron_tree.train.ppo import discounted_suffix_sum, gae


def _gae_loop(rewards, values, lengths, gamma, lam):
    """GAE one step at a time in Python floats: the reference."""
    want, start = [], 0
    for n in lengths:
        r, v = rewards[start : start + n].tolist(), values[start : start + n].tolist() + [0.0]
        running, seq = 0.0, []
        for t in reversed(range(n)):
            running = r[t] + gamma * v[t + 1] - v[t] + gamma * lam * running
            seq.append(running)
        want += seq[::-1]
        start += n
    return torch.tensor(want, dtype=torch.float64)


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [64, 65, 1, 0, 4161, 130]], ids=["short", "blocks"])
@pytest.mark.parametrize("gamma, lam", [(0.9, 0.8), (1.0, 1.0), (1.0, 0.95), (0.0, 0.5), (0.5, 0.0)])
def test_gae_matches_loop(lengths, gamma, lam):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(sum(lengths), generator=gen, dtype=torch.float64)
    values = torch.randn(sum(lengths), generator=gen, dtype=torch.float64)
    adv, ret = gae(rewards, values, lengths, gamma=gamma, lam=lam)
    want = _gae_loop(rewards, values, lengths, gamma, lam)
    scale = want.abs().max()
    assert (adv - want).abs().max() <= 1e-12 * scale
    assert (ret - (want + values)).abs().max() <= 1e-12 * scale
    adv32, _ = gae(rewards.float(), values.float(), lengths, gamma=gamma, lam=lam)
    assert adv32.dtype == torch.float32 and (adv32.double() - want).abs().max() <= 1e-6 * scale


@pytest.mark.parametrize("discount", [0.0, 0.3, 0.97, 1.0])
@pytest.mark.parametrize("width, block", [(1, 4), (4, 4), (5, 4), (70, 4), (1000, 64)])
def test_discounted_suffix_sum_matches_the_recurrence(discount, width, block):
    """Blocks of 4 over 70 steps recurse three levels deep (18, 5, 2 blocks)."""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want, running = torch.zeros_like(x), torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(width)):
        running = x[:, t] + discount * running
        want[:, t] = running
    got = discounted_suffix_sum(x, discount, block)
    assert got.shape == x.shape and (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_gae_takes_a_few_dozen_ops_whatever_the_length():
    """One vector op per step was ~3 kernel launches per step of the longest trajectory on a GPU (29.5k ops for
    32 trajectories of up to 6k tokens); the blocked sum's op count does not grow with the length."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    for longest in (300, 6000):
        lengths = [longest, longest // 2, 7]
        with Count():
            gae(torch.randn(sum(lengths)), torch.randn(sum(lengths)), lengths, gamma=1.0, lam=0.95)
        assert Count.ops < 120, (longest, Count.ops)
        Count.ops = 0


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


@pytest.mark.parametrize("mode", ["--tree-training", "--no-tree-training"])
@pytest.mark.parametrize("loss", ["ppo", "grpo"])
def test_forward_passes_in_larger_micro_batches_train_the_same_steps(tmp_path, mode, loss):
    """``--forward-max-tokens-per-mb 4096``: the forward-only passes (PPO's four; GRPO's old log-probs with two
    updates per rollout batch) run in fewer micro-batches than the updates' 48 slots (whose trees run in chunks,
    or as split paths without tree training), and every step's numbers are those of one packing for all passes."""
    runs = {}
    for name, extra in (("same", []), ("larger", ["--forward-max-tokens-per-mb", "4096"])):
        out = tmp_path / f"{name}.jsonl"
        argv = ["--config", "configs/tiny_qwen3.yaml", "--loss", loss, "--steps", "2", "--batch-size", "2",
                "--max-tokens-per-mb", "48", "--no-progress", "--log-jsonl", str(out), mode, *extra]
        if loss == "grpo":
            argv += ["--ppo-epochs", "2"]
        assert main(argv) == 0
        runs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    same, larger = runs["same"], runs["larger"]
    assert same[0]["forward_micro_batches"] == same[0]["micro_batches"] > larger[0]["forward_micro_batches"] == 1
    assert "forward_micro_batches" not in larger[1] if loss == "grpo" else "forward_micro_batches" in larger[1]
    keys = ["loss", "grad_norm"] + (["critic_loss", "critic_grad_norm", "score_mean", "kl_mean"] if loss == "ppo" else [])
    for s, f in zip(same, larger, strict=True):
        assert s["micro_batches"] == f["micro_batches"]
        for key in keys:  # old log-probs of another packing differ by fp32 rounding (~1e-6): the ratio too
            assert f[key] == pytest.approx(s[key], rel=1e-5, abs=1e-6), (key, f[key], s[key])
    if loss == "grpo":
        assert abs(larger[1]["loss"] - larger[0]["loss"]) > 1e-6  # the old log-probs were used: ratio off 1


@pytest.mark.parametrize("argv, message", [
    (["--loss", "ppo", "--forward-max-tokens-per-mb", "128"],
     "train.forward_max_tokens_per_mb=128 is below micro_batch.max_tokens_per_mb=256"),
    (["--forward-max-tokens-per-mb", "4096"], "train.loss sft with 1 update(s) runs none: drop it"),
    (["--loss", "grpo", "--forward-max-tokens-per-mb", "4096"], "grpo with 1 update(s) runs none: drop it"),
    (["--loss", "ppo", "--forward-max-tokens-per-mb", "0"], "train.forward_max_tokens_per_mb (--forward-max-tokens-per-mb) must be null or an int >= 1, got 0"),
])
def test_bad_forward_micro_batches_are_refused(capsys, argv, message):
    assert main(["--config", "configs/tiny_qwen3.yaml", "--steps", "1", "--no-progress", *argv]) == 1
    assert message in capsys.readouterr().err

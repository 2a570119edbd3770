"""examples/rl_step.py (a whole RL step, docs/concepts.md): its GRPO step's gradient equals
running every sequence alone, in one process and over two data-parallel ranks (CPU, fp32)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

pytest.importorskip("mbridge")

import torch.distributed as dist  # noqa: E402
from dist_utils import run_torchrun  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from scripts.parity_common import build_model, flat_logprobs, param_grads, relative_grad_error  # noqa: E402
from scripts.rl_step_dp import MAX_TOKENS_PER_MB, load_example, main_grads, perturbed_rollout  # noqa: E402

from megatron_tree.ops.losses import ppo_clip_loss  # noqa: E402
from megatron_tree.runtime import (  # noqa: E402
    cpu_mode,
    destroy_distributed,
    init_cpu_distributed,
    save_tiny_hf_checkpoint,
)

TOL = 1e-5


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One example step in this process: its checkpoint, batch, record, gradient and log lines."""
    rl_step = load_example()
    logger, messages = logging.getLogger("megatron_tree.mcore.schedule"), _Messages()
    level = logger.level
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    created = not dist.is_initialized()
    try:
        with cpu_mode():
            init_cpu_distributed()
            path = save_tiny_hf_checkpoint("qwen3", tmp_path_factory.mktemp("rl_step") / "ckpt")
            bridge, model, optimizer = rl_step.build_policy(path, bf16=False, lr=1e-4)
            batch = perturbed_rollout(rl_step, model, bridge.hf_config.vocab_size)
            rec = rl_step.grpo_step(model, optimizer, batch, max_tokens_per_mb=MAX_TOKENS_PER_MB)
            yield dict(path=path, batch=batch, rec=rec, grads=main_grads(model), model=model, logs=messages.messages)
            if created:
                destroy_distributed()
    finally:
        logger.removeHandler(messages)
        logger.setLevel(level)


def _per_sequence_reference(path, batch):
    """Gradient and grad norm of the example's PPO loss, every sequence run alone through the upstream model."""
    flat = build_model(path, tree=False)[0].train()
    lp = flat_logprobs(flat, [s.tolist() for s in batch.sequences])
    lens = torch.tensor([len(s) - 1 for s in batch.sequences])
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).int()
    logprobs = torch.cat([lp[i] for i in range(len(batch.sequences))])
    loss, m = ppo_clip_loss(
        logprobs, torch.cat(batch.old_logprobs), batch.advantages.repeat_interleave(lens), cu,
        loss_mask=torch.cat(batch.loss_masks), reduction="sum",
    )
    (loss / m["normalizer"]).backward()
    grads = param_grads(flat)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    clipped = float(m["clip_fraction"])
    return grads, norm, clipped


def test_example_step_gradient_equals_per_sequence_runs(single):
    with cpu_mode():
        want, norm, clipped = _per_sequence_reference(single["path"], single["batch"])
    assert 0 < clipped < 1  # the perturbed old log-probs exercise both sides of the clip
    assert relative_grad_error(single["grads"], want) < TOL
    assert abs(single["rec"]["grad_norm"] - norm) / norm < TOL
    config = single["model"][0].config
    assert config.finalize_model_grads_func is finalize_model_grads  # set by tree_forward_backward, and said so
    assert any("finalize_model_grads_func was unset" in m for m in single["logs"])
    assert any("model parameters are torch.float32" in m for m in single["logs"])


@pytest.mark.multiprocess
def test_example_over_two_data_parallel_ranks(single, tmp_path):
    grads_file = tmp_path / "single.pt"
    torch.save(single["grads"], grads_file)
    out = run_torchrun("scripts/rl_step_dp.py", 2, [str(tmp_path), str(grads_file)], timeout=300)
    rows = re.findall(r"RLSTEP rank=(\d) sequences=(\d+)/(\d+) single_rel=(\S+) cross_rank=(\S+)", out)
    assert len(rows) == 2, out[-3000:]
    assert sum(int(k) for _, k, _, _, _ in rows) == int(rows[0][2])  # the ranks split the batch
    assert all(0 < int(k) < int(n) for _, k, n, _, _ in rows)
    for _, _, _, single_rel, cross in rows:
        assert float(single_rel) < TOL and float(cross) < TOL
    assert len(re.findall(r"step \d/2 \| loss \S+ \| grad norm \S+", out)) == 2, out[-3000:]

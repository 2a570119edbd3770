"""A GRPO training step with tree training in a Megatron job: the README's "Use it in your Megatron job".

    python examples/rl_step.py                               # CPU (or one GPU): a tiny random Qwen3, fp32
    torchrun --nproc-per-node 2 examples/rl_step.py          # data parallel 2 (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 8 examples/rl_step.py --hf-path /path/to/Qwen3-0.6B --bf16

Each step: a rollout batch (sequences, response masks, group-normalised advantages and the
sampling policy's log-probs, here from a forward-only tree pass standing in for the inference
engine), split over data-parallel ranks by tree cost, packed into tree micro-batches, one PPO
clipped loss through Megatron's schedule, Megatron's optimizer step. Gradients are divided by
the number of response tokens of the whole global batch and reduced over data-parallel ranks
(``tree_forward_backward`` sets ``finalize_model_grads`` on the DDP-wrapped model), so the step
equals running every sequence alone. Prints one line per step.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from mbridge import AutoBridge
from megatron.core import parallel_state as mpu
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_tree import (
    MicroBatchSpec, balance_across_ranks, cpu_mode, init_distributed, pack_trees, patch_bridge_for_tree_training,
    ppo_clip_loss, save_tiny_hf_checkpoint, tree_forward_backward, tree_training_overrides,
)


@dataclass
class Rollout:
    """One global batch (identical on every rank). n = sequences, L_i = len(sequences[i]).

    sequences     n int64 [L_i] token ids (prompt + response)
    loss_masks    n bool [L_i - 1], True where the next token is a response token
    advantages    fp32 [n], one per sequence (GRPO: reward normalised within its prompt group)
    old_logprobs  n fp32 [L_i - 1], log p(token t+1 | tokens <= t) under the sampling policy
    """

    sequences: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    advantages: torch.Tensor
    old_logprobs: list[torch.Tensor]


def build_policy(hf_path: str, *, bf16: bool, lr: float):
    """The policy as the README builds it: ``(bridge, model chunks, Megatron optimizer)``."""
    with patch_bridge_for_tree_training():  # tree attention + per-token RoPE baked into the model
        bridge = AutoBridge.from_pretrained(hf_path, dtype=torch.bfloat16 if bf16 else torch.float32)
        moe = bridge.config.num_moe_experts is not None
        bridge.set_extra_args(**tree_training_overrides(moe=moe))  # calculate_per_token_loss=True, no-TE/CPU fixes
        model = bridge.get_model(  # parameters bf16 (mbridge's default) or fp32: say which
            wrap_with_ddp=True, bf16=bf16, fp16=False,
            ddp_config=dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
        )
        bridge.load_weights(model, hf_path)
    # Only the objects built here carry patches now: bridge.export_weights / save_weights work any time.
    optimizer = get_megatron_optimizer(  # megatron-core's gradient clipping needs CUDA tensors
        OptimizerConfig(optimizer="adam", lr=lr, bf16=bf16, clip_grad=1.0 if torch.cuda.is_available() else 0.0),
        model,
    )
    return bridge, model, optimizer


def policy_logprobs(model, sequences: list[torch.Tensor], max_tokens_per_mb: int) -> list[torch.Tensor]:
    """Per-sequence log-probs [L_i - 1] of the current policy: a forward-only tree pass (fp32, on CPU)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)

    def keep(logprobs, mb):
        for k, i in enumerate(mb.sequence_ids):
            out[i] = logprobs[mb.cu_targets[k] : mb.cu_targets[k + 1]].detach().float().cpu()
        return logprobs.sum(), logprobs.numel()

    tree_forward_backward(model, pack_trees(sequences, MicroBatchSpec(max_tokens_per_mb=max_tokens_per_mb)), keep,
                          forward_only=True)
    return out


def synthetic_rollout(model, vocab: int, *, seed: int, max_tokens_per_mb: int, prompts: int = 3,
                      samples: int = 4) -> Rollout:
    """GRPO-shaped batch: ``prompts`` prompts x ``samples`` responses, reward = share of response
    tokens below vocab / 2, advantages normalised per prompt group."""
    rng = np.random.default_rng(seed)
    sequences, masks, rewards = [], [], []
    for _ in range(prompts):
        prompt = rng.integers(0, vocab, int(rng.integers(8, 24)))
        group = []
        for _ in range(samples):
            response = rng.integers(0, vocab, int(rng.integers(4, 16)))
            sequences.append(torch.from_numpy(np.concatenate([prompt, response])))
            masks.append(torch.arange(len(prompt) + len(response) - 1) >= len(prompt) - 1)
            group.append(float((response < vocab // 2).mean()))
        rewards.append((np.array(group) - np.mean(group)) / (np.std(group) + 1e-6))
    advantages = torch.tensor(np.concatenate(rewards), dtype=torch.float32)
    return Rollout(sequences, masks, advantages, policy_logprobs(model, sequences, max_tokens_per_mb))


def grpo_step(model, optimizer, batch: Rollout, *, max_tokens_per_mb: int) -> dict:
    """One optimizer step on ``batch``; returns the global ``loss`` (mean over response tokens),
    ``grad_norm`` and this rank's ``sequences``. After it, the DDP buffers (``param.main_grad``)
    hold the step's gradient (unclipped on CPU)."""
    # batch: this step's global rollout, the same on every rank (see Rollout)
    dp, dp_group = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_group()
    mine = balance_across_ranks(batch.sequences, dp)[mpu.get_data_parallel_rank()]  # whole prefix groups
    seqs = [batch.sequences[i] for i in mine]
    old_lp, masks = [batch.old_logprobs[i] for i in mine], [batch.loss_masks[i] for i in mine]
    adv = batch.advantages[mine]
    pp = mpu.get_pipeline_model_parallel_world_size()
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=max_tokens_per_mb, n_mbs_divisor=pp),
                     dp_group=dp_group)  # same micro-batch count on every DP rank

    def loss_fn(logprobs, mb):  # logprobs [N]: every sequence's L_i - 1 next-token log-probs, mb.sequence_ids order
        ids, dev = mb.sequence_ids, logprobs.device  # ids index seqs
        if not ids:  # a padding micro-batch (a DP rank with fewer trees): nothing to learn
            return logprobs.sum(), 0
        per_token = adv[ids].to(dev).repeat_interleave(mb.cu_targets.diff().long(), output_size=logprobs.numel())
        loss, m = ppo_clip_loss(logprobs, torch.cat([old_lp[i] for i in ids]).to(dev), per_token, mb.cu_targets,
                                loss_mask=torch.cat([masks[i] for i in ids]).to(dev), reduction="sum")
        return loss, m["normalizer"]  # (sum, count): Megatron divides by the count of the global batch

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = tree_forward_backward(model, mbs, loss_fn)  # Megatron's schedule: PP, VPP, TP, EP, DP, recompute
    _, grad_norm, _ = optimizer.step()
    total = torch.zeros(2, device=next(model[0].parameters()).device)
    for d in losses:  # one per micro-batch: [loss sum, response tokens]
        total += d["loss"]
    dist.all_reduce(total, group=dp_group)  # of the global batch
    return dict(loss=float(total[0] / total[1]), grad_norm=float(grad_norm), sequences=len(seqs))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-path", help="HF checkpoint (default: a tiny random Qwen3 written to a temp dir)")
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters (default fp32)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-tokens-per-mb", type=int, default=64)
    args = ap.parse_args(argv)
    if args.bf16 and not torch.cuda.is_available():
        ap.error("--bf16 needs a CUDA GPU (megatron-core's bf16 optimizer takes CUDA tensors only); drop --bf16 on CPU")
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("megatron_tree").setLevel(logging.INFO)  # the params dtype, the gradient finalisation
    records = []
    with cpu_mode():  # CPU only: megatron-core's CUDA calls mapped to the CPU; a no-op on GPUs
        init_distributed(seed=1234)  # data parallel over all processes: gloo on CPU, NCCL on GPUs
        path = args.hf_path or save_tiny_hf_checkpoint("qwen3", os.path.join(tempfile.gettempdir(), "rl_step_qwen3"))
        bridge, model, optimizer = build_policy(path, bf16=args.bf16, lr=args.lr)
        for step in range(args.steps):
            batch = synthetic_rollout(model, bridge.hf_config.vocab_size, seed=step,
                                      max_tokens_per_mb=args.max_tokens_per_mb)
            rec = grpo_step(model, optimizer, batch, max_tokens_per_mb=args.max_tokens_per_mb)
            records.append(rec)
            if dist.get_rank() == 0:
                print(f"step {step + 1}/{args.steps} | loss {rec['loss']:.6f} | grad norm {rec['grad_norm']:.4f} | "
                      f"sequences on rank 0 {rec['sequences']}/{len(batch.sequences)}", flush=True)
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()

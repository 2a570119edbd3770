"""Megatron pretrain-style tree-training launcher (CPU over gloo by default, GPUs over NCCL).

    python examples/train_tree.py --config configs/tiny_qwen3.yaml                 # one CPU process
    torchrun --nproc-per-node 2 examples/train_tree.py --config configs/tiny_qwen3.yaml --tp 2
    torchrun --nproc-per-node 4 examples/train_tree.py --config configs/tiny_qwen3.yaml --pp 2 --vpp 2

Each step: draw a synthetic rollout batch (same on every rank), split it over
data-parallel ranks by tree cost (``balance_across_ranks``), pack each rank's share into
tree micro-batches (``pack_trees``; ``--no-tree-training`` packs the same sequences flat,
each its own chain), run Megatron's ``forward_backward_func`` with the tree loss, step
Megatron's optimizer. Logs per step: loss, tokens/s (original tokens), tree_token_ratio,
micro-batch balance, DP rank balance. ``--out-json`` writes the per-step records.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_tree import BalanceStats, MicroBatchSpec, PackingStats, balance_across_ranks, pack_trees
from megatron_tree.losses import ppo_clip_loss, sft_loss
from megatron_tree.run_config import RunConfig
from megatron_tree.synthetic import grpo_batch, multi_turn_batch


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny_qwen3.yaml", help="YAML run config (configs/)")
    ap.add_argument("--hf-path", help="HF checkpoint to load (overrides model.arch)")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--pp", type=int)
    ap.add_argument("--vpp", type=int)
    ap.add_argument("--ep", type=int)
    ap.add_argument("--tree-training", dest="tree_training", action="store_true", default=None)
    ap.add_argument("--no-tree-training", dest="tree_training", action="store_false")
    ap.add_argument("--max-tokens-per-mb", type=int)
    ap.add_argument("--packing-algorithm", choices=["ffd", "kk"])
    ap.add_argument("--recompute", choices=["none", "full", "selective"])
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--bf16", action="store_true", default=None)
    ap.add_argument("--loss", choices=["sft", "grpo"])
    ap.add_argument("--out-json", help="write per-step records here (rank 0)")
    ap.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    ap.add_argument("--verify-tree-model", action="store_true",
                    help="at start-up, check that the model's tree log-probs equal its per-sequence ones "
                         "(megatron_tree.verify_tree_model) and log the error seen")
    return ap.parse_args(argv)


def load_config(args) -> RunConfig:
    cfg = RunConfig.from_yaml(args.config)
    for key in ("tp", "pp", "vpp", "ep"):
        if getattr(args, key) is not None:
            setattr(cfg.parallel, key, getattr(args, key))
    for key in ("tree_training", "recompute", "steps", "lr", "bf16", "loss"):
        if getattr(args, key) is not None:
            setattr(cfg.train, key, getattr(args, key))
    if args.hf_path:
        cfg.model.hf_path = args.hf_path
    overrides = {}
    if args.max_tokens_per_mb is not None:
        overrides["max_tokens_per_mb"] = args.max_tokens_per_mb
    if args.packing_algorithm is not None:
        overrides["packing_algorithm"] = args.packing_algorithm
    cfg.micro_batch = MicroBatchSpec.new(cfg.micro_batch, **overrides)
    cfg.validate("command line")
    return cfg


def init_distributed(cfg: RunConfig, cuda: bool) -> None:
    from megatron.core import parallel_state, tensor_parallel

    from megatron_tree.testing import init_cpu_distributed

    p = cfg.parallel
    if not cuda:
        init_cpu_distributed(tp=p.tp, pp=p.pp, ep=p.ep, vpp=p.vpp, seed=cfg.train.seed + 1)
        return
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("nccl")
        else:
            port = os.environ.get("MASTER_PORT", "29511")
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        expert_model_parallel_size=p.ep,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed + 1)


def model_path(cfg: RunConfig) -> tuple[str, bool]:
    """(HF directory, whether to load its weights). Without ``hf_path``, rank 0 writes a
    random HF checkpoint of ``model.arch`` (only its config with ``random_init``) to a
    directory every rank derives alike."""
    from megatron_tree.testing import save_hf_config, save_tiny_hf_checkpoint

    m = cfg.model
    if m.hf_path:
        return m.hf_path, True
    key = hashlib.sha1(json.dumps([m.arch, m.hf_overrides, m.random_init], sort_keys=True).encode()).hexdigest()[:10]
    path = os.path.join(tempfile.gettempdir(), f"megatron_tree_{m.arch}_{key}")
    if m.random_init:
        return save_hf_config(m.arch, path, **m.hf_overrides), False
    return save_tiny_hf_checkpoint(m.arch, path, seed=cfg.train.seed, **m.hf_overrides), True


def build_model(cfg: RunConfig, path: str, load: bool, cuda: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_tree.bridge import build_tree_model

    # Tree attention also runs the flat baseline (each sequence its own chain), so both
    # modes use the same kernels; only the packing differs.
    bridge, model = build_tree_model(
        path, backend=cfg.train.attention_backend, bf16=cfg.train.bf16, recompute=cfg.train.recompute,
        load_weights=load, wrap_with_ddp=True,
        ddp_config=dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
    )
    # megatron-core's gradient clipping asserts CUDA tensors: clip on GPUs only.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.train.lr, bf16=cfg.train.bf16, clip_grad=1.0 if cuda else 0.0,
                        use_distributed_optimizer=False),
        model,
    )
    return model, optimizer, bridge.hf_config


def rollout(cfg: RunConfig, step: int, vocab: int):
    """Synthetic batch of this step (identical on every rank) and per-sequence advantages."""
    d = cfg.data
    rng = np.random.default_rng(cfg.train.seed + (0 if d.same_batch_every_step else step))
    v = d.vocab or vocab
    if d.workload == "grpo":
        seqs = grpo_batch(rng, n_prompts=d.batch_size, samples=d.samples, prompt_len=d.prompt_len,
                          response_len=d.response_len, vocab=v)
    else:
        seqs = multi_turn_batch(rng, n_conversations=d.batch_size, turns=d.turns, turn_len=d.turn_len,
                                fork_prob=d.fork_prob, system_len=d.prompt_len[0], vocab=v)
    reward = np.array([float((s < v // 2).mean()) for s in seqs])
    advantages = (reward - reward.mean()) / (reward.std() + 1e-6)
    return seqs, advantages


def make_loss_fn(cfg: RunConfig, advantages: torch.Tensor):
    """``loss_fn(logprobs, mb) -> (loss_sum, count)`` with per-token normalisation."""

    def loss_fn(logprobs, mb):
        if cfg.train.loss == "sft":
            loss, metrics = sft_loss(logprobs, mb.cu_seqlens, reduction="sum")
        else:
            adv = advantages.to(logprobs.device)[mb.sequence_ids]
            per_token = adv.repeat_interleave(mb.cu_seqlens.diff().long(), output_size=logprobs.numel())
            loss, metrics = ppo_clip_loss(logprobs, logprobs.detach(), per_token, mb.cu_seqlens, reduction="sum")
        return loss, metrics["normalizer"]

    return loss_fn


def main(argv=None):
    args = parse_args(argv)
    cfg = load_config(args)
    cuda = torch.cuda.is_available()
    from megatron.core import parallel_state as ps

    from megatron_tree.model_check import check_tree_model
    from megatron_tree.schedule import tree_forward_backward
    from megatron_tree.verify import verify_tree_model
    from megatron_tree.patches import apply_compat_patches
    from megatron_tree.testing import cpu_mode

    # cpu_mode is a no-op on GPUs; the compat patches stay open for the whole run because
    # some are needed at run time (MoE on megatron-core 0.16.1 without Transformer Engine).
    with apply_compat_patches(), cpu_mode():
        init_distributed(cfg, cuda)
        rank = dist.get_rank()
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        dp_group = ps.get_data_parallel_group()
        path, load = model_path(cfg)
        model, optimizer, hf_config = build_model(cfg, path, load, cuda)
        check_tree_model(model)  # tree attention and per-token RoPE in every chunk, or one clear error
        if args.verify_tree_model:
            report = verify_tree_model(model)  # raises when the tree path is not exact
            if rank == 0:
                print(f"verify_tree_model: {report}", flush=True)
        vocab = hf_config.vocab_size
        divisor = (model[0].config.microbatch_group_size_per_vp_stage or cfg.parallel.pp) if cfg.parallel.vpp else 1
        spec = MicroBatchSpec.new(cfg.micro_batch, n_mbs_divisor=max(cfg.micro_batch.n_mbs_divisor, divisor),
                                  n_mbs=max(cfg.micro_batch.n_mbs, divisor))
        records = []
        show = rank == 0 and not args.no_progress
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=cfg.train.steps, desc="tree" if cfg.train.tree_training else "flat", file=sys.stdout)
        for step in range(cfg.train.steps):
            seqs, adv = rollout(cfg, step, vocab)
            shares = balance_across_ranks(seqs, dp, algorithm=cfg.train.balance) if dp > 1 else [np.arange(len(seqs))]
            mine = shares[dp_rank]
            local = [seqs[i] for i in mine]
            t0 = time.perf_counter()
            mbs = pack_trees(local, spec, dp_group=dp_group if dp > 1 else None,
                             share_prefixes=cfg.train.tree_training)
            pack_s = time.perf_counter() - t0
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            losses = tree_forward_backward(model, mbs, make_loss_fn(cfg, torch.as_tensor(adv[mine])))
            ok, grad_norm, _ = optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
            rec = step_record(step, losses, mbs, spec, seqs, shares, step_s, pack_s, grad_norm, cuda)
            records.append(rec)
            if rank == 0:
                line = (
                    f" iteration {step + 1:4d}/{cfg.train.steps} | loss {rec['loss']:.5f} | grad norm "
                    f"{rec['grad_norm']:.4f} | tokens/s {rec['tokens_per_s']:.0f} | tree_token_ratio "
                    f"{rec['tree_token_ratio']:.3f} | micro-batches {rec['micro_batches']} | mb imbalance "
                    f"{rec['mb_imbalance']:.3f} | dp tree-token imbalance {rec['dp_tree_token_imbalance']:.3f}"
                )
                bar.write(line) if show else print(line, flush=True)
            if show:
                bar.update(1)
        if bar is not None:
            bar.close()
        if rank == 0 and args.out_json:
            with open(args.out_json, "w") as f:
                json.dump({"config": args.config, "records": records}, f, indent=1)
        dist.barrier()
        from megatron_tree.testing import destroy_cpu_distributed

        destroy_cpu_distributed()
    return records


def step_record(step, losses, mbs, spec, seqs, shares, step_s, pack_s, grad_norm, cuda) -> dict:
    """Global (all-rank) step metrics; the loss is summed on the last pipeline stage, then
    shared over the whole world so every rank reports the same value."""
    device = "cuda" if cuda else "cpu"
    num = torch.zeros(2, dtype=torch.float64, device=device)
    for item in losses:
        num += item["loss"].to(num)
    stats = PackingStats.of(mbs, spec.max_tokens_per_mb)
    tokens = torch.tensor([stats.original_tokens, stats.tree_tokens], dtype=torch.float64, device=device)
    from megatron.core import parallel_state as ps

    dist.all_reduce(num)  # only last-stage ranks of each DP replica contribute, once per TP rank
    tp = ps.get_tensor_model_parallel_world_size()
    num /= tp
    per_rank = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(ps.get_data_parallel_world_size())]
    dist.all_gather(per_rank, torch.tensor([len(mbs), stats.tree_tokens], dtype=torch.float64, device=device),
                    group=ps.get_data_parallel_group())
    dist.all_reduce(tokens, group=ps.get_data_parallel_group())
    original, tree = tokens.tolist()
    rank_tokens = [sum(len(seqs[i]) for i in idx) for idx in shares]
    return dict(
        step=step,
        loss=float(num[0] / num[1].clamp(min=1)),
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        step_s=step_s,
        pack_s=pack_s,
        tokens_per_s=original / step_s,
        original_tokens=int(original),
        tree_tokens=int(tree),
        tree_token_ratio=tree / original,
        micro_batches=len(mbs),
        mb_imbalance=stats.balance.imbalance,
        mb_utilisation=stats.balance.utilisation,
        dp_token_imbalance=BalanceStats.of(rank_tokens).imbalance,
        dp_micro_batches=[int(r[0]) for r in per_rank],
        dp_tree_tokens=[int(r[1]) for r in per_rank],
        dp_tree_token_imbalance=BalanceStats.of([float(r[1]) for r in per_rank]).imbalance,
    )


if __name__ == "__main__":
    main()

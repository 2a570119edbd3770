"""The training loop of the launcher: Megatron's forward_backward_func and optimizer on tree micro-batches.

Per rollout batch (same on every rank): split its groups into ``train.ppo_mini_batches``
mini-batches of whole groups; per mini-batch, split it over data-parallel ranks by tree cost
(``balance_across_ranks``), pack each rank's share into tree micro-batches (``pack_trees``;
``tree_training=False`` packs the same sequences flat, each its own chain) and compute the old
log-probs (PPO: every forward-only pass) before the first update; then ``train.ppo_epochs`` passes
over the mini-batches, each update (an iteration): ``tree_forward_backward`` with the configured loss, check that the loss and the gradients are
finite (else stop the run, or with ``train.skip_nonfinite`` skip the update), step Megatron's
optimizer, write the step's record to the sinks, save a checkpoint when due.

:class:`Trainer` holds what the run opened (process groups, patches, CPU mode, a temporary
model directory, sinks); :meth:`Trainer.close` releases all of it, also after an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import resource
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_tree import (
    BalanceStats,
    MicroBatchSpec,
    PackingStats,
    balance_across_ranks,
    pack_trees,
    pack_vision_trees,
)
from megatron_tree.core.flops import ModelFlops, packed_work
from megatron_tree.core.hf_config import attention_head_dim, attention_kv_heads
from megatron_tree.mcore.data_parallel import describe, sync_params
from megatron_tree.ops.losses import ppo_clip_loss, sft_loss
from megatron_tree.train import checkpoint, metrics
from megatron_tree.train.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from megatron_tree.train.data import RolloutBatch, open_rollout_source


def init_distributed(p: ParallelConfig, seed: int, cuda: bool) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPUs; joins torchrun's job when launched by it)
    and megatron-core's model-parallel groups of sizes ``p``, RNG tracker seeded with ``seed``."""
    from megatron_tree.runtime import init_distributed as init

    init(tp=p.tp, pp=p.pp, ep=p.ep, vpp=p.vpp, cp=p.cp, seed=seed, backend="nccl" if cuda else "gloo",
         timeout_minutes=p.distributed_timeout_minutes)


def check_layers(num_layers: int, pp: int, vpp: int | None) -> None:
    """ValueError unless ``num_layers`` splits evenly over ``pp`` stages of ``vpp`` chunks each."""
    chunks = pp * (vpp or 1)
    if num_layers % chunks:
        what = f"pp * vpp = {pp} * {vpp}" if vpp else f"pp = {pp}"
        raise ValueError(
            f"the model has num_hidden_layers={num_layers}, not divisible by {what}; lower --pp/--vpp or use a "
            f"model with a multiple of {chunks} layers (configs/tiny_qwen3_4layers.yaml has 4)"
        )


def check_expert_parallel(hf_config, ep: int, model: str) -> None:
    """ValueError when ``ep`` > 1 but ``hf_config`` (of ``model``, named in the message) has no experts."""
    experts = max((getattr(hf_config, key, None) or 0 for key in ("num_experts", "num_local_experts", "n_routed_experts")),
                  default=0)
    if ep > 1 and not experts:
        raise ValueError(f"parallel.ep (--ep) {ep} splits the experts of a MoE model over ranks, but {model} "
                         f"({hf_config.model_type}) is dense, without experts; pass --ep 1, or train a MoE model "
                         f"(configs/tiny_qwen3_moe.yaml)")


def uses_tree_model(cfg: RunConfig, cuda: bool) -> bool:
    """Whether the run builds a tree model: always, except for the flat baseline with Transformer
    Engine on GPUs, which runs the upstream model on THD-packed sequences (``flat_forward_backward``),
    unless context parallel is on (that path has none: the flat baseline then runs as chains through
    the tree model)."""
    from megatron_tree.core.platform import have_transformer_engine

    return cfg.train.tree_training or cfg.parallel.cp > 1 or not (cuda and have_transformer_engine())


def start_kernel_warmup(cfg: RunConfig, hf_config, cuda: bool):
    """Where the tree model may run FA4 (a GPU, bf16, backend ``auto`` or ``fa4``): FA4's warm-up for this model's
    attention shape per tensor-parallel rank in a background thread of this rank
    (:func:`megatron_tree.attention.fa4_warmup.start_fa4_warmup`, on the rank's current GPU), the query-slot
    mask's kernels too under context parallel; else None. The launcher starts it once the process groups exist
    (each rank on its GPU), before anything else, so it compiles while the models are built and their weights
    loaded."""
    from megatron_tree.attention.fa4_warmup import start_fa4_warmup

    if not (cuda and cfg.train.bf16 and cfg.train.attention_backend in ("auto", "fa4") and uses_tree_model(cfg, cuda)):
        return None
    tp = cfg.parallel.tp
    return start_fa4_warmup(hf_config.num_attention_heads // tp, max(1, attention_kv_heads(hf_config) // tp),
                            attention_head_dim(hf_config), query_slots=cfg.parallel.cp > 1)


def build_model(cfg: RunConfig, path: str, load: bool, cuda: bool):
    """``(model chunks, optimizer, bridge)``: tree model (wrapped in megatron-core's DDP as ``parallel`` says:
    distributed optimizer, overlapped communication) and Megatron's optimizer."""
    from megatron_tree.mcore.bridge import build_model as build_tree_or_flat

    # The flat baseline (tree_training=False): with Transformer Engine, Megatron's sequence packing
    # (the upstream model, THD segments through cuDNN attention); without it, the tree model's own
    # kernels on flat packing (each sequence its own chain).
    bridge, model = build_tree_or_flat(
        path, tree=uses_tree_model(cfg, cuda), backend=cfg.train.attention_backend, bf16=cfg.train.bf16, recompute=cfg.train.recompute,
        load_weights=load, wrap_with_ddp=True, ddp_config=make_ddp_config(cfg.parallel), **model_source_args(cfg),
    )
    return model, make_optimizer(cfg, model, cuda), bridge


def model_source_args(cfg: RunConfig) -> dict[str, Any]:
    """Keywords of :func:`~megatron_tree.mcore.bridge.build_tree_model` that ``cfg.model`` sets for every model of
    the run: ``trust_remote_code``, and ``extra_args`` without multi-token prediction layers (``skip_mtp_layers``)."""
    m = cfg.model
    return dict(trust_remote_code=m.trust_remote_code, extra_args={"mtp_num_layers": None} if m.skip_mtp_layers else None)


def make_ddp_config(p: ParallelConfig) -> dict[str, Any]:
    """Keywords of megatron-core's ``DistributedDataParallelConfig`` for the run's models (actor, critic)."""
    from megatron_tree.mcore.data_parallel import ddp_config

    return ddp_config(use_distributed_optimizer=p.use_distributed_optimizer, overlap_grad_reduce=p.overlap_grad_reduce,
                      overlap_param_gather=p.overlap_param_gather, bucket_size=p.ddp_bucket_size)


def make_optimizer(cfg: RunConfig, model: list[torch.nn.Module], cuda: bool):
    """megatron-core's optimizer over ``model`` as ``cfg.optimizer`` says (peak lr ``train.lr``; on the CPU the
    gradient clipping runs through ``runtime.cpu``'s shim), distributed over data-parallel ranks with
    ``parallel.use_distributed_optimizer`` (the DDP wrap must agree: checked)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_tree.mcore.data_parallel import check_optimizer_fits, configure_grad_sync

    o, distributed = cfg.optimizer, cfg.parallel.use_distributed_optimizer
    check_optimizer_fits(model, distributed)
    configure_grad_sync(model)
    return get_megatron_optimizer(
        OptimizerConfig(optimizer=o.optimizer, lr=cfg.train.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                        sgd_momentum=o.sgd_momentum, clip_grad=o.clip_grad, bf16=cfg.train.bf16,
                        use_distributed_optimizer=distributed),
        model,
    )


def make_scheduler(cfg: RunConfig, optimizer):
    """megatron-core's ``OptimizerParamScheduler`` of ``optimizer``: linear warmup from 0 over
    ``optimizer.lr_warmup_iters`` steps to ``train.lr``, then ``lr_decay_style`` to ``min_lr`` at
    ``lr_decay_iters`` (default ``train.steps``); constant weight decay. Stepped after every applied update;
    a checkpoint's schedule must equal the run's (refused otherwise, at load)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.optimizer
    # constant: no decay steps (any value past the warmup), so a run resumed with more train.steps keeps its schedule
    decay = o.lr_warmup_iters + 1 if o.lr_decay_style == "constant" else o.lr_decay_iters or cfg.train.steps
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.train.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_iters,
        lr_decay_steps=decay, lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
    )


def make_loss_fn(train: TrainConfig, batch: RolloutBatch, mine: np.ndarray, policy_old: torch.Tensor | None = None):
    """``loss_fn(logprobs [N], mb) -> (loss_sum, loss tokens)`` for this rank's share ``mine`` of
    ``batch`` (``mb.sequence_ids`` index ``mine``): token-normalised SFT or PPO-clip (+ k3 KL). The PPO ratio's
    old log-probs: the rollouts' ``old_logprobs``; where they have none, ``policy_old`` (fp32 [sum len - 1] at
    ``mine``'s targets: the policy's as the rollout batch's updates began), else the current policy's (ratio 1)."""
    target_lens = np.fromiter((len(batch.sequences[i]) - 1 for i in mine), np.int64, len(mine))
    offsets = np.concatenate([[0], np.cumsum(target_lens)])

    def targets(per_token: list[np.ndarray] | None) -> torch.Tensor | None:
        """A per-token field at this rank's targets: entries 1.. of each sequence, [sum len - 1]."""
        if per_token is None or not len(mine):
            return None
        return torch.from_numpy(np.concatenate([per_token[i][1:] for i in mine]))

    mask, old = targets(batch.loss_mask), targets(batch.old_logprobs)
    if policy_old is not None:
        old = policy_old if old is None else torch.where(torch.isnan(old), policy_old, old)
    ref = targets(batch.ref_logprobs) if train.kl_coef else None
    advantages = torch.from_numpy(batch.advantages[mine])

    def loss_fn(logprobs, mb):
        index = torch.from_numpy(mb.target_index(offsets))  # a chunk holds parts of sequences

        def at(t):  # non-blocking: a blocking copy to the GPU waits for the kernels queued before it
            return None if t is None else t[index].to(logprobs.device, non_blocking=True)

        loss_mask = at(mask)
        if train.loss == "sft":
            loss, m = sft_loss(logprobs, mb.cu_targets, loss_mask=loss_mask, reduction="sum")
            return loss, m["normalizer"]
        current, old_here = logprobs.detach(), at(old)
        old_lp = current if old_here is None else torch.where(torch.isnan(old_here), current, old_here)
        adv = advantages[mb.sequence_ids].to(logprobs.device, logprobs.dtype, non_blocking=True)
        per_token = adv.repeat_interleave(mb.cu_targets.diff().long(), output_size=logprobs.numel())
        loss, m = ppo_clip_loss(logprobs, old_lp, per_token, mb.cu_targets, loss_mask=loss_mask,
                                clip_eps=train.clip_eps, reduction="sum")
        if ref is not None:
            delta = at(ref) - logprobs
            kl = delta.exp() - delta - 1.0  # k3 estimator of KL(policy || reference), per token
            loss = loss + train.kl_coef * (kl if loss_mask is None else kl * loss_mask).sum()
        return loss, m["normalizer"]

    return loss_fn


def vision_packing_args(bridge) -> dict[str, int] | None:
    """``pack_vision_trees``'s model keywords (``image_token_id``, ``spatial_merge_size``, ``video_token_id``) of a
    bridge that builds a vision tower, else None."""
    return bridge.packing_args() if getattr(bridge, "builds_vision_tower", False) else None


def peak_memory_gib(cuda: bool) -> float:
    """Peak GPU memory allocated (CUDA) or peak resident host memory of this process (CPU), GiB."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def loss_and_grad_norm(losses: list[dict], chunks: list[torch.nn.Module], device) -> tuple[float, int, float]:
    """``(loss, loss tokens, gradient norm)`` of one model over the whole job, after its backward and before
    its optimizer step, in one all-reduce. The loss: the sum over Megatron's per-micro-batch loss dicts
    ``losses`` (filled on last pipeline stages, once per TP and CP rank) / their count. The norm: L2 over
    every rank's DDP gradient buffers of ``chunks`` (after the data-parallel reduction; with the distributed
    optimizer a rank's buffer is reduced on its own shard only, the rest holds its local gradient, which a
    NaN / inf passes through to the shard it is reduced into); it counts each data-parallel replica and
    tensor-parallel copy, so it is for the finiteness check only: NaN / inf exactly when a gradient is (or
    the squares overflow, as in the optimizer's norm). Records log the
    optimizer's norm."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(3, dtype=torch.float64, device=device)
    for item in losses:
        total[:2] += item["loss"].to(total)
    grads = [b.grad_data for chunk in chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    if grads:
        total[2] = torch.stack([torch.linalg.vector_norm(g) for g in grads]).double().square().sum()
    dist.all_reduce(total)
    total[:2] /= ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size()
    loss_sum, count, grad_sq = total.tolist()
    return loss_sum / max(count, 1.0), int(count), math.sqrt(grad_sq)


def nonfinite(losses: dict[str, float], grad_norms: dict[str, float]) -> str | None:
    """None when every value is finite; else what is not, then the finite losses, e.g.
    ``"gradient norm nan (loss 5.07517)"`` (keys name the values: ``"loss"``, ``"critic loss"``)."""
    values = {**losses, **grad_norms}
    bad = [f"{name} {value}" for name, value in values.items() if not math.isfinite(value)]
    if not bad:
        return None
    finite = [f"{name} {value:.6g}" for name, value in losses.items() if math.isfinite(value)]
    return ", ".join(bad) + (f" ({', '.join(finite)})" if finite else "")


def hf_text_config(m: ModelConfig):
    """The HF config of the model to train (of its language model, for a multimodal checkpoint): ``model.hf_path``'s,
    or the tiny ``model.arch`` model's with ``model.hf_overrides`` (what :meth:`Trainer._model_path` writes)."""
    if m.hf_path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(m.hf_path, trust_remote_code=m.trust_remote_code).get_text_config()
    from megatron_tree.runtime import tiny_hf_config

    return tiny_hf_config(m.arch, **m.hf_overrides).get_text_config()


def micro_batch_specs(cfg: RunConfig, *, chunk: bool, divisor: int = 1) -> tuple[MicroBatchSpec, MicroBatchSpec]:
    """The packing of the run ``cfg``'s updates and of its forward-only passes (the same object unless
    ``train.forward_max_tokens_per_mb`` sets another capacity): ``micro_batch`` with ``chunk`` (trees larger than a
    micro-batch in chunks: the tree model at PP = CP = 1) and at least ``divisor`` micro-batches, a multiple of it
    (the virtual pipeline's group size)."""
    mb = cfg.micro_batch
    spec = MicroBatchSpec.new(mb, n_mbs_divisor=max(mb.n_mbs_divisor, divisor), n_mbs=max(mb.n_mbs, divisor),
                              chunk_trees=chunk, max_kept_tokens=mb.max_kept_tokens if chunk else None)
    fwd = cfg.train.forward_max_tokens_per_mb
    if fwd in (None, mb.max_tokens_per_mb):
        return spec, spec
    return spec, MicroBatchSpec.new(spec, max_tokens_per_mb=fwd, max_kept_tokens=None)


def update_flops(flops: ModelFlops, reward_flops: ModelFlops | None, part: dict[str, Any], first: bool) -> float:
    """A rank's model FLOPs of one update on the mini-batch ``part`` (its ``work``, and ``forward_work`` where
    forward-only passes ran: :func:`~megatron_tree.core.flops.packed_work`): the actor's forward and backward on the
    update's micro-batches (``flops``: :class:`ModelFlops`, a backward twice its forward, activation recompute not
    counted), with PPO (``reward_flops``: the reward model's) the critic's too; in the mini-batch's ``first`` update
    also its forward-only passes (the old log-probs; with PPO also the reference's, the critic's values and the reward
    model's scores)."""
    tokens, pairs = part["work"]
    total = 3 * flops.forward(tokens, pairs)
    if reward_flops is not None:
        total += 3 * flops.forward(tokens, pairs, value_head=True)
    if first and "forward_work" in part:
        tokens, pairs = part["forward_work"]
        total += flops.forward(tokens, pairs)  # old log-probs
        if reward_flops is not None:
            total += (flops.forward(tokens, pairs) + flops.forward(tokens, pairs, value_head=True)
                      + reward_flops.forward(tokens, pairs, value_head=True))
    return total


def step_record(step, loss, loss_tokens, mbs, spec, seqs, shares, step_s, pack_s, grad_norm, skipped, cuda,
                slot_multiple, flops) -> dict[str, Any]:
    """Global (all-rank) metrics of step ``step`` (1-based): ``loss`` and ``loss_tokens`` as
    :func:`loss_and_grad_norm` gives them (the same on every rank), ``grad_norm`` the optimizer's
    (None where it gives none or the update was ``skipped``). ``slot_multiple``: what the schedule
    pads micro-batches to (for the context-parallel balance); ``flops``: this data-parallel rank's model FLOPs of the
    step (:func:`update_flops`), summed over the ranks into ``tflops_per_gpu`` (per GPU of the world, as
    Megatron's ``throughput per GPU (TFLOP/s/GPU)``)."""
    from megatron.core import parallel_state as ps

    device = "cuda" if cuda else "cpu"
    stats = PackingStats.of(mbs, spec.max_tokens_per_mb)
    tokens = torch.tensor([stats.original_tokens, stats.tree_tokens, stats.recomputed_tokens, flops],
                          dtype=torch.float64, device=device)
    peak = torch.tensor([peak_memory_gib(cuda)], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dp_group = ps.get_data_parallel_group()
    per_rank = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(ps.get_data_parallel_world_size())]
    dist.all_gather(per_rank, torch.tensor([len(mbs), stats.tree_tokens], dtype=torch.float64, device=device),
                    group=dp_group)
    dist.all_reduce(tokens, group=dp_group)
    original, tree, recomputed, flops = tokens.tolist()
    rank_tokens = [sum(len(seqs[i]) for i in idx) for idx in shares]
    return dict(
        step=step,
        loss=loss,
        loss_tokens=loss_tokens,
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        skipped=skipped,
        step_s=step_s,
        pack_s=pack_s,
        tokens_per_s=original / step_s,
        tree_tokens_per_s=tree / step_s,
        tflops_per_gpu=flops / step_s / dist.get_world_size() / 1e12,
        original_tokens=int(original),
        tree_tokens=int(tree),
        tree_token_ratio=tree / original,
        recomputed_tokens=int(recomputed),
        micro_batches=len(mbs),
        mb_imbalance=stats.balance.imbalance,
        mb_utilisation=stats.balance.utilisation,
        dp_token_imbalance=BalanceStats.of(rank_tokens).imbalance,
        dp_micro_batches=[int(r[0]) for r in per_rank],
        dp_tree_tokens=[int(r[1]) for r in per_rank],
        dp_tree_token_imbalance=BalanceStats.of([float(r[1]) for r in per_rank]).imbalance,
        peak_mem_gib=float(peak[0]),
        **_context_parallel_balance(mbs, ps.get_context_parallel_world_size(), slot_multiple),
    )


def _context_parallel_balance(mbs, cp: int, multiple: int) -> dict[str, Any]:
    """``cp_rank_pairs`` (attention (query, key) pairs per CP rank, summed over this rank's micro-batches)
    and ``cp_pair_imbalance`` (max / mean) of the CP layout; nothing without context parallel. Each
    micro-batch is padded as the schedule pads it (``multiple``: its slot multiple; the one length pipeline
    stages share is not applied here)."""
    if cp == 1:
        return {}
    from megatron_tree.core.context_parallel import context_parallel_layout, padded_slots

    total = np.zeros(cp)
    for mb in mbs:
        padded = mb.padded_to(padded_slots(mb.num_slots, multiple))
        total += context_parallel_layout(padded.position_ids, padded.num_tokens, cp)[1]
    return dict(cp_rank_pairs=[int(x) for x in total], cp_pair_imbalance=float(total.max() / total.mean()))


def _stop_helper_processes(before: set, timeout: float = 5.0) -> None:
    """End the multiprocessing children started since ``before`` (the set alive when the run began:
    megatron-core's checkpoint writers and their spawn Manager), so none outlives the run: terminate,
    wait up to ``timeout`` s, then kill."""
    import multiprocessing

    from megatron_tree.compat.megatron_core import forget_checkpoint_writer_queue

    children = [child for child in multiprocessing.active_children() if child not in before]
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout)
        if child.is_alive():
            child.kill()
    if children:
        forget_checkpoint_writer_queue()


def _why_not_dir(directory: str, error: OSError) -> str:
    """Why ``os.makedirs(directory)`` failed: the file in the way, if that is it, else the OS's reason."""
    if isinstance(error, (FileExistsError, NotADirectoryError)):
        blocker = os.path.abspath(directory)
        while blocker != os.path.dirname(blocker) and not os.path.exists(blocker):
            blocker = os.path.dirname(blocker)
        if os.path.exists(blocker) and not os.path.isdir(blocker):
            return f"{blocker!r} is a file"
    return error.strerror or str(error)


class Trainer:
    """One training run of ``cfg``: everything is set up in ``__init__`` (on every rank),
    :meth:`train` runs the remaining steps, :meth:`close` releases what was opened."""

    def __init__(self, cfg: RunConfig, *, config_source: str = "defaults"):
        self.cfg = cfg
        self.cuda = torch.cuda.is_available()
        if cfg.train.bf16 and not self.cuda:
            raise ValueError("train.bf16 (--bf16) needs a CUDA GPU: megatron-core's bf16 optimizer keeps CUDA "
                             "tensors; drop --bf16 to train in fp32 on CPU")
        self._stack = contextlib.ExitStack()
        self._tmp_dir: str | None = None
        self.sinks: list = []
        self.console: metrics.ConsoleSink | None = None
        self.iteration = 0
        self._closed = False
        self.in_steps = False  # while train() runs steps: a SIGTERM then only sets stop_requested
        self.stop_requested = False
        self._warmup = None
        import multiprocessing

        self._children_before = set(multiprocessing.active_children())
        try:
            self._setup(config_source)
        except BaseException:
            self.close(failed=True)
            raise

    def _setup(self, config_source: str) -> None:
        cfg = self.cfg
        from megatron.core import parallel_state as ps

        from megatron_tree.compat import apply_compat_patches
        from megatron_tree.runtime import cpu_mode

        # cpu_mode is a no-op on GPUs; the compat patches stay open for the whole run because
        # some are needed at run time (MoE on megatron-core 0.16.1 without Transformer Engine).
        self._stack.enter_context(apply_compat_patches())
        self._stack.enter_context(cpu_mode())
        self._stack.callback(self._destroy_distributed)
        random.seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        init_distributed(cfg.parallel, cfg.train.seed + 1, self.cuda)  # each rank on the GPU of its LOCAL_RANK
        # The language model's HF config first: FA4's warm-up thread then compiles while the rest is set up
        hf_config = hf_text_config(cfg.model)
        self._warmup = start_kernel_warmup(cfg, hf_config, self.cuda)
        self.flops = ModelFlops.of(hf_config)
        self.rank = dist.get_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group() if self.dp > 1 else None

        self._make_output_dirs()
        path, load = self._model_path()
        check_layers(hf_config.num_hidden_layers, cfg.parallel.pp, cfg.parallel.vpp)
        check_expert_parallel(hf_config, cfg.parallel.ep, cfg.model.hf_path or f"the tiny {cfg.model.arch} model")
        self.model, self.optimizer, self.bridge = build_model(cfg, path, load, self.cuda)
        self.scheduler = make_scheduler(cfg, self.optimizer)
        from megatron_tree.mcore.model_check import check_tree_model

        self.tree_model = uses_tree_model(cfg, self.cuda)
        if self.tree_model:
            check_tree_model(self.model)  # tree attention and per-token RoPE in every chunk, or one clear error
        elif cfg.train.verify_tree_model:
            raise ValueError(
                "--verify-tree-model checks a tree model, but with Transformer Engine --no-tree-training runs the "
                "upstream model on THD-packed sequences; drop one of the two flags"
            )
        self.ppo = None
        if cfg.train.loss == "ppo":  # reference, critic (+ optimizer) and reward model
            from megatron_tree.train.ppo import build_ppo_models

            self.ppo = build_ppo_models(cfg, path, load, self.model, lambda m: make_optimizer(cfg, m, self.cuda),
                                        tree=self.tree_model)  # fmt: skip
        self.reward_flops = None if self.ppo is None else ModelFlops.of(self.ppo.reward_hf_config)
        if cfg.train.verify_tree_model:
            from megatron_tree.mcore.verify import verify_tree_model

            report = verify_tree_model(self.model)  # raises when the tree path is not exact
            self._info(f"verify_tree_model: {report}")
        if describe(self.model):
            self._info(describe(self.model))
        self.vocab = self.bridge.hf_config.vocab_size
        p, mb = cfg.parallel, cfg.micro_batch
        divisor = (self.model[0].config.microbatch_group_size_per_vp_stage or p.pp) if p.vpp else 1
        # Chunks of trees larger than a micro-batch need the tree model, one pipeline stage, no context parallel.
        chunk = mb.chunk_trees and self.tree_model and p.pp == 1 and p.cp == 1
        if mb.chunk_trees and not chunk:
            kept = "" if mb.max_kept_tokens is None else " (max_kept_tokens with it)"
            self._info(f"micro_batch.chunk_trees is off{kept}: chunks run with pipeline and context parallel size 1 and "
                       f"the tree model only; a tree larger than a micro-batch is split with its shared path recomputed")
        self.spec, self.forward_spec = micro_batch_specs(cfg, chunk=chunk, divisor=divisor)
        self.source = open_rollout_source(
            cfg.data, vocab=self.vocab, max_len=None if chunk else mb.max_tokens_per_mb, seed=cfg.train.seed,
            need_advantages=cfg.train.loss == "grpo", need_ref_logprobs=cfg.train.loss == "grpo" and cfg.train.kl_coef > 0,
        )
        if cfg.checkpoint.load:
            loaded, self.iteration, position, rng_restored = checkpoint.load_checkpoint(
                cfg.checkpoint.load, self.model, self.optimizer, self.scheduler, critic=self._critic())
            try:
                self.source.restore(position)
            except ValueError as e:
                raise ValueError(f"--load {loaded}: {e}") from None
            updates = cfg.train.ppo_epochs * cfg.train.ppo_mini_batches
            if self.iteration % updates:
                raise ValueError(f"--load {loaded}: iteration {self.iteration} is not the end of a rollout batch of this "
                                 f"run's train.ppo_epochs * train.ppo_mini_batches = {updates} updates; resume with "
                                 f"the --ppo-epochs / --ppo-mini-batches it was saved with")
            self._info(f"resumed from {loaded} at iteration "
                       f"{self.iteration}" + ("" if rng_restored else " (RNG state not restored: other world size)"))
        if self.rank == 0:
            self._open_sinks(config_source)

    # ------------------------------------------------------------------ setup helpers

    def _model_path(self) -> tuple[str, bool]:
        """(HF directory, whether to load its weights). Without ``model.hf_path``, rank 0 writes a
        random tiny HF checkpoint (only its config with ``random_init``) to a temporary directory
        that :meth:`close` removes; every rank reads it (one host)."""
        from megatron_tree.runtime import save_hf_config, save_tiny_hf_checkpoint

        m = self.cfg.model
        if m.hf_path:
            return m.hf_path, True
        name = [tempfile.mkdtemp(prefix=f"megatron_tree_{m.arch}_") if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        self._tmp_dir = name[0]
        if m.random_init:
            return save_hf_config(m.arch, self._tmp_dir, **m.hf_overrides), False
        return save_tiny_hf_checkpoint(m.arch, self._tmp_dir, seed=self.cfg.train.seed, **m.hf_overrides), True

    def _make_output_dirs(self) -> None:
        """Create the checkpoint, export and log directories now (rank 0), so a bad path fails before
        training, naming its key; refuse a ``--save`` directory that holds an earlier run unless it is resumed."""
        ckpt, log = self.cfg.checkpoint, self.cfg.logging
        checkpoint.check_save_dir(ckpt.save, ckpt.load)
        if self.rank != 0:
            return
        dirs = [(f"checkpoint.{key}", getattr(ckpt, key), getattr(ckpt, key)) for key in ("save", "export_hf")]
        if log.jsonl:
            if os.path.isdir(log.jsonl):
                raise ValueError(f"logging.jsonl (--log-jsonl) {log.jsonl!r} is a directory; pass a file path")
            dirs.append(("logging.jsonl (--log-jsonl)", log.jsonl, os.path.dirname(os.path.abspath(log.jsonl))))
        dirs.append(("logging.tensorboard_dir (--tensorboard-dir)", log.tensorboard_dir, log.tensorboard_dir))
        if ckpt.export_hf and os.path.isdir(ckpt.export_hf) and os.listdir(ckpt.export_hf) and not ckpt.export_overwrite:
            held = sorted(os.listdir(ckpt.export_hf))
            raise ValueError(f"checkpoint.export_hf (--export-hf) {ckpt.export_hf!r} is not empty ({len(held)} entries, "
                             f"e.g. {held[0]!r}): files of an earlier export would sit beside the new ones and "
                             f"transformers may load them; choose an empty directory or pass --export-overwrite "
                             f"(checkpoint.export_overwrite) to replace its contents")
        for name, path, directory in dirs:
            if path:
                what = "the directory" if directory == path else f"its directory {directory!r}"
                try:
                    os.makedirs(directory, exist_ok=True)
                except OSError as e:
                    raise ValueError(f"{name} {path!r}: cannot create {what} ({_why_not_dir(directory, e)})") from None
                if not os.access(directory, os.W_OK | os.X_OK):
                    raise ValueError(f"{name} {path!r}: {what} is not writable by this process; fix its permissions "
                                     f"or choose another path")
        parent = ckpt.export_hf and os.path.dirname(os.path.abspath(ckpt.export_hf))
        if parent and not os.access(parent, os.W_OK | os.X_OK):  # the export is staged beside its directory
            raise ValueError(f"checkpoint.export_hf (--export-hf) {ckpt.export_hf!r}: its parent directory {parent!r} "
                             f"is not writable (the export is written beside it, then moved in); choose another path")

    def _open_sinks(self, config_source: str) -> None:
        log, resumed = self.cfg.logging, self.iteration > 0
        self.console = metrics.ConsoleSink(steps=self.cfg.train.steps, first_step=self.iteration,
                                           desc="tree" if self.cfg.train.tree_training else "flat",
                                           progress=log.progress)
        self.sinks.append(self.console)
        if log.jsonl:
            self.sinks.append(metrics.JsonlSink(log.jsonl, append=resumed))
        if log.tensorboard_dir:
            self.sinks.append(metrics.TensorBoardSink(log.tensorboard_dir))
        if log.wandb_project:
            config = {"config_file": config_source, **dataclasses.asdict(self.cfg)}
            self.sinks.append(metrics.WandbSink(log.wandb_project, name=log.wandb_run_name, mode=log.wandb_mode,
                                                config=config))

    def _info(self, message: str) -> None:
        if self.rank != 0:
            return
        if self.console is not None:
            self.console.info(message)
        else:
            print(message, flush=True)

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict[str, Any]]:
        """Run updates ``iteration + 1 .. train.steps``, rollout batch by rollout batch; returns their records (same
        on every rank). Checkpoints are written between rollout batches (the data position is a rollout batch's).

        ``stop_requested`` (set by the launcher's SIGTERM handler while ``in_steps``) ends the run after the rollout
        batch in flight, as Megatron-LM's ``--exit-signal-handler``: the ranks agree on it after each batch (one
        all-reduce), its updates are saved when ``checkpoint.save`` is set (unless their save was due anyway), and
        ``train`` returns without the export."""
        records = []
        ckpt = self.cfg.checkpoint
        if self.iteration >= self.cfg.train.steps:
            self._info(f"nothing to train: iteration {self.iteration} >= train.steps {self.cfg.train.steps}; raise --steps")
        self._wait_for_warmup()
        self.in_steps = True
        try:
            while self.iteration < self.cfg.train.steps:
                records += self.train_batch(self.source.next_batch())
                stop = self._stop_agreed()
                last = self.iteration == self.cfg.train.steps
                if ckpt.save and (last or stop or (ckpt.save_interval and self.iteration % ckpt.save_interval == 0)):
                    path = checkpoint.save_checkpoint(ckpt.save, self.iteration, self.model, self.optimizer,
                                                      data=self.source.state(), scheduler=self.scheduler,
                                                      critic=self._critic())
                    self._info(f"saved checkpoint {path}")
                if stop:
                    return records
        finally:
            self.in_steps = False
        if ckpt.export_hf:
            self.export_hf(ckpt.export_hf)
        return records

    def _wait_for_warmup(self) -> None:
        """Before the first step: this rank's kernel warm-up (:func:`start_kernel_warmup`) has finished, so the first
        step finds its kernels compiled."""
        if self._warmup is not None:
            self._info(self._warmup.wait())
            self._warmup = None

    def _stop_agreed(self) -> bool:
        """Whether any rank has ``stop_requested`` (one all-reduce; every rank then stops after the same batch)."""
        flag = torch.tensor([float(self.stop_requested)], device="cuda" if self.cuda else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stop_requested = bool(flag.item())
        return self.stop_requested

    def train_batch(self, batch: RolloutBatch) -> list[dict[str, Any]]:
        """The optimizer updates of one rollout batch: its groups split in order into ``train.ppo_mini_batches``
        mini-batches of whole groups; each packed (and its old log-probs, with PPO all its forward-only passes,
        computed) before the first update; then ``train.ppo_epochs`` passes over the mini-batches, one update
        each. Returns the updates' records (written to the sinks)."""
        t = self.cfg.train
        starts = np.flatnonzero(np.diff(batch.groups, prepend=-1))  # first sequence of each group
        if len(starts) < t.ppo_mini_batches:
            raise ValueError(f"a rollout batch of {len(starts)} groups cannot be split into train.ppo_mini_batches="
                             f"{t.ppo_mini_batches} mini-batches of whole groups (the last batch of a pass over "
                             f"data.path takes the groups left); lower --ppo-mini-batches or make data.batch_size "
                             f"divide the file's groups")
        bounds = [*(starts[c[0]] for c in np.array_split(np.arange(len(starts)), t.ppo_mini_batches)),
                  len(batch.sequences)]
        parts = [self._mini_batch(batch, np.arange(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
        return [self._update(batch, part, first=epoch == 0) for epoch in range(t.ppo_epochs) for part in parts]

    def _mini_batch(self, batch: RolloutBatch, ids: np.ndarray) -> dict[str, Any]:
        """The sequences ``ids`` of ``batch`` split over data-parallel ranks by tree cost, this rank's share packed
        into micro-batches, and what the updates need computed before any of them: with PPO its forward-only passes
        (``ppo_targets``); with grpo and several updates per rollout batch, the old log-probs the rollouts lack. The
        forward-only passes run on a packing of their own where ``train.forward_max_tokens_per_mb`` sets a larger
        capacity (their results are per sequence: the updates gather them by sequence id)."""
        t0 = time.perf_counter()
        seqs = [batch.sequences[i] for i in ids]
        if self.dp > 1:
            shares = balance_across_ranks(seqs, self.dp, algorithm=self.cfg.train.balance)
        else:
            shares = [np.arange(len(seqs))]
        mine = ids[np.asarray(shares[self.dp_rank], dtype=np.int64)]
        mbs = self._pack(batch, mine, self.spec)
        part = dict(seqs=seqs, shares=shares, mine=mine, mbs=mbs, pack_s=time.perf_counter() - t0, old=None,
                    work=packed_work(mbs))
        t = self.cfg.train
        forward_passes = self.ppo is not None or (
            t.loss == "grpo" and t.ppo_epochs * t.ppo_mini_batches > 1
            and (batch.old_logprobs is None or any(np.isnan(lp[1:]).any() for lp in batch.old_logprobs)))
        if forward_passes:
            t1 = time.perf_counter()
            fwd_mbs = mbs if self.forward_spec is self.spec else self._pack(batch, mine, self.forward_spec)
            part["pack_s"] += time.perf_counter() - t1
            part["forward_micro_batches"] = len(fwd_mbs)
            part["forward_work"] = part["work"] if fwd_mbs is mbs else packed_work(fwd_mbs)
        if self.ppo is not None:
            from megatron_tree.train.ppo import ppo_targets

            masks = None if batch.loss_mask is None else [batch.loss_mask[i] for i in mine]
            part["targets"] = ppo_targets(self.cfg, self.model, self.ppo, fwd_mbs, masks, tree=self.tree_model)
        elif forward_passes:
            from megatron_tree.mcore.forward_only import flat_forward_only, tree_forward_only

            old = (tree_forward_only if self.tree_model else flat_forward_only)(self.model, fwd_mbs)
            part["old"] = torch.cat(old).cpu() if old else torch.zeros(0)
        part["prepare_s"] = time.perf_counter() - t0
        return part

    def _pack(self, batch: RolloutBatch, mine: np.ndarray, spec: MicroBatchSpec) -> list:
        """This rank's sequences ``mine`` of ``batch`` packed by ``spec`` (flat chains under ``--no-tree-training``)."""
        if batch.images is not None:
            return self._pack_images(batch, mine, spec)
        return pack_trees([batch.sequences[i] for i in mine], spec, dp_group=self.dp_group,
                          share_prefixes=self.cfg.train.tree_training)

    def _pack_images(self, batch: RolloutBatch, mine: np.ndarray, spec: MicroBatchSpec) -> list:
        """This rank's sequences with their images in tree micro-batches (``pack_vision_trees``; trees larger than a
        micro-batch split at branch points, their shared path computed in each part: chunks take no images)."""
        vision, problem = vision_packing_args(self.bridge), None
        if vision is None:
            problem = ("the model has no vision tower (train a Qwen2.5-VL, GLM-4V or GLM-4.5V checkpoint, or "
                       "model.arch qwen2_5_vl / glm4v / glm4v_moe)")
        elif not self.tree_model:
            problem = "images need train.tree_training: true"
        elif self.ppo is not None:
            problem = "train.loss ppo with images is not supported yet (its critic and reward models are text models)"
        if problem:
            raise ValueError(f"the rollouts carry images, but {problem}; train on text-only rollouts or change that")
        # Image prompts share <|vision_start|> (one root tree): split at branch points, as chunks take no images.
        spec = MicroBatchSpec.new(spec, chunk_trees=False, max_kept_tokens=None)
        return pack_vision_trees([batch.sequences[i] for i in mine], [batch.images[i] for i in mine], spec,
                                 dp_group=self.dp_group, **vision)

    def _update(self, batch: RolloutBatch, part: dict[str, Any], *, first: bool) -> dict[str, Any]:
        """One optimizer update on the mini-batch ``part`` (:meth:`_mini_batch`); returns its record (written to the
        sinks). ``first``: the mini-batch's first update (its record counts the packing and forward-only passes)."""
        from megatron_tree.mcore.schedule import flat_forward_backward, schedule_slot_multiple, tree_forward_backward

        t0 = time.perf_counter()
        mbs = part["mbs"]
        extra: dict[str, Any] = {}
        lr = self.optimizer.param_groups[0]["lr"]  # this update's (the scheduler moves it after the update)
        if self.ppo is None:
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            run = tree_forward_backward if self.tree_model else flat_forward_backward
            losses = run(self.model, mbs, make_loss_fn(self.cfg.train, batch, part["mine"], part["old"]))
            loss, loss_tokens, norm = loss_and_grad_norm(losses, self.model, "cuda" if self.cuda else "cpu")
            skipped = not self.may_update(nonfinite({"loss": loss}, {"gradient norm": norm}))
            grad_norm = None if skipped else self.optimizer.step()[1]
        else:  # an actor and a critic update (megatron_tree.train.ppo)
            from megatron_tree.train.ppo import ppo_update

            extra = ppo_update(self.cfg, self.model, self.optimizer, self.ppo, mbs, part["targets"],
                               tree=self.tree_model, may_update=self.may_update)
            if first:  # the forward-only passes ran for this mini-batch's first update
                extra |= part["targets"].times
            loss, loss_tokens, grad_norm, skipped = (extra.pop(k) for k in ("loss", "loss_tokens", "grad_norm",
                                                                            "skipped"))
        if not skipped:
            self.scheduler.step(increment=1)
        if self.cuda:
            torch.cuda.synchronize()
        self.iteration += 1
        step_s = time.perf_counter() - t0 + (part["prepare_s"] if first else 0.0)
        flops = update_flops(self.flops, self.reward_flops, part, first)
        record = step_record(self.iteration, loss, loss_tokens, mbs, self.spec, part["seqs"], part["shares"],
                             step_s, part["pack_s"] if first else 0.0, grad_norm, skipped, self.cuda,
                             schedule_slot_multiple(self.model[0]), flops) | {"lr": lr} | extra
        if first and "forward_micro_batches" in part:  # the forward-only passes ran before this update
            record["forward_micro_batches"] = part["forward_micro_batches"]
        for sink in self.sinks:
            sink.write(record)
        return record

    def _critic(self) -> tuple[list[torch.nn.Module], Any] | None:
        """PPO's critic and its optimizer, what checkpoints carry besides the actor (None without PPO)."""
        return None if self.ppo is None else (self.ppo.critic, self.ppo.critic_optimizer)

    def may_update(self, problem: str | None) -> bool:
        """Whether the coming step (``iteration + 1``) may run its optimizer step, given ``problem``
        (:func:`nonfinite` of its losses and gradient norms): True without one; with one, False under
        ``train.skip_nonfinite`` (logged), else ValueError, one line. Nothing has changed the weights
        yet: the run stops before that step's optimizer step, checkpoint and export."""
        if problem is None:
            return True
        step = self.iteration + 1
        if self.cfg.train.skip_nonfinite:
            self._info(f"step {step}: non-finite {problem}: update skipped (train.skip_nonfinite), weights unchanged")
            return False
        raise ValueError(
            f"step {step}: non-finite {problem}; the run stopped before its optimizer step: nothing of step {step} "
            f"reaches the weights, a checkpoint or an export. Lower the learning rate (--lr, now {self.cfg.train.lr:g}), check the rollouts' advantages and "
            f"log-probs, or pass --skip-nonfinite to skip such updates"
        )

    def export_hf(self, path: str) -> None:
        """Write the current weights as a Hugging Face checkpoint to ``path`` (mbridge; rank 0 writes): into a
        staging folder beside it, which then replaces ``path``'s contents (nothing of an earlier export is left)."""
        staging = f"{os.path.normpath(path)}.exporting"
        if self.rank == 0 and os.path.isdir(staging):
            shutil.rmtree(staging)
        dist.barrier()
        sync_params(self.model)  # overlap_param_gather: the updated shards are gathered in a forward
        self.bridge.save_weights(self.model, staging)
        dist.barrier()
        if self.rank == 0:
            checkpoint.move_into_place(staging, path)
        dist.barrier()
        self._info(f"exported Hugging Face checkpoint {path}")

    # ------------------------------------------------------------------ teardown

    def close(self, *, failed: bool = False) -> None:
        """Close the sinks, remove the temporary model directory, tear down the process groups and
        leave CPU mode / the patches. Idempotent. ``failed``: skip the final barrier (other ranks
        may be gone)."""
        if self._closed:
            return
        self._closed = True
        try:
            for sink in self.sinks:
                sink.close()
            if dist.is_initialized() and not failed:
                dist.barrier()
            if self._tmp_dir and (not dist.is_initialized() or dist.get_rank() == 0):
                shutil.rmtree(self._tmp_dir, ignore_errors=True)
        finally:
            if self._warmup is not None:  # the job ended before its first step: the warm-up thread starts no more
                self._warmup.stop()
            self._stack.close()
            _stop_helper_processes(self._children_before)

    def latest_checkpoint(self) -> str | None:
        """The checkpoint a resume would load from ``checkpoint.save`` (None without one)."""
        save = self.cfg.checkpoint.save
        if not save or checkpoint.saved_iteration(save) is None:
            return None
        try:
            return checkpoint.resolve_checkpoint(save)
        except ValueError:
            return None

    @staticmethod
    def _destroy_distributed() -> None:
        from megatron_tree.runtime import destroy_distributed

        destroy_distributed()

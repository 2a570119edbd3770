"""Tree vs flat training steps on one GPU: same model, same rollout batch, same run.

    python benchmarks/e2e_bench.py --model qwen3-0.6b --out benchmarks/results/e2e_qwen3-0.6b.json
    python benchmarks/e2e_bench.py --model tiny --scale 0.02 --max-tokens-per-mb 256 --out /tmp/e2e.json  # CPU smoke
    python benchmarks/e2e_bench.py --model qwen3.5-hybrid-2b --workloads grpo,multi_turn --recompute full \
        --out benchmarks/results/e2e_qwen3.5-hybrid-2b.json   # Gated DeltaNet : full attention 3:1
    python benchmarks/e2e_bench.py --model qwen3-1.7b --workloads long_multi_turn --max-tokens-per-mb 8192 \
        --chunk-trees --recompute full --flat-max-tokens-per-mb 40960 \
        --out benchmarks/results/te/e2e_chunks_long_multi_turn_8k.json   # trees larger than a micro-batch

Flat = every sequence its own causal chain, packed several to a micro-batch up to the same
``max_tokens_per_mb``. With Transformer Engine that is Megatron's sequence packing: the upstream
model, each sequence a THD segment through TE's cuDNN fused attention
(``flat_forward_backward``; baseline ``te_thd_cudnn`` in the JSON). Without TE, or at a head dim where TE's THD
backward is wrong (256: ``packed_seq.thd_backward_refusal``), flat micro-batches run through the tree model's own
kernel (``tree_kernel_chains``). Gated DeltaNet layers
(Qwen3.5 / Qwen3-Next shapes) run the same kernels in both modes: per tree level, or per packed
sequence (THD); fla is off (not trusted on Hopper), so both use the exact PyTorch chunked rule. Tree = prefix
trees. Both run Megatron's ``forward_backward_func`` + optimizer step on the same bf16 model
shape, initialised alike. Reported per workload: median step time and its spread over the
timed steps (and the optimizer's share), tokens/s of original tokens, model TFLOP/s (each mode's
own FLOPs / its step time), peak
memory, the largest micro-batch, token ratio, the FLOP-ideal
speedup (FLOPs flat / FLOPs tree, linear and Gated DeltaNet layers by tokens and full attention by
computed (query, key) pairs, on the single global trie: :func:`flops_per_token_and_pair`), the same ratio for the trees as packed
(shared prefixes of a tree split over micro-batches count once per part), and the achieved
fraction of the former; with
``--profile`` (default) also one profiled step per mode (``step_profile.py``: kernel time
by category and the top kernels, the log-prob and optimizer regions, device idle time and
the host ops it falls in); with ``--host-profile`` one more step per mode under cProfile, its top Python functions
by own time and by cumulative time written to ``<out>.host_<workload>_<mode>.txt`` (where a host-bound step's time
goes; cProfile's own overhead inflates it).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import io
import math
import os
import pstats
import statistics
import tempfile
import time
from typing import NamedTuple

import numpy as np
import torch

from step_profile import OPTIMIZER_REGION, profile_step
from step_spread import spread
from transformers import AutoConfig

from megatron_tree import MicroBatchSpec, PackingStats, build_forest, pack_trees
from megatron_tree.core.flops import ModelFlops, packed_work
from megatron_tree.core.hf_config import attention_head_dim
from megatron_tree.mcore.grouped_gemm import cutlass_grouped_gemm_on
from megatron_tree.ops.losses import sft_loss
from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch, no_sharing_batch
from megatron_tree.core.tree import as_sequences

MODELS = {
    "tiny": ("qwen3", dict(num_hidden_layers=2)),  # the test checkpoint's shape: CPU smoke runs of this harness
    # HF config overrides of random-init Qwen3 shapes (Megatron initialises the weights).
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128)),
    "qwen3-1.7b": ("qwen3", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128)),
    "qwen3-4b": ("qwen3", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    "qwen3-moe-2b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       moe_intermediate_size=768, num_hidden_layers=12, num_attention_heads=16,
                                       num_key_value_heads=4, head_dim=128, num_experts=16, num_experts_per_tok=4)),
    # Hybrid Gated DeltaNet : full attention 3:1 (every 4th layer full attention, with an output gate).
    "tiny-qwen3.5": ("qwen3_5", {}),  # the tiny Qwen3.5 test model: CPU smoke runs of GDN models
    "qwen3.5-hybrid-2b": ("qwen3_5", dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144,
                                          num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                                          head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                                          linear_key_head_dim=128, linear_value_head_dim=128,
                                          tie_word_embeddings=True)),  # ~1.9B, Qwen3.5-2B's shape
    "qwen3-next-hybrid-moe-3b": ("qwen3_next", dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=24,
                                                    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                                    linear_num_key_heads=16, linear_num_value_heads=32,
                                                    linear_key_head_dim=128, linear_value_head_dim=128,
                                                    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384,
                                                    shared_expert_intermediate_size=512, mlp_only_layers=[])),
    # Shared-expert MoE (Qwen2-MoE: a gated shared expert beside 16 routed top-4) at the qwen3-moe-2b size
    "qwen2-moe-shared-2b": ("qwen2_moe", dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=12,
                                              num_attention_heads=16, num_key_value_heads=4, num_experts=16,
                                              num_experts_per_tok=4, moe_intermediate_size=768,
                                              shared_expert_intermediate_size=1536)),
    # A small DeepSeek-V3: MLA with its head dims (q/k 128 + 64 RoPE, v 128), layer 0 dense, then 16 sigmoid-routed
    # experts top-4 in 4 groups (2 chosen) and a shared expert
    "deepseek-v3-small": ("deepseek_v3", dict(vocab_size=129280, hidden_size=1024, num_hidden_layers=12,
                                              num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
                                              kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                              v_head_dim=128, intermediate_size=3072, moe_intermediate_size=512,
                                              n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                              n_shared_experts=1, first_k_dense_replace=1)),
    # ~3.2B (0.9B active), Qwen3-Next's layers at 1/2 its depth and 1/16 its experts
}


def workloads(name: str, rng: np.random.Generator, vocab: int, scale: float = 1.0):
    """The rollout batch of workload ``name``; ``scale`` multiplies every length (smoke runs)."""

    def n(x: int) -> int:
        return max(1, round(x * scale))

    if name == "grpo":  # prompt 1-4k, 8-16 samples, responses 0.2-2k
        return grpo_batch(rng, n_prompts=4, samples=(8, 16), prompt_len=(n(1024), n(4096)),
                          response_len=(n(200), n(2000)), vocab=vocab)
    if name == "multi_turn":  # tau-bench-like agent trees: many turns, forks
        return multi_turn_batch(rng, n_conversations=6, turns=(8, 16), turn_len=(n(100), n(600)), fork_prob=0.25,
                                system_len=n(1500), vocab=vocab)
    if name == "no_sharing":
        return no_sharing_batch(rng, n=48, length=(n(500), n(3000)), vocab=vocab)
    if name == "long_multi_turn":  # long agentic trajectories: 4k system prompt, 24-32 turns of 1-3k, up to ~50k each
        return multi_turn_batch(rng, n_conversations=2, turns=(24, 32), turn_len=(n(1000), n(3000)), fork_prob=0.2,
                                system_len=n(4000), vocab=vocab)
    raise ValueError(f"unknown workload {name!r}; choose grpo, multi_turn, no_sharing, long_multi_turn")


def flops_per_token_and_pair(cfg) -> tuple[float, float]:
    """fwd+bwd FLOPs (3x forward) of one token through everything that grows with tokens (the layers and the output
    layer), and of one (q, k) pair through the full-attention layers: :class:`megatron_tree.core.flops.ModelFlops`."""
    f = ModelFlops.of(cfg)
    return 3 * (f.per_token + f.output_per_token), 3 * f.per_pair


def train_step(model, optimizer, mbs, loss_fn, run, between=None) -> None:
    """One step: zero grads, ``run(model, mbs, loss_fn)`` (the tree or flat forward-backward),
    ``between()`` if given, optimizer step. Raises ``FloatingPointError`` when the step's gradient norm (computed
    by the optimizer's clipping, a host value already) is not finite: bf16 optimizers have no loss scaler to skip
    such a step, so the weights it updated are no longer usable and the timings after it would be of NaN math."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # New micro-batch objects every step, as a new batch's: the step moves them to the GPU and prepares their masks
    # (the schedule reuses both only across passes over the same objects).
    run(model, [dataclasses.replace(mb) for mb in mbs], loss_fn)
    if between is not None:
        between()
    with torch.profiler.record_function(OPTIMIZER_REGION):
        _, grad_norm, _ = optimizer.step()
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        raise FloatingPointError(f"non-finite gradient norm ({float(grad_norm)}) in this step's backward; its "
                                 f"optimizer step has applied it (bf16: no loss scaler skips it)")


class StepTimes(NamedTuple):
    """:func:`timed_steps`' measurements: step times (s) after the warm-up, the optimizer's share of each (s, from a
    synchronised mark after the backward; CUDA only, else 0), peak GPU memory in GiB (None on CPU), and per timed
    step the caching allocator's ``cudaMalloc`` calls and its retries (a failed ``cudaMalloc`` that freed the cache
    and tried again; both 0 on CPU): where they are not 0, the allocator's device calls are in the step's time."""

    times: list[float]
    optimizer_times: list[float]
    peak_gib: float | None
    cuda_mallocs: list[int]
    alloc_retries: list[int]


def timed_steps(model, optimizer, mbs, loss_fn, run, warmup: int, steps: int) -> StepTimes:
    """``warmup + steps`` training steps, the last ``steps`` measured (:class:`StepTimes`). Python's garbage collector
    runs between steps, not inside them (as Megatron's ``--manual-gc``): a collection inside a host-bound step is
    noise."""
    times, optimizer_times, mallocs, retries = [], [], [], []
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    marks = []

    def mark():
        if cuda:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())

    def allocator() -> tuple[int, int]:
        stats = torch.cuda.memory_stats() if cuda else {}
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    gc.disable()
    try:
        for i in range(warmup + steps):
            gc.collect()
            marks.clear()
            before = allocator()
            mark()
            train_step(model, optimizer, mbs, loss_fn, run, between=mark if cuda else None)
            mark()
            if i >= warmup:
                times.append(marks[-1] - marks[0])
                optimizer_times.append(marks[-1] - marks[1] if cuda else 0.0)
                after = allocator()
                mallocs.append(after[0] - before[0])
                retries.append(after[1] - before[1])
    finally:
        gc.enable()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return StepTimes(times, optimizer_times, peak, mallocs, retries)


def host_profile(fn, path: str, top: int = 100) -> None:
    """Run ``fn()`` once under cProfile (synchronised at both ends on CUDA) and write its ``top`` functions by own
    time, then by cumulative time, to ``path``."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(fn)
    if cuda:
        torch.cuda.synchronize()
    text = io.StringIO()
    text.write(f"wall {time.perf_counter() - start:.3f} s (under cProfile)\n")
    stats = pstats.Stats(profiler, stream=text)
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(top)
    with open(path, "w") as f:
        f.write(text.getvalue())


def init_one_process(cuda: bool) -> None:
    """torch.distributed and megatron-core parallel state for one process (gloo CPU mode off CUDA)."""
    from megatron_tree.runtime import init_distributed

    init_distributed(seed=1, backend="nccl" if cuda else "gloo")


def build(path: str, *, tree: bool, bf16: bool, recompute: str, cuda: bool, backend: str = "auto", lr: float = 1e-5):
    """``(model chunks, optimizer)``: the model Megatron initialises from the HF config at ``path``
    (tree attention or upstream), wrapped in DDP, with Adam at learning rate ``lr``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_tree.mcore.bridge import build_model

    _, model = build_model(
        path, tree=tree, bf16=bf16, recompute=recompute, load_weights=False, wrap_with_ddp=True, backend=backend,
        ddp_config=dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
    )
    # megatron-core's gradient clipping asserts CUDA tensors: clip on GPUs only.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, bf16=bf16, clip_grad=1.0 if cuda else 0.0,
                        use_distributed_optimizer=False),
        model,
    )
    return model, optimizer


def profiled_step_summary(profile: dict) -> dict:
    """One profiled step's wall, device-busy and summed kernel time (ms) from :func:`step_profile.profile_step`'s
    breakdown: the kernels' sum moving with the wall time puts a spread on the device (clocks, the experts' token
    counts), the idle time (wall - busy) moving puts it on the host."""
    return dict(wall_ms=profile["wall_ms"], busy_ms=profile["busy_ms"], kernel_ms=sum(profile["kernels_ms"].values()))


def loss_fn(logprobs, mb):
    """Per-token mean negative log-likelihood as ``(sum, count)``."""
    loss, metrics = sft_loss(logprobs, mb.cu_targets, reduction="sum")
    return loss, metrics["normalizer"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    ap.add_argument("--workloads", default="grpo,multi_turn,no_sharing")
    ap.add_argument("--max-tokens-per-mb", type=int, default=16384)
    ap.add_argument("--recompute", default="none", choices=["none", "full", "selective"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="add one profiled step per mode: kernel time by category, logprobs, optimizer, idle")
    ap.add_argument("--profile-steps", type=int, default=1,
                    help="with --profile, profile this many steps per mode; above 1 the row also lists each one's "
                         "wall, device-busy and kernel time (is a step's spread on the device or on the host?)")
    ap.add_argument("--lr", type=float, default=1e-5,
                    help="Adam's learning rate (0: the weights, and so an MoE router's choices, stay as initialised)")
    ap.add_argument("--host-profile", action="store_true",
                    help="add one cProfile'd step per mode; its top functions go to <out>.host_<workload>_<mode>.txt")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every workload length (smoke runs)")
    ap.add_argument("--attention-backend", default="auto", help="tree attention backend of the tree steps")
    ap.add_argument("--modes", default="flat,tree", help="which of flat,tree to run")
    ap.add_argument("--chunk-trees", action=argparse.BooleanOptionalAction, default=False,
                    help="tree steps: a tree larger than a micro-batch runs in chunks that read their ancestors' keys "
                         "and values (MicroBatchSpec(chunk_trees=True); every unique token computed once)")
    ap.add_argument("--max-kept-tokens", type=int,
                    help="with --chunk-trees: MicroBatchSpec.max_kept_tokens (default max_tokens_per_mb); chunks "
                         "beyond it run their forward again before their backward (recomputed_tokens in the row)")
    ap.add_argument("--flat-max-tokens-per-mb", type=int,
                    help="the flat steps' micro-batch capacity (default --max-tokens-per-mb); flat packing cannot "
                         "chunk, so it must hold the longest sequence")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.profile_steps < 1:
        ap.error(f"--profile-steps must be at least 1 (got {args.profile_steps}); --no-profile profiles no step")
    if not args.lr >= 0:
        ap.error(f"--lr must be a non-negative number (got {args.lr})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not args.model.startswith("tiny"):
        raise SystemExit("e2e_bench measures bf16 kernels on a CUDA GPU; without one only --model tiny or tiny-qwen3.5 "
                         "(fp32 smoke runs of the harness) is allowed")
    from megatron_tree.core.platform import have_transformer_engine
    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.mcore.packed_seq import thd_backward_refusal
    from megatron_tree.mcore.schedule import flat_forward_backward, tree_forward_backward
    from megatron_tree.runtime import cpu_mode, save_hf_config

    arch, overrides = MODELS[args.model]
    spec = MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb, packing_algorithm="kk", chunk_trees=args.chunk_trees,
                          max_kept_tokens=args.max_kept_tokens)
    flat_spec = MicroBatchSpec(max_tokens_per_mb=args.flat_max_tokens_per_mb or args.max_tokens_per_mb,
                               packing_algorithm="kk")
    rows: dict[str, dict] = {}
    with apply_compat_patches(), cpu_mode(), tempfile.TemporaryDirectory() as tmp:
        init_one_process(cuda)
        path = save_hf_config(arch, os.path.join(tmp, "hf"), **overrides)
        hf_config = AutoConfig.from_pretrained(path)
        # With TE the flat baseline is Megatron's sequence packing: the upstream model, each sequence
        # a THD segment through cuDNN fused attention. Without TE, or where TE's THD backward is wrong
        # (thd_backward_refusal: head dim 256), flat micro-batches run through the tree model's own kernel
        # (each sequence its own chain), on the same model as the tree steps.
        te = cuda and have_transformer_engine()
        refusal = te and thd_backward_refusal(attention_head_dim(hf_config))
        if refusal:
            print(f"e2e_bench: flat baseline tree_kernel_chains, not te_thd_cudnn: {refusal}", flush=True)
            te = False
        baseline = "te_thd_cudnn" if te else "tree_kernel_chains"
        vocab = hf_config.vocab_size
        per_token, per_pair = flops_per_token_and_pair(hf_config)
        # Workload by workload, flat then tree; the mode order alternates so that, with TE (one
        # model per mode), consecutive runs share a model: flat tree | tree flat | flat tree ...
        model = optimizer = built = None
        for i, name in enumerate(args.workloads.split(",")):
            seqs = workloads(name, np.random.default_rng(0), vocab, args.scale)
            row = rows.setdefault(name, workload_row(args, name, seqs, per_token, per_pair, baseline))
            modes = [m for m in (("flat", "tree") if i % 2 == 0 else ("tree", "flat")) if m in args.modes.split(",")]
            for mode in modes:
                tree_model = mode == "tree" or not te
                if built != tree_model:
                    model = optimizer = None
                    gc.collect()
                    torch.cuda.empty_cache() if cuda else None
                    model, optimizer = build(path, tree=tree_model, bf16=cuda, recompute=args.recompute, cuda=cuda,
                                             backend=args.attention_backend, lr=args.lr)
                    built = tree_model
                run = flat_forward_backward if mode == "flat" and te else tree_forward_backward
                mbs = pack_trees(seqs, spec if mode == "tree" else flat_spec, share_prefixes=mode == "tree",
                                 pad_to_multiple_of=128)
                try:
                    timed = timed_steps(model, optimizer, mbs, loss_fn, run, args.warmup, args.steps)
                except FloatingPointError as e:
                    kind = baseline if mode == "flat" else "tree"
                    raise SystemExit(f"e2e_bench: {args.model}, workload {name}, {mode} mode ({kind}): {e}; no row for "
                                     f"it") from e
                times = timed.times
                step_s = statistics.median(times)
                computed_tokens, computed_pairs = packed_work(mbs)
                flops = row["flops_flat"] if mode == "flat" else row["flops_tree"]
                row[mode] = dict(step_s=step_s, step_times=times, step_spread=spread(times),
                                 optimizer_s=statistics.median(timed.optimizer_times),
                                 tokens_per_s=row["original_tokens"] / step_s, peak_mem_gib=timed.peak_gib,
                                 cuda_mallocs=timed.cuda_mallocs, alloc_retries=timed.alloc_retries,
                                 micro_batches=len(mbs), max_mb_slots=max(mb.num_slots for mb in mbs),
                                 computed_tokens=computed_tokens, computed_pairs=computed_pairs,
                                 recomputed_tokens=PackingStats.of(mbs).recomputed_tokens,
                                 recomputed_pairs=packed_work([mb for mb in mbs if mb.reruns_forward])[1],
                                 tflops_per_s=flops / step_s / 1e12)
                if args.profile:
                    profiles = [profile_step(lambda: train_step(model, optimizer, mbs, loss_fn, run))
                                for _ in range(args.profile_steps)]
                    row[mode]["profile"] = profiles[0]
                    if args.profile_steps > 1:
                        row[mode]["profiled_steps"] = [profiled_step_summary(p) for p in profiles]
                if args.host_profile:
                    host_profile(lambda: train_step(model, optimizer, mbs, loss_fn, run),
                                 f"{os.path.splitext(args.out)[0]}.host_{name}_{mode}.txt")
                write(args.out, rows, baseline)  # after every run: a cut-short run keeps its rows
            if "flat" not in row or "tree" not in row:
                for m in modes:
                    print(f"{args.model} {name:10s} {m}={row[m]['step_s']*1e3:.0f}ms/{row[m]['tflops_per_s']:.0f}TF/"
                          f"{row[m]['peak_mem_gib'] or 0:.1f}GiB", flush=True)
                write(args.out, rows, baseline)
                continue
            finish_row(row, per_token, per_pair)
            print(f"{args.model} {name:10s} ratio={row['token_ratio']:.3f} ideal={row['flop_ideal_speedup']:.2f}x "
                  f"speedup={row['speedup']:.2f}x achieved={row['achieved_fraction_of_ideal']:.2f} "
                  f"flat={row['flat']['step_s']*1e3:.0f}ms/{row['flat']['tflops_per_s']:.0f}TF/"
                  f"{row['flat']['peak_mem_gib'] or 0:.1f}GiB "
                  f"tree={row['tree']['step_s']*1e3:.0f}ms/{row['tree']['tflops_per_s']:.0f}TF/"
                  f"{row['tree']['peak_mem_gib'] or 0:.1f}GiB "
                  f"spread={row['flat']['step_spread']:.3f}/{row['tree']['step_spread']:.3f}", flush=True)
            for m in ("flat", "tree") if args.profile else ():
                print(f"  {m} profile: {json.dumps(row[m]['profile'])}", flush=True)
            write(args.out, rows, baseline)

def write(out: str, rows: dict, baseline: str) -> None:
    """The results so far as JSON: device, torch version, the flat baseline's kind, the MoE experts' grouped GEMM
    (``"cutlass"`` where ``NVTE_USE_CUTLASS_GROUPED_GEMM`` is on, as the model build turns it on for bf16 MoE on
    Hopper; else ``"cublas"``), one row per workload."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    grouped_gemm = "cutlass" if cutlass_grouped_gemm_on() else "cublas"
    with open(out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "baseline": baseline, "grouped_gemm": grouped_gemm,
                   "rows": list(rows.values())}, f, indent=1)


def workload_row(args, name: str, seqs, per_token: float, per_pair: float, baseline: str) -> dict:
    """The mode-independent part of a result row: sizes, token ratio and the FLOP ideal on the global trie."""
    forest = build_forest(as_sequences(seqs))
    lens = np.array([len(s) for s in seqs], dtype=np.float64)
    original, unique = float(lens.sum()), float(forest.num_tokens)
    flat_pairs = float((lens * (lens + 1) / 2).sum())
    tree_pairs = float((forest.depth + 1).sum())
    flops_flat = per_token * original + per_pair * flat_pairs
    flops_tree = per_token * unique + per_pair * tree_pairs
    return dict(model=args.model, workload=name, baseline=baseline, sequences=len(seqs), original_tokens=int(original),
                unique_tokens=int(unique), token_ratio=unique / original, flat_pairs=flat_pairs, tree_pairs=tree_pairs,
                flops_flat=flops_flat, flops_tree=flops_tree, flop_ideal_speedup=flops_flat / flops_tree,
                max_tokens_per_mb=args.max_tokens_per_mb, recompute=args.recompute,
                attention_backend=args.attention_backend, chunk_trees=args.chunk_trees,
                max_kept_tokens=args.max_kept_tokens,
                flat_max_tokens_per_mb=args.flat_max_tokens_per_mb or args.max_tokens_per_mb)


def packed_flops(tree: dict, per_token: float, per_pair: float) -> float:
    """FLOPs of the trees as packed (a row's ``tree`` counts): a tree split over micro-batches computes its shared
    prefix once per part; a chunk run again adds its forward, a third of its forward and backward."""
    return (per_token * (tree["computed_tokens"] + tree["recomputed_tokens"] / 3)
            + per_pair * (tree["computed_pairs"] + tree["recomputed_pairs"] / 3))


def finish_row(row: dict, per_token: float, per_pair: float) -> None:
    """Speedup, achieved fraction and the ideal of the trees as packed: flat FLOPs / :func:`packed_flops`."""
    tree = row["tree"]
    row["packed_flop_ideal_speedup"] = row["flops_flat"] / packed_flops(tree, per_token, per_pair)
    row["speedup"] = row["flat"]["step_s"] / row["tree"]["step_s"]
    row["achieved_fraction_of_ideal"] = row["speedup"] / row["flop_ideal_speedup"]


if __name__ == "__main__":
    main()

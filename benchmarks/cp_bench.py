"""One long multi-turn tree per step under context parallel: CP = world size (torchrun), one run per size.

    torchrun --nproc-per-node 1 benchmarks/cp_bench.py --model qwen3-0.6b --slots 65536,131072 --out cp.json
    torchrun --nproc-per-node 2 benchmarks/cp_bench.py --model qwen3-0.6b --slots 65536,131072 --out cp.json
    torchrun --nproc-per-node 2 benchmarks/cp_bench.py --model tiny --slots 512 --out /tmp/cp.json   # CPU smoke

Workload: one agent conversation of about ``slots`` unique tokens (a system prompt, then turns
that each extend the previous context, a quarter of them forking from an earlier turn), every turn
a training sequence: one tree, one micro-batch. Each run trains ``--warmup`` + ``--steps`` steps
(Megatron's forward-backward + Adam) of a random-init bf16 model and records per size: median step
time, peak memory per GPU (``torch.cuda.max_memory_allocated``), the per-rank attention work (query,
key pairs) and tokens of the CP layout, model TFLOP/s per GPU (linear layers by unique tokens,
attention by visible pairs), or ``"oom"``. Rows are appended to ``--out`` (JSON), keyed by
(model, cp, recompute, slots); ``--plot`` redraws the PNG from it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile

import numpy as np
import torch

from e2e_bench import MODELS, build, flops_per_token_and_pair, loss_fn, timed_steps

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.core.flops import micro_batch_work
from megatron_tree.core.context_parallel import padded_slots, shard_micro_batch, slot_multiple
from megatron_tree.core.synthetic import multi_turn_batch


def long_conversation(rng: np.random.Generator, slots: int, vocab: int) -> list[np.ndarray]:
    """One conversation of about ``slots`` unique tokens: 5% system prompt, 24 turns."""
    turn = max(1, round(slots * 0.95 / 24))
    return multi_turn_batch(rng, n_conversations=1, turns=(24, 24), turn_len=(turn // 2, turn * 3 // 2),
                            fork_prob=0.25, system_len=max(1, slots // 20), vocab=vocab)  # fmt: skip


def run_size(model, optimizer, cfg, slots: int, cp: int, args, cuda: bool) -> dict:
    from megatron_tree.mcore.schedule import tree_forward_backward

    seqs = long_conversation(np.random.default_rng(slots), slots, cfg.vocab_size)
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=2 * slots))
    assert len(mbs) == 1
    mb = mbs[0]
    per_token, per_pair = flops_per_token_and_pair(cfg)
    pairs = micro_batch_work(mb)[1]
    padded = mb.padded_to(padded_slots(mb.num_slots, slot_multiple(cp=cp)))
    shard = shard_micro_batch(padded, cp, 0)
    row = dict(model=args.model, cp=cp, recompute=args.recompute, slots=slots, unique_tokens=mb.num_tokens,
               original_tokens=mb.num_original_tokens, sequences=len(seqs), pairs=pairs,
               rank_pairs=shard.pairs, rank_tokens=shard.tokens,
               pair_imbalance=max(shard.pairs) / (sum(shard.pairs) / cp),
               token_imbalance=max(shard.tokens) / (sum(shard.tokens) / cp))  # fmt: skip
    try:
        timed = timed_steps(model, optimizer, mbs, loss_fn, tree_forward_backward, args.warmup, args.steps)
    except torch.OutOfMemoryError as exc:  # one process (CP = 1) only: ranks of a group would hang
        row["result"] = "oom"
        row["error"] = str(exc).splitlines()[0][:200]
        return row
    peaks = [None] * cp
    torch.distributed.all_gather_object(peaks, timed.peak_gib, group=None)
    step = statistics.median(timed.times)
    row.update(result="ok", step_s=step, step_spread_s=[min(timed.times), max(timed.times)], peak_mem_gib=peaks,
               tflops_per_gpu=(mb.num_tokens * per_token + pairs * per_pair) / step / cp / 1e12)  # fmt: skip
    return row


def merge(out: str, rows: list[dict]) -> list[dict]:
    old = json.load(open(out))["rows"] if os.path.exists(out) else []
    key = lambda r: (r["model"], r["cp"], r["recompute"], r["slots"])  # noqa: E731
    new = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in new] + rows
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": merged},
                  f, indent=1)
    return merged


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r["model"], r["slots"], r["cp"], r["recompute"]))
    labels = [f"{r['model']}\n{r['unique_tokens'] / 1000:.0f}k tokens\nCP={r['cp']} recompute={r['recompute']}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(2.2 * len(rows) + 2, 4))
    x = range(len(rows))
    a.bar(x, [r.get("step_s", 0) for r in rows], color=["tab:red" if r["result"] == "oom" else "tab:blue" for r in rows])
    for i, r in enumerate(rows):
        a.text(i, r.get("step_s", 0), "OOM" if r["result"] == "oom" else f"{r['step_s']:.1f}s", ha="center", va="bottom")
    a.set_ylabel("step time, s")
    b.bar(x, [max(m or 0 for m in r.get("peak_mem_gib") or [0]) for r in rows])
    b.axhline(140, color="gray", ls="--", lw=1)
    b.set_ylabel("peak memory per GPU, GiB (OOM: not reached)")
    for ax in (a, b):
        ax.set_xticks(list(x), labels, fontsize=7)
    fig.suptitle("one long multi-turn tree per step, context parallel over H200s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    ap.add_argument("--slots", default="65536,131072", help="comma-separated tree sizes (unique tokens)")
    ap.add_argument("--recompute", default="none", choices=["none", "full", "selective"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", help="write a PNG of every row in --out")
    args = ap.parse_args()

    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.runtime import cpu_mode, save_hf_config
    from megatron_tree.train.config import ParallelConfig
    from megatron_tree.train.trainer import init_distributed

    cuda = torch.cuda.is_available()
    cp = int(os.environ.get("WORLD_SIZE", 1))
    with apply_compat_patches(), cpu_mode():
        init_distributed(ParallelConfig(cp=cp), seed=1, cuda=cuda)
        arch, overrides = MODELS[args.model]
        ckpt = os.path.join(tempfile.gettempdir(), f"cp_bench_{args.model}")
        save_hf_config(arch, ckpt, **overrides)  # rank 0 writes, then a barrier
        model, optimizer = build(ckpt, tree=True, bf16=cuda, recompute=args.recompute, cuda=cuda)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(ckpt)
        rows = []
        for slots in (int(s) for s in args.slots.split(",")):
            row = run_size(model, optimizer, cfg, slots, cp, args, cuda)
            rows.append(row)
            if torch.distributed.get_rank() == 0:
                print("CPBENCH " + json.dumps(row), flush=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if torch.distributed.get_rank() == 0:
            merged = merge(args.out, rows)
            if args.plot:
                plot(merged, args.plot)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

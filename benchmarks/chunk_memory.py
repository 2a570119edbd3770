"""Slots a chunked run keeps at once, on the CPU: the e2e benchmark's batches packed with
``MicroBatchSpec(chunk_trees=True, max_kept_tokens=...)``, each schedule step driven by
``chunk_schedule.run_chunked_tree`` with a stand-in model (one scalar per chunk), counting the slots of the chunks
whose graphs are alive (forward done, backward not yet; the chunk in flight included) at every forward. A proxy for the
activation memory of a chunked step; chunks beyond ``max_kept_tokens`` keep only their exported keys and values
and run their forward again before their backward (``recomputed_tokens``, ``extra_forward``: those over the unique
tokens, the share of forwards run twice). Next to it, the slots of the flat step's largest micro-batch at the same
size (``flat_micro_batch_slots``: ``max_tokens_per_mb``, or the longest sequence where that is longer: a flat step
cannot cut a sequence) and their ratio (``kept_vs_flat``).

The cost of the forwards run twice, at a model's shape (``--model``, one of ``e2e_bench.MODELS``): their FLOPs
(tokens and computed (query, key) pairs, as e2e_bench counts them) over the step's (``extra_forward_flops``), and the
fewest any choice of chunks to run again could spend under the same budget (``fewest_extra_forward_flops``: every
subset of each tree's chunks tried, trees of at most 16 chunks; None beyond).

    python benchmarks/chunk_memory.py --out benchmarks/results/chunk_memory.json
"""

import argparse
import json
from types import SimpleNamespace

import numpy as np
import torch
from e2e_bench import MODELS, flops_per_token_and_pair, workloads
from transformers import AutoConfig

from megatron_tree import MicroBatchSpec, PackingStats, pack_trees
from megatron_tree.core.chunks import released_after
from megatron_tree.core.flops import micro_batch_work
from megatron_tree.mcore.chunk_schedule import ChunkedTree, release_chunks, run_chunked_tree
from megatron_tree.mcore.schedule import schedule_steps

CONFIG = SimpleNamespace(num_moe_experts=None, grad_scale_func=None, no_sync_func=None)
KEPT = {"all": 2**62, "default": None, "0": 0}
"""``--max-kept`` names: keep every waiting chunk's graph, ``max_kept_tokens=None`` (``max_tokens_per_mb``), 0."""


def kept_slots(chunks) -> int:
    """Most slots of graphs alive at once in one step of ``chunks`` (a run of a tree larger than a micro-batch)."""
    weight = torch.ones((), requires_grad=True)
    alive, peak = {}, 0

    def forward(mb, mask):
        nonlocal peak
        out = weight * mb.input_ids.float().sum()
        if out.requires_grad:  # not a recomputed chunk's first forward
            alive[mb.chunk.index] = mb.num_tokens
            out.register_hook(lambda g, i=mb.chunk.index: alive.pop(i) and None)
        peak = max(peak, sum(alive.values()))
        return out

    def loss_func_for(mb):
        return lambda out, non_loss_data=False: (out, torch.tensor(1), {"loss": out.detach()[None]})

    output, loss_func = run_chunked_tree(ChunkedTree(chunks), forward, loss_func_for, CONFIG, train=True)
    loss_func(output)[0].backward()
    release_chunks()
    return peak


def fewest_extra_flops(chunks, forward_flops: np.ndarray, max_kept: int) -> float | None:
    """The least forward FLOPs a choice of ``chunks`` (one tree, stack order) to run again can spend while the waiting
    chunks keep at most ``max_kept`` slots at every forward (``recompute_plan``'s constraint); None past 16 chunks."""
    k = len(chunks)
    if k > 16:
        return None
    slots = np.array([mb.num_tokens for mb in chunks])
    release = released_after(np.array([mb.chunk.last_reader for mb in chunks]))
    c, i = np.arange(k)[:, None], np.arange(k)[None, :]
    waiting = (i < c) & (release[None, :] >= c)  # [forward c, chunk i]
    again = (np.arange(2**k)[:, None] >> np.arange(k)) & 1  # every subset, [2^k, k]
    kept = ((1 - again) * slots) @ waiting.T  # [2^k, forward]
    fits = (kept <= max_kept).all(axis=1)
    return float((again[fits] @ forward_flops).min())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="grpo,long_multi_turn")
    ap.add_argument("--caps", default="8192,16384")
    ap.add_argument("--max-kept", default="all,default,0", help=f"comma-separated, of {list(KEPT)} or ints")
    ap.add_argument("--model", default="qwen3-1.7b", help="the shape whose FLOPs price the forwards run twice")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    arch, overrides = MODELS[args.model]
    per_token, per_pair = flops_per_token_and_pair(AutoConfig.for_model(arch, **overrides))
    rows = []
    for name in args.workloads.split(","):
        seqs = workloads(name, np.random.default_rng(0), 151936)
        longest = max(map(len, seqs))
        for cap in map(int, args.caps.split(",")):
            for kept_name in args.max_kept.split(","):
                max_kept = KEPT[kept_name] if kept_name in KEPT else int(kept_name)
                mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=cap, chunk_trees=True, packing_algorithm="kk",
                                                      max_kept_tokens=max_kept))
                chunks = [mb for mb in mbs if mb.chunk]
                stats = PackingStats.of(mbs)
                runs = schedule_steps(mbs)
                steps = [kept_slots(s) if isinstance(s, list) else s.num_tokens for s in runs]
                forwards = {id(mb): (per_token * work[0] + per_pair * work[1]) / 3
                            for mb, work in ((mb, micro_batch_work(mb)) for mb in mbs)}
                step_flops = 3 * sum(forwards.values())  # forward and backward of every computed token and pair
                extra, fewest = 0.0, 0.0
                for run in (s for s in runs if isinstance(s, list)):
                    forward = np.array([forwards[id(mb)] for mb in run])
                    extra += float(forward[[mb.reruns_forward for mb in run]].sum())
                    least = fewest_extra_flops(run, forward, cap if max_kept is None else max_kept)
                    fewest = None if fewest is None or least is None else fewest + least
                rows.append(dict(workload=name, max_tokens_per_mb=cap, max_kept_tokens=kept_name,
                                 micro_batches=len(mbs), chunks=len(chunks),
                                 chunks_exporting_nothing=sum(mb.export_slots is None or mb.export_slots.numel() == 0
                                                              for mb in chunks),
                                 chunks_recomputed=sum(mb.reruns_forward for mb in chunks),
                                 recomputed_tokens=stats.recomputed_tokens,
                                 extra_forward=round(stats.recomputed_tokens / stats.tree_tokens, 3),
                                 extra_forward_flops=round(extra / step_flops, 4),
                                 fewest_extra_forward_flops=None if fewest is None else round(fewest / step_flops, 4),
                                 kept_slots_per_step=steps, max_kept_slots=max(steps),
                                 longest_sequence=longest, flat_micro_batch_slots=max(cap, longest),
                                 kept_vs_flat=round(max(steps) / max(cap, longest), 3)))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "kept_slots_per_step"}))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

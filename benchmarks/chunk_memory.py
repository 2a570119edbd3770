"""Slots a chunked run keeps at once, on the CPU: the e2e benchmark's batches packed with
``MicroBatchSpec(chunk_trees=True)``, each schedule step driven by ``chunk_schedule.run_chunked_tree`` with a
stand-in model (one scalar per chunk), counting the slots of the chunks whose activations are alive (forward done,
backward not yet) after every forward. A proxy for the activation memory of a chunked step. Next to it, the slots of
the flat step's largest micro-batch at the same size (``flat_micro_batch_slots``: ``max_tokens_per_mb``, or the
longest sequence where that is longer: a flat step cannot cut a sequence) and their ratio (``kept_vs_flat``).

    python benchmarks/chunk_memory.py --out benchmarks/results/chunk_memory.json
"""

import argparse
import json
from types import SimpleNamespace

import numpy as np
import torch
from e2e_bench import workloads

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.mcore.chunk_schedule import ChunkedTree, release_chunks, run_chunked_tree
from megatron_tree.mcore.schedule import schedule_steps

CONFIG = SimpleNamespace(num_moe_experts=None, grad_scale_func=None, no_sync_func=None)


def kept_slots(chunks) -> int:
    """Most slots alive at once in one step of ``chunks`` (a run of a tree larger than a micro-batch)."""
    weight = torch.ones((), requires_grad=True)
    alive, peak = {}, 0

    def forward(mb, mask):
        nonlocal peak
        alive[mb.chunk.index] = mb.num_tokens
        peak = max(peak, sum(alive.values()))
        out = weight * mb.input_ids.float().sum()
        out.register_hook(lambda g, i=mb.chunk.index: alive.pop(i) and None)
        return out

    def loss_func_for(mb):
        return lambda out, non_loss_data=False: (out, torch.tensor(1), {"loss": out.detach()[None]})

    output, loss_func = run_chunked_tree(ChunkedTree(chunks), forward, loss_func_for, CONFIG, train=True)
    loss_func(output)[0].backward()
    release_chunks()
    return peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="grpo,long_multi_turn")
    ap.add_argument("--caps", default="8192,16384")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for name in args.workloads.split(","):
        seqs = workloads(name, np.random.default_rng(0), 151936)
        longest = max(map(len, seqs))
        for cap in map(int, args.caps.split(",")):
            mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=cap, chunk_trees=True, packing_algorithm="kk"))
            chunks = [mb for mb in mbs if mb.chunk]
            steps = [kept_slots(s) if isinstance(s, list) else s.num_tokens for s in schedule_steps(mbs)]
            rows.append(dict(workload=name, max_tokens_per_mb=cap, micro_batches=len(mbs), chunks=len(chunks),
                             chunks_exporting_nothing=sum(mb.export_slots is None or mb.export_slots.numel() == 0
                                                          for mb in chunks),
                             kept_slots_per_step=steps, max_kept_slots=max(steps),
                             longest_sequence=longest, flat_micro_batch_slots=max(cap, longest),
                             kept_vs_flat=round(max(steps) / max(cap, longest), 3)))
            print(json.dumps(rows[-1]))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

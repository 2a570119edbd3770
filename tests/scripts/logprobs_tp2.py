"""TP=2 check of gather_tree_logprobs over gloo: values, entropy and grads of each vocab
shard vs the full-vocab per-sequence reference; a constant number of all-reduces per call
(3 forward, 0 backward); both ranks raising on inconsistent shards.

Run: torchrun --standalone --nproc-per-node 2 tests/scripts/logprobs_tp2.py
Exit status 1 on any mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from logprobs_reference import BATCHES, compare, micro_batches

from megatron_tree.ops.logprobs import gather_tree_logprobs

TOL = 1e-5


def count_all_reduces(group: dist.ProcessGroup) -> tuple[int, int]:
    """All-reduces in one forward and one backward on a wide tree (40 sequences)."""
    seqs = [[1, 2, 3] + [k % 7, (k * 3) % 5, 4] for k in range(40)]
    (mb,) = micro_batches(seqs, max_tokens=512)
    logits = torch.randn(1, mb.num_slots, 7, requires_grad=True)
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        lp, ent = gather_tree_logprobs(logits, mb, tp_group=group, temperature=0.8, with_entropy=True, chunk_rows=4)
        forward = len(calls)
        (lp.sum() + ent.sum()).backward()
    finally:
        dist.all_reduce = original
    return forward, len(calls) - forward


def shard_mismatch_raises(group: dist.ProcessGroup, rank: int) -> bool:
    """Rank 0 passes 7 vocab columns, rank 1 passes 6: every rank must raise ValueError."""
    (mb,) = micro_batches(BATCHES["grpo"], max_tokens=512)
    logits = torch.randn(1, mb.num_slots, 7 - rank)
    try:
        gather_tree_logprobs(logits, mb, tp_group=group)
    except ValueError as err:
        return "vocab shards differ" in str(err)
    return False


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    failures = []
    for name, seqs in BATCHES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for temperature, chunk_rows in ((0.7, 5), (1.6, None)):
                errs = compare(
                    seqs, max_tokens=24, vocab=14, temperature=temperature, dtype=dtype, seed=7,
                    tp_group=group, chunk_rows=chunk_rows,
                )  # fmt: skip
                limits = {"logprobs": TOL, "entropy": TOL}
                if dtype == torch.float32:
                    limits.update(grad=TOL, grad_lp_only=TOL, grad_ent_only=TOL)
                else:
                    limits.update(grad_vs_plain=2.0)
                errs = {k: errs[k] for k in limits}
                bad = {k: v for k, v in errs.items() if not v <= limits[k]}
                print(f"rank {rank} {name} {dtype} T={temperature} chunk={chunk_rows}: {errs}", flush=True)
                if bad:
                    failures.append(f"{name} {dtype} T={temperature}: {bad}")
    forward, backward = count_all_reduces(group)
    print(f"rank {rank} all-reduces: forward {forward}, backward {backward}", flush=True)
    if (forward, backward) != (3, 0):
        failures.append(f"all-reduces forward {forward} (want 3), backward {backward} (want 0)")
    if not shard_mismatch_raises(group, rank):
        failures.append("inconsistent vocab shards did not raise ValueError on this rank")
    dist.barrier()
    dist.destroy_process_group()
    for failure in failures:
        print(f"rank {rank} FAIL {failure}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

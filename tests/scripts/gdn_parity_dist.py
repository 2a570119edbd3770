"""Multi-process parity of hybrid Gated DeltaNet models (Qwen3.5, Qwen3-Next) on trees (gloo, CPU, fp32).

Run: torchrun --standalone --nproc-per-node 2 tests/scripts/gdn_parity_dist.py WORK_DIR CASE...
with CASE = ``<tp|ep|pp>2:<arch>:<mode>``, mode a recompute granularity (``none`` / ``full`` / ``selective``),
``forward`` (log-probs only) or ``chunks``. On ``recurrent_forest``:

- tp / ep: tree log-probs (the model called directly) vs Hugging Face per sequence in fp64 (< 1e-5); unless
  ``forward``, this rank's gradients of a weighted log-prob sum vs the flat model run per sequence (relative
  < 1e-5; A_log / dt_bias < 3e-5, see test_gated_delta_net_parity.py); at TP, ``export_weights`` gives back the
  checkpoint's tensors exactly (the GDN projections and conv are split per component across ranks).
- pp: through megatron-core's pipeline schedule: ``tree_forward_only`` log-probs vs HF in fp64, and
  ``verify_tree_model``'s gradient check (its own branching batch packed as trees vs each sequence alone, same
  model; ``||g_tree - g_seq|| / ||g_seq||`` per tensor, < 1e-5).
- chunks (tp): ``gdn_chunk_batch`` in chunks of 16 slots (every sequence longer) through the schedule: the recurrent
  states cross the chunks on each rank's heads; ``tree_forward_only`` log-probs vs HF in fp64, this rank's gradients of
  a ``tree_forward_backward`` step vs the flat model run per sequence (as tp / ep; < 2e-5: this batch's whole tree in
  one micro-batch is itself 1.4e-5 off at TP=2, the chunks 1.1e-5, the recurrent layers' fp32 rounding).

Rank 0 prints ``CASE logprob=... grad=...``; exit status 1 when a check fails on any rank. MoE with TP > 1 needs
sequence parallel, which the local spec lacks: Qwen3-Next runs at EP and PP.
"""

from __future__ import annotations

import os
import sys

import torch
from scripts.parity_common import (
    chunked_step,
    flat_logprobs,
    gdn_chunk_batch,
    hf_logprobs_fp64,
    max_diff,
    micro_batches,
    param_grads,
    recurrent_forest,
    relative_grad_error,
    run_dist_cases,
    tree_and_flat_backward,
    tree_logprobs,
    weighted_sum,
)

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.mcore.bridge import build_model
from megatron_tree.mcore.forward_only import tree_forward_only
from megatron_tree.mcore.verify import verify_tree_model
from megatron_tree.runtime import init_cpu_distributed, save_tiny_hf_checkpoint

TOL = 1e-5
_DECAY = ("self_attention.A_log", "self_attention.dt_bias")


def _build(path, *, tree, recompute="none"):
    return build_model(path, tree=tree, recompute=recompute, wrap_with_ddp=False)


def _grad_error(got: dict, want: dict) -> float:
    decay = {n for n in want if n.endswith(_DECAY)}
    rest = want.keys() - decay
    return max(relative_grad_error({n: got[n] for n in rest}, {n: want[n] for n in rest}),
               relative_grad_error({n: got[n] for n in decay}, {n: want[n] for n in decay}) / 3)


def _export_error(bridge, chunks, path) -> float:
    from safetensors.torch import load_file

    want = load_file(os.path.join(path, "model.safetensors"))
    got = dict(bridge.export_weights(chunks))
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[k].cpu() - want[k]).abs().max().item() for k in want)


def run_case(case: str, work_dir: str) -> tuple[float, float]:
    kind, arch, mode = case.split(":")
    init_cpu_distributed(**{kind[:2]: int(kind[2:])})
    path = save_tiny_hf_checkpoint(arch, os.path.join(work_dir, f"{kind}_{arch}"))
    if mode == "chunks":
        return _chunks_case(path)
    seqs = recurrent_forest()
    mbs = micro_batches(seqs, max_tokens=96)
    want = hf_logprobs_fp64(path, seqs)
    if kind.startswith("pp"):
        chunks = _build(path, tree=True, recompute=mode)[1]
        got = tree_forward_only(chunks, mbs)
        lp_err = max_diff(dict(enumerate(got)), want)
        return lp_err, verify_tree_model(chunks, raise_on_mismatch=False).grad_error
    bridge, chunks = _build(path, tree=True, recompute="none" if mode == "forward" else mode)
    tree = chunks[0]
    if mode == "forward":
        with torch.no_grad():
            return max_diff(tree_logprobs(tree.eval(), mbs), want), 0.0
    export_err = _export_error(bridge, chunks, path) if kind.startswith("tp") else 0.0
    assert export_err == 0.0, f"export_weights differs from the checkpoint by {export_err}"
    flat = _build(path, tree=False)[1][0].train()
    tree.train()
    tree_lp, _ = tree_and_flat_backward(tree, flat, seqs, mbs)
    return max_diff(tree_lp, want), _grad_error(param_grads(tree), param_grads(flat))


def _chunks_case(path: str) -> tuple[float, float]:
    seqs = gdn_chunk_batch()
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=16, chunk_trees=True))
    chunks = _build(path, tree=True)[1]
    with torch.no_grad():
        lp = dict(enumerate(tree_forward_only(chunks, mbs)))
    flat = _build(path, tree=False)[1][0].train()
    weighted_sum(flat_logprobs(flat, seqs)).backward()
    return max_diff(lp, hf_logprobs_fp64(path, seqs)), _grad_error(chunked_step(chunks[0].train(), mbs, seqs),
                                                                   param_grads(flat))


def main() -> int:
    return run_dist_cases(run_case, sys.argv[1], sys.argv[2:], lambda case: 2 * TOL if case.endswith(":chunks") else TOL)


if __name__ == "__main__":
    sys.exit(main())

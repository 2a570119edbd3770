"""Where a tree step waits on the GPU: every host sync of forward-only log-probs and a training step, by call site.

One process on the GPU: a tiny Qwen3 (bf16, head dim 128: FA4 where installed), a GRPO-like batch packed in chunks smaller than its trees (so the chunk
schedule, the context keys and values and the recomputed forwards all run) and, for comparison, in whole-tree
micro-batches; a warm-up pass of each, then both passes again under CUDA's sync debug mode ("warn"), every warning
recorded with the Python line that made the synchronising call. Prints ``SYNC <path>:<line> <calls>`` per call site
(paths from the package root: ``megatron_tree/...``, ``megatron/core/...``) and ``SYNCS_DONE``.

    python tests/scripts/host_syncs.py --ckpt /tmp/ck_syncs
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import warnings
from pathlib import Path

import numpy as np
import torch
from parity_common import VOCAB, build_model

import megatron.core
import megatron_tree
from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.compat import apply_compat_patches
from megatron_tree.mcore.forward_only import tree_forward_only
from megatron_tree.mcore.schedule import tree_forward_backward
from megatron_tree.runtime import init_distributed, save_tiny_hf_checkpoint

PACKAGE_ROOTS = sorted({Path(package.__file__).resolve().parents[depth]
                        for package, depth in ((megatron_tree, 1), (megatron.core, 2), (torch, 1))},
                       key=lambda root: len(root.parts), reverse=True)
"""The folders holding megatron_tree (the repository root), megatron and torch (site-packages), the deepest first: a
virtual environment inside the repository is read from its site-packages."""


def batch(vocab: int) -> list[list[int]]:
    """Two prompts of 40 and 60 tokens, four samples each of 20-80 tokens."""
    rng = np.random.default_rng(0)
    seqs = []
    for plen in (40, 60):
        prompt = rng.integers(1, vocab, plen).tolist()
        seqs += [prompt + rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(20, 80, 4)]
    return seqs


def loss_fn(logprobs, mb):
    """A sum of the log-probs and a host count (the schedule makes it a device scalar)."""
    return logprobs.sum(), sum(mb.target_counts)


def steps(model, packs) -> None:
    for mbs in packs:
        with torch.no_grad():
            tree_forward_only([model], mbs)
        tree_forward_backward([model], mbs, loss_fn)


def short(path: str) -> str:
    """``path`` from the folder that holds its package: ``megatron_tree/...`` (or ``tests/...``, beside it),
    ``megatron/core/...``, ``torch/...``; any other path as it is. By the imported packages' own folders, not by the
    names in the path (a checkout under ``/opt/torch/...`` still reads ``megatron_tree/...``)."""
    file = Path(path).resolve()
    for root in PACKAGE_ROOTS:
        if file.is_relative_to(root):
            return str(file.relative_to(root))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    args = ap.parse_args()
    with apply_compat_patches():
        init_distributed()
        # head dim 128, two query heads per K/V head: a shape FA4 is proven on, so "auto" runs it where it is installed
        path = save_tiny_hf_checkpoint("qwen3", args.ckpt, head_dim=128)
        model = build_model(path, tree=True, bf16=True)[0].train()
        model.config.finalize_model_grads_func = lambda *a, **k: None
        seqs = batch(VOCAB)
        packs = [pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=48, chunk_trees=True, max_kept_tokens=48)),
                 pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=512))]
        assert len(packs[0]) > 4 and all(mb.chunk for mb in packs[0])
        steps(model, packs)  # warm-up: compiled kernels
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                steps(model, [[dataclasses.replace(mb) for mb in pack] for pack in packs])  # new objects: moved again
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sites = collections.Counter(f"{short(w.filename)}:{w.lineno}" for w in caught if "synchronizing" in str(w.message))
        for site, calls in sorted(sites.items()):
            print(f"SYNC {site} {calls}")
        print("SYNCS_DONE")


if __name__ == "__main__":
    main()

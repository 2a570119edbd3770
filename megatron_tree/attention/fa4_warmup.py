"""Compile the FA4 tree kernels ahead, in a helper process, while the job builds its models.

A job's first FA4 call compiles its kernels (CuTe DSL: seconds each; forward, backward, and the forward without a
log-sum-exp that forward-only passes run). flash-attn-4 keeps them in its persistent cache when
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` (the launcher turns it on; file-locked, written by rename, so processes
share it safely); a helper process that runs the kernels once on a small branching tree fills that cache while the
job is still building its models and loading weights, and the first step loads them from it.

    python -m megatron_tree.attention.fa4_warmup --heads 16 --kv-heads 8 --head-dim 128 [--query-slots]

compiles, on the current CUDA device (``--device``), the kernels of one attention shape per rank (query heads, key /
value heads and head dims per tensor-parallel rank, bf16): forward without grad, forward + backward; with
``--query-slots`` also the query-slot mask's (the chunks of trees larger than a micro-batch, context parallel). It
prints one JSON line (``compiled_s`` per mask kind, or ``skipped`` with the reason: FA4 does not run here or is not
proven on the shape, nothing to compile) and exits 0.

:func:`start_fa4_warmup` starts it from a job; :meth:`FA4Warmup.wait` joins it before the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass

import numpy as np
import torch

from megatron_tree.core.tree import build_forest

__all__ = ["FA4Warmup", "start_fa4_warmup", "warm_up"]

CACHE_VARIABLE = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


def _branching_tree(prompt: int, samples: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``subtree_end`` int32 [1, T] of one prompt and its samples (T = prompt + sum(samples)), by the packer's
    :func:`~megatron_tree.core.tree.build_forest`."""
    shared = np.arange(prompt)
    forest = build_forest([np.concatenate([shared, np.full(n, prompt + i)]) for i, n in enumerate(samples)])
    return torch.from_numpy(forest.subtree_end).to(device, torch.int32).unsqueeze(0)


def warm_up(heads: int, kv_heads: int, head_dim: int, v_head_dim: int, *, query_slots: bool,
            device: torch.device) -> dict:
    """Run the FA4 tree kernels of this shape once (module docstring); returns ``{"compiled_s": {kind: s}}`` or
    ``{"skipped": reason}``."""
    from megatron_tree.attention import fa4
    from megatron_tree.attention.shapes import AttentionShape, device_generation

    shape = AttentionShape(head_dim, v_head_dim, heads // kv_heads, torch.bfloat16, device_generation(device))
    reason = fa4.refusal(shape, batch=1, dropout_p=0.0) if heads % kv_heads == 0 else (
        f"{heads} query heads do not group over {kv_heads} key/value heads")
    if reason is not None:
        return {"skipped": reason}
    end = _branching_tree(640, (200, 184), device)  # a partial and a full 128-block in both directions
    t = end.shape[1]
    kinds = {"tree": (None, 0)}
    if query_slots:
        kinds["query_slots"] = (torch.arange(256, t, device=device, dtype=torch.int32), 256)  # a chunk behind 256 slots
    compiled = {}
    for kind, (slots, context) in kinds.items():
        start = time.perf_counter()
        mask = fa4.fa4_tree_mask(end[0], slots)
        for grad in (False, True):
            # as a layer's: requiring grad in training (FA4 then keeps the log-sum-exp: another kernel), not in a
            # forward-only pass under no_grad
            q, k, v = (x.detach().requires_grad_(grad) for x in
                       _layer_inputs(t - context, t, heads, kv_heads, head_dim, v_head_dim, context > 0, device))
            with torch.set_grad_enabled(grad):
                out = fa4.fa4_tree_attention(q, k, v, mask)
            if grad:
                out.sum().backward()
        torch.cuda.synchronize(device)
        compiled[kind] = round(time.perf_counter() - start, 2)
    return {"compiled_s": compiled}


def _layer_inputs(queries: int, keys: int, heads: int, kv_heads: int, head_dim: int, v_head_dim: int, chunk: bool,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """query [1, h, Tq, d], key [1, hkv, T, d], value [1, hkv, T, dv] laid out in memory as a megatron-core layer
    hands them to tree attention: query and key new ``[s, 1, heads, d]`` tensors (RoPE's output), value a view into
    the fused QKV projection ``[s, 1, hkv, (h / hkv) d + d + dv]`` (a chunk's keys and values: new tensors, its
    context concatenated in front)."""
    def new(rows, n, d):
        return torch.randn(rows, 1, n, d, device=device, dtype=torch.bfloat16).permute(1, 2, 0, 3)

    q, k = new(queries, heads, head_dim), new(keys, kv_heads, head_dim)
    if chunk:
        v = new(keys, kv_heads, v_head_dim)
    else:
        width = heads // kv_heads * head_dim + head_dim + v_head_dim
        v = torch.randn(keys, 1, kv_heads, width, device=device, dtype=torch.bfloat16)[..., -v_head_dim:]
        v = v.permute(1, 2, 0, 3)
    return q, k, v


@dataclass
class FA4Warmup:
    """A running :mod:`megatron_tree.attention.fa4_warmup` helper process: its stdout a pipe, its stderr the file
    ``errors`` (compiler logs and warnings: a full pipe would stall the helper until the job waits for it)."""

    process: subprocess.Popen
    started: float
    errors: typing.IO[str]

    @classmethod
    def spawn(cls, argv: list[str]) -> "FA4Warmup":
        """Start ``argv`` (the helper's command line) as the helper."""
        errors = tempfile.TemporaryFile("w+")
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True,
                                   env={**os.environ, "PYTHONWARNINGS": "ignore"})
        return cls(process, time.perf_counter(), errors)

    def wait(self) -> str:
        """Wait for the helper to finish; returns one line saying what it compiled and how long the job waited for
        it (a failed helper is reported, not raised: the first step then compiles what is missing itself)."""
        start = time.perf_counter()
        out, _ = self.process.communicate()
        waited = time.perf_counter() - start
        lines = out.strip().splitlines()
        try:
            result = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            self.errors.seek(0)
            tail = self.errors.read().strip().splitlines()[-1:] or ["no output"]
            return (f"FA4 kernel warm-up failed (status {self.process.returncode}: {tail[0]}); the first step compiles "
                    f"the kernels itself")
        if "skipped" in result:
            return f"FA4 kernel warm-up: nothing compiled ({result['skipped']})"
        kinds = ", ".join(f"{kind} {s:.1f} s" for kind, s in result["compiled_s"].items())
        return (f"FA4 kernels compiled ahead in a helper process ({kinds}; "
                f"{time.perf_counter() - self.started:.1f} s in all, {waited:.1f} s of it waited for)")

    def stop(self) -> None:
        """End the helper if it still runs (the job failed before its first step)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def start_fa4_warmup(heads: int, kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                     query_slots: bool = False, device: torch.device | None = None) -> FA4Warmup | None:
    """Start the helper for one attention shape per rank on ``device`` (default: the current CUDA device); None
    where it would compile nothing that lasts: no CUDA GPU, or FA4's persistent cache off (``CACHE_VARIABLE`` not
    ``1``: set it before flash_attn is imported, as the launcher does)."""
    if not torch.cuda.is_available() or os.environ.get(CACHE_VARIABLE) != "1":
        return None
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    argv = [sys.executable, "-m", "megatron_tree.attention.fa4_warmup", "--heads", str(heads), "--kv-heads",
            str(kv_heads), "--head-dim", str(head_dim), "--v-head-dim", str(v_head_dim or head_dim),
            "--device", str(index)] + (["--query-slots"] if query_slots else [])
    return FA4Warmup.spawn(argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tree.attention.fa4_warmup",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, required=True, help="query heads per tensor-parallel rank")
    ap.add_argument("--kv-heads", type=int, required=True, help="key/value heads per tensor-parallel rank")
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--v-head-dim", type=int, help="value head dim (default: --head-dim)")
    ap.add_argument("--query-slots", action="store_true", help="also the query-slot mask's kernels (chunks, CP)")
    ap.add_argument("--device", type=int, help="CUDA device index (default: the current one)")
    args = ap.parse_args(argv)
    for name in ("heads", "kv_heads", "head_dim", "v_head_dim"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.device is not None and args.device < 0:
        ap.error(f"--device is a CUDA device index (0, 1, ...), got {args.device}")
    if not torch.cuda.is_available():
        result = {"skipped": "no CUDA GPU here"}
    else:
        device = torch.device("cuda", torch.cuda.current_device() if args.device is None else args.device)
        torch.cuda.set_device(device)
        result = warm_up(args.heads, args.kv_heads, args.head_dim, args.v_head_dim or args.head_dim,
                         query_slots=args.query_slots, device=device)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile the FA4 tree kernels ahead, in a helper process, while the job builds its models.

A job's first FA4 call compiles its kernels (CuTe DSL: seconds each; forward, backward, and the forward without a
log-sum-exp that forward-only passes run). flash-attn-4 keeps them in its persistent cache when
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` (the launcher turns it on; file-locked, written by rename, so processes
share it safely); helper processes that run the kernels once on a small branching tree fill that cache while the
job is still building its models and loading weights, and the first step loads them from it.

    python -m megatron_tree.attention.fa4_warmup --heads 16 --kv-heads 8 --head-dim 128 [--query-slots | --job JOB ...]

compiles, on the current CUDA device (``--device``), the kernels of one attention shape per rank (query heads, key /
value heads and head dims per tensor-parallel rank, bf16): forward without grad, forward + backward; with
``--query-slots`` also the query-slot mask's (the chunks of trees larger than a micro-batch, context parallel);
``--job`` runs only the named :data:`JOBS`. It prints one JSON line (``compiled_s`` per job, or ``skipped`` with the
reason: FA4 does not run here or is not proven on the shape, nothing to compile) and exits 0.

:func:`start_fa4_warmup` starts one helper per job from a job (they compile side by side: a CuTe DSL compile keeps
one CPU core busy) and skips them where an earlier job's helpers finished the same warm-up; :meth:`FA4Warmup.wait`
joins them before the first step.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_tree.core.tree import build_forest

__all__ = ["FA4Warmup", "cache_dir", "start_fa4_warmup", "warm_up"]

CACHE_VARIABLE = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
CACHE_DIR_VARIABLE = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"

JOBS = ("tree:forward", "tree:train", "query_slots:forward", "query_slots:train")
"""The helper's jobs, ``MASK:PASS``: the tree mask (row i is slot i) or the query-slot mask (a chunk behind its
context, context parallel); a forward under no_grad (forward-only passes: FA4 keeps no log-sum-exp) or forward +
backward (training). Each compiles its own kernels, so each can run in a process of its own."""


def _branching_tree(prompt: int, samples: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``subtree_end`` int32 [1, T] of one prompt and its samples (T = prompt + sum(samples)), by the packer's
    :func:`~megatron_tree.core.tree.build_forest`."""
    shared = np.arange(prompt)
    forest = build_forest([np.concatenate([shared, np.full(n, prompt + i)]) for i, n in enumerate(samples)])
    return torch.from_numpy(forest.subtree_end).to(device, torch.int32).unsqueeze(0)


def warm_up(heads: int, kv_heads: int, head_dim: int, v_head_dim: int, *, jobs: typing.Sequence[str],
            device: torch.device) -> dict:
    """Run the FA4 tree kernels of this shape once for each of ``jobs`` (:data:`JOBS`, ``"MASK:PASS"``), in order;
    returns ``{"compiled_s": {job: s}}`` or ``{"skipped": reason}``."""
    from megatron_tree.attention import fa4
    from megatron_tree.attention.shapes import AttentionShape, device_generation

    shape = AttentionShape(head_dim, v_head_dim, heads // kv_heads, torch.bfloat16, device_generation(device))
    reason = fa4.refusal(shape, batch=1, dropout_p=0.0) if heads % kv_heads == 0 else (
        f"{heads} query heads do not group over {kv_heads} key/value heads")
    if reason is not None:
        return {"skipped": reason}
    end = _branching_tree(640, (200, 184), device)  # a partial and a full 128-block in both directions
    t = end.shape[1]
    context = {"tree": 0, "query_slots": 256}  # query slots: a chunk behind 256 context slots
    compiled = {}
    for job in jobs:
        mask_kind, pass_ = job.split(":")
        start = time.perf_counter()
        c = context[mask_kind]
        mask = fa4.fa4_tree_mask(end[0], torch.arange(c, t, device=device, dtype=torch.int32) if c else None)
        # as a layer's: requiring grad in training (FA4 then keeps the log-sum-exp: another kernel), not in a
        # forward-only pass under no_grad
        grad = pass_ == "train"
        q, k, v = (x.detach().requires_grad_(grad) for x in
                   _layer_inputs(t - c, t, heads, kv_heads, head_dim, v_head_dim, c > 0, device))
        with torch.set_grad_enabled(grad):
            out = fa4.fa4_tree_attention(q, k, v, mask)
        if grad:
            out.sum().backward()
        torch.cuda.synchronize(device)
        compiled[job] = round(time.perf_counter() - start, 2)
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


def cache_dir() -> Path:
    """FA4's persistent cache folder, as flash-attn-4 picks it (``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, else
    ``<tmp>/$USER/flash_attention_cute_dsl_cache``), found without importing flash_attn (seconds)."""
    chosen = os.environ.get(CACHE_DIR_VARIABLE)
    return Path(chosen) if chosen else Path(tempfile.gettempdir()) / getpass.getuser() / "flash_attention_cute_dsl_cache"


def _record_path(argv: list[str], device: int) -> Path:
    """Where a finished warm-up of ``argv`` (the helper's options) on GPU ``device`` is recorded: a file in
    :func:`cache_dir` named by a hash of the options, the GPU's compute capability, the versions of Python and of
    every package the kernels come from, and our kernel sources (anything that changes FA4's compile keys or cache
    folder changes the name)."""
    versions = []
    for package in ("flash-attn-4", "nvidia-cutlass-dsl", "apache-tvm-ffi", "torch"):
        try:
            versions.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    here = Path(__file__).resolve().parent
    sources = [(here / name).read_bytes() for name in ("fa4.py", "fa4_kernels.py", "flex.py", "fa4_warmup.py")]
    digest = hashlib.sha256(repr((argv, torch.cuda.get_device_capability(device), sys.version_info[:2], versions,
                                  [hashlib.sha256(b).hexdigest() for b in sources])).encode()).hexdigest()
    return cache_dir() / f"megatron_tree_fa4_warm_{digest[:24]}.json"


@dataclass
class FA4Warmup:
    """Running :mod:`megatron_tree.attention.fa4_warmup` helper processes, one per warm-up job: each one's stdout a
    pipe, its stderr a file in ``errors`` (compiler logs and warnings: a full pipe would stall a helper until the job
    waits for it). ``record``: where :meth:`wait` notes a complete warm-up, so that later jobs start none
    (:func:`start_fa4_warmup`); None: nothing noted. No processes: an earlier run's helpers did the work (``note``)."""

    processes: list[subprocess.Popen]
    started: float
    errors: list[typing.IO[str]]
    record: Path | None = None
    note: str = ""

    @classmethod
    def spawn(cls, argvs: list[list[str]], record: Path | None = None) -> "FA4Warmup":
        """Start one helper per command line in ``argvs``, all at once."""
        errors = [tempfile.TemporaryFile("w+") for _ in argvs]
        processes = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                      env={**os.environ, "PYTHONWARNINGS": "ignore"}) for argv, err in zip(argvs, errors)]
        return cls(processes, time.perf_counter(), errors, record)

    def wait(self) -> str:
        """Wait for every helper to finish; returns one line saying what they compiled and how long the job waited
        for them (a failed helper is reported, not raised: the first step then compiles what is missing itself)."""
        if not self.processes:
            return self.note
        start = time.perf_counter()
        results, failure = [], None
        for process, errors in zip(self.processes, self.errors):
            out, _ = process.communicate()
            lines = out.strip().splitlines()
            try:
                results.append(json.loads(lines[-1]))
            except (IndexError, json.JSONDecodeError):
                errors.seek(0)
                tail = errors.read().strip().splitlines()[-1:] or ["no output"]
                failure = failure or f"status {process.returncode}: {tail[0]}"
        waited = time.perf_counter() - start
        if failure is not None:
            return f"FA4 kernel warm-up failed ({failure}); the first step compiles the kernels itself"
        skipped = [r["skipped"] for r in results if "skipped" in r]
        if skipped:
            return f"FA4 kernel warm-up: nothing compiled ({skipped[0]})"
        compiled = {job: s for r in results for job, s in r["compiled_s"].items()}
        if self.record is not None:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            partial = self.record.with_name(f".{self.record.name}.{os.getpid()}")
            partial.write_text(json.dumps({"compiled_s": compiled}))
            partial.replace(self.record)
        kinds = ", ".join(f"{job} {s:.1f} s" for job, s in compiled.items())
        count = f"{len(self.processes)} helper processes" if len(self.processes) > 1 else "a helper process"
        return (f"FA4 kernels compiled ahead in {count} ({kinds}; "
                f"{time.perf_counter() - self.started:.1f} s in all, {waited:.1f} s of it waited for)")

    def stop(self) -> None:
        """End the helpers that still run (the job failed before its first step)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.communicate()


def start_fa4_warmup(heads: int, kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                     query_slots: bool = False, device: torch.device | None = None) -> FA4Warmup | None:
    """Start the helpers for one attention shape per rank on ``device`` (default: the current CUDA device), one
    process per job of :data:`JOBS` (the tree mask's; the query-slot mask's too with ``query_slots``), all at once:
    each compiles in its own process. None where nothing they compiled would last: no CUDA GPU, or FA4's persistent
    cache off (``CACHE_VARIABLE`` not ``1``: set it before flash_attn is imported, as the launcher does). Where an
    earlier job's helpers finished the same warm-up (same options, GPU kind and versions; recorded in
    :func:`cache_dir`), none is started: the returned object's ``wait`` just says so."""
    if not torch.cuda.is_available() or os.environ.get(CACHE_VARIABLE) != "1":
        return None
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    shape = ["--heads", str(heads), "--kv-heads", str(kv_heads), "--head-dim", str(head_dim), "--v-head-dim",
             str(v_head_dim or head_dim)]
    jobs = [job for job in JOBS if query_slots or job.startswith("tree:")]
    record = _record_path(shape + jobs, index)
    if record.exists():
        return FA4Warmup([], time.perf_counter(), [], note=(
            f"FA4 kernels: in the persistent cache since an earlier run's warm-up ({record}); no helper started"))
    helper = [sys.executable, "-m", "megatron_tree.attention.fa4_warmup", *shape, "--device", str(index)]
    return FA4Warmup.spawn([helper + ["--job", job] for job in jobs], record)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tree.attention.fa4_warmup",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, required=True, help="query heads per tensor-parallel rank")
    ap.add_argument("--kv-heads", type=int, required=True, help="key/value heads per tensor-parallel rank")
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--v-head-dim", type=int, help="value head dim (default: --head-dim)")
    ap.add_argument("--query-slots", action="store_true", help="also the query-slot mask's kernels (chunks, CP)")
    ap.add_argument("--job", action="append", choices=JOBS,
                    help="only this job (repeatable; default: the tree mask's, with --query-slots every one)")
    ap.add_argument("--device", type=int, help="CUDA device index (default: the current one)")
    args = ap.parse_args(argv)
    for name in ("heads", "kv_heads", "head_dim", "v_head_dim"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.device is not None and args.device < 0:
        ap.error(f"--device is a CUDA device index (0, 1, ...), got {args.device}")
    if args.job and args.query_slots:
        ap.error("--job names the jobs to run; --query-slots (every job) goes without it")
    jobs = args.job or [job for job in JOBS if args.query_slots or job.startswith("tree:")]
    if not torch.cuda.is_available():
        result = {"skipped": "no CUDA GPU here"}
    else:
        device = torch.device("cuda", torch.cuda.current_device() if args.device is None else args.device)
        torch.cuda.set_device(device)
        result = warm_up(args.heads, args.kv_heads, args.head_dim, args.v_head_dim or args.head_dim, jobs=jobs,
                         device=device)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

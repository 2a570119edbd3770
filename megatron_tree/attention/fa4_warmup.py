"""Compile the FA4 tree kernels ahead, in a background thread, while the job starts up.

A job's first FA4 call compiles its kernels (CuTe DSL: seconds each; the forward, which forward-only passes run
too, and the backward). :func:`start_fa4_warmup` runs the kernels of the model's attention shape
once on a small branching tree in a thread of the job's own process, while the main thread creates the process
groups, builds the models and loads their weights; :meth:`FA4Warmup.wait` joins it before the first step, which then
finds the kernels in flash-attn-4's in-memory cache. With ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` (the
launcher turns it on) flash-attn-4 also keeps them on disk (file-locked, written by rename: processes share it), and
a later job's warm-up loads them instead of compiling.

    python -m megatron_tree.attention.fa4_warmup --heads 16 --kv-heads 8 --head-dim 128 [--query-slots]

fills that disk cache ahead of any job (a machine image, a container build; it sets the variable unless it is set),
on the current CUDA device
(``--device``): the kernels of one attention shape per rank (query heads, key / value heads and head dims per
tensor-parallel rank, bf16), forward and backward; with ``--query-slots`` also the query-slot
mask's (chunks of trees larger than a micro-batch, context parallel). It prints one JSON line (``compiled_s`` per
job, or ``skipped`` with the reason: FA4 does not run here or is not proven on the shape, nothing to compile) and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import typing

import numpy as np
import torch

from megatron_tree.core.tree import build_forest

__all__ = ["FA4Warmup", "start_fa4_warmup", "warm_up"]

CACHE_VARIABLE = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"

JOBS = ("tree", "query_slots")
"""The warm-up's jobs, one per mask: the tree mask (row i is slot i) and the query-slot mask (a chunk behind its
context, context parallel). Each runs a forward + backward and compiles their kernels; forward-only passes run the
same forward kernel (:func:`megatron_tree.attention.fa4.fa4_tree_attention` always has it write the log-sum-exp)."""


def _jobs(query_slots: bool) -> list[str]:
    """``["tree"]``, with ``query_slots`` every one of :data:`JOBS`."""
    return list(JOBS) if query_slots else ["tree"]


def _branching_tree(prompt: int, samples: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``subtree_end`` int32 [1, T] of one prompt and its samples (T = prompt + sum(samples)), by the packer's
    :func:`~megatron_tree.core.tree.build_forest`."""
    shared = np.arange(prompt)
    forest = build_forest([np.concatenate([shared, np.full(n, prompt + i)]) for i, n in enumerate(samples)])
    return torch.from_numpy(forest.subtree_end).to(device, torch.int32).unsqueeze(0)


def warm_up(heads: int, kv_heads: int, head_dim: int, v_head_dim: int, *, jobs: typing.Sequence[str],
            device: torch.device, stop: threading.Event | None = None) -> dict:
    """Run the FA4 tree kernels of this shape forward and backward once for each of ``jobs`` (:data:`JOBS`), in order, on
    ``device`` (made the calling thread's current device); ``stop`` set: no further job starts. Draws its inputs from a
    generator of its own (the job's random state stays as it was). Returns ``{"compiled_s": {job: s}}`` or
    ``{"skipped": reason}``."""
    from megatron_tree.attention import fa4
    from megatron_tree.attention.shapes import AttentionShape, device_generation

    shape = AttentionShape(head_dim, v_head_dim, heads // kv_heads, torch.bfloat16, device_generation(device))
    reason = fa4.refusal(shape, batch=1, dropout_p=0.0) if heads % kv_heads == 0 else (
        f"{heads} query heads do not group over {kv_heads} key/value heads")
    if reason is not None:
        return {"skipped": reason}
    torch.cuda.set_device(device)  # per thread
    generator = torch.Generator(device).manual_seed(0)
    end = _branching_tree(640, (200, 184), device)  # a partial and a full 128-block in both directions
    t = end.shape[1]
    context = {"tree": 0, "query_slots": 256}  # query slots: a chunk behind 256 context slots
    compiled = {}
    for job in jobs:
        if stop is not None and stop.is_set():
            break
        start = time.perf_counter()
        c = context[job]
        mask = fa4.fa4_tree_mask(end[0], torch.arange(c, t, device=device, dtype=torch.int32) if c else None)
        q, k, v = (x.detach().requires_grad_() for x in
                   _layer_inputs(t - c, t, heads, kv_heads, head_dim, v_head_dim, c > 0, generator))
        fa4.fa4_tree_attention(q, k, v, mask).sum().backward()
        torch.cuda.synchronize(device)
        compiled[job] = round(time.perf_counter() - start, 2)
    return {"compiled_s": compiled}


def _layer_inputs(queries: int, keys: int, heads: int, kv_heads: int, head_dim: int, v_head_dim: int, chunk: bool,
                  generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """query [1, h, Tq, d], key [1, hkv, T, d], value [1, hkv, T, dv] laid out in memory as a megatron-core layer
    hands them to tree attention: query and key new ``[s, 1, heads, d]`` tensors (RoPE's output), value a view into
    the fused QKV projection ``[s, 1, hkv, (h / hkv) d + d + dv]`` (a chunk's keys and values: new tensors, its
    context concatenated in front). Random values from ``generator``, on its device."""
    device = generator.device

    def new(rows, n, d):
        return torch.randn(rows, 1, n, d, device=device, dtype=torch.bfloat16, generator=generator).permute(1, 2, 0, 3)

    q, k = new(queries, heads, head_dim), new(keys, kv_heads, head_dim)
    if chunk:
        v = new(keys, kv_heads, v_head_dim)
    else:
        width = heads // kv_heads * head_dim + head_dim + v_head_dim
        v = torch.randn(keys, 1, kv_heads, width, device=device, dtype=torch.bfloat16, generator=generator)[..., -v_head_dim:]
        v = v.permute(1, 2, 0, 3)
    return q, k, v


class FA4Warmup:
    """FA4's warm-up running in a background thread of this process (:func:`start_fa4_warmup`): ``work`` returns
    :func:`warm_up`'s result; ``stop`` (an event) asks it to start no further job."""

    def __init__(self, work: typing.Callable[[threading.Event], dict]):
        self.stop_event = threading.Event()
        self.started = time.perf_counter()
        self._result: dict | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), name="fa4-warmup", daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        try:
            self._result = work(self.stop_event)
        except BaseException as e:  # reported by wait(): the first step then compiles what is missing itself
            self._error = e

    def wait(self) -> str:
        """Wait for the warm-up to finish; returns one line saying what it compiled and how long the job waited for it
        (a failure is reported, not raised: the first step then compiles what is missing itself)."""
        start = time.perf_counter()
        self.thread.join()
        waited = time.perf_counter() - start
        if self._error is not None:
            first = (str(self._error).strip().splitlines() or [""])[0]
            return (f"FA4 kernel warm-up failed ({type(self._error).__name__}: {first}); the first step compiles the "
                    f"kernels itself")
        if "skipped" in self._result:
            return f"FA4 kernel warm-up: nothing compiled ({self._result['skipped']})"
        kinds = ", ".join(f"{job} {s:.1f} s" for job, s in self._result["compiled_s"].items())
        return (f"FA4 kernels compiled ahead in a background thread ({kinds}; "
                f"{time.perf_counter() - self.started:.1f} s in all, {waited:.1f} s of it waited for)")

    def stop(self) -> None:
        """Start no further job and wait for the one running (the job failed before its first step)."""
        self.stop_event.set()
        self.thread.join()


def start_fa4_warmup(heads: int, kv_heads: int, head_dim: int, v_head_dim: int | None = None, *,
                     query_slots: bool = False, device: torch.device | None = None) -> FA4Warmup | None:
    """Start FA4's warm-up for one attention shape per rank on ``device`` (default: the current CUDA device) in a
    background thread: the tree mask's :data:`JOBS`, the query-slot mask's too with ``query_slots``. None without
    a CUDA GPU. flash-attn-4 is imported here, before the thread starts (two threads importing the same modules can
    deadlock on their import locks); set ``CACHE_VARIABLE`` before that for the disk cache."""
    if not torch.cuda.is_available():
        return None
    index = None if device is None else torch.device(device).index
    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    from megatron_tree.attention import fa4

    if fa4.fa4_available(device):
        import flash_attn.cute.interface  # noqa: F401  (see the docstring)

        fa4._mask_mods()
    v_head_dim, jobs = v_head_dim or head_dim, _jobs(query_slots)
    return FA4Warmup(lambda stop: warm_up(heads, kv_heads, head_dim, v_head_dim, jobs=jobs, device=device, stop=stop))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_tree.attention.fa4_warmup",
        description="Fill flash-attn-4's disk cache with the FA4 tree kernels of one attention shape per rank, ahead of "
        f"any job ({CACHE_VARIABLE}=1 unless set; FLASH_ATTENTION_CUTE_DSL_CACHE_DIR picks the folder).")
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
    os.environ.setdefault(CACHE_VARIABLE, "1")  # before flash_attn is imported
    if not torch.cuda.is_available():
        result = {"skipped": "no CUDA GPU here"}
    elif os.environ[CACHE_VARIABLE] != "1":
        result = {"skipped": f"{CACHE_VARIABLE}={os.environ[CACHE_VARIABLE]}: flash-attn-4 would keep nothing on disk"}
    else:
        device = torch.device("cuda", torch.cuda.current_device() if args.device is None else args.device)
        result = warm_up(args.heads, args.kv_heads, args.head_dim, args.v_head_dim or args.head_dim,
                         jobs=_jobs(args.query_slots), device=device)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one training step's time goes: device time per kernel category and per named region.

    from step_profile import profile_step
    breakdown = profile_step(run_one_step)          # CUDA when available, else CPU ops

``profile_step(fn)`` runs ``fn()`` once under ``torch.profiler`` and returns a JSON-ready dict
(all times in ms):

- ``wall_ms``: the step's wall time (synchronised);
- ``busy_ms``: the union of the intervals in which some kernel ran (CPU: some top-level op),
  so ``wall_ms - busy_ms`` is time the device sat idle waiting for the host;
- ``kernels_ms``: summed kernel time per category of :data:`KERNEL_CATEGORIES` (first match
  on the lower-cased kernel name wins; the rest is ``other``);
- ``top_kernels``: the :data:`TOP_KERNELS` kernels of most total time, ``[name[:80], ms, calls]``;
- ``idle_by_host_op``: device idle time (gaps between kernels) by what the host was running
  at each gap's midpoint, ``{"innermost": {op: ms}, "outermost": {op: ms}}``, top entries only
  (CUDA only; the profiler's own host overhead inflates gaps alike in every mode);
- ``idle_gaps``: how the idle time splits by gap length (``{"under_1ms": [count, ms], "1_to_10ms": ...,
  "over_10ms": ...}``: many short gaps = launches slower than the kernels; long ones = a sync, then Python) and the
  :data:`LONGEST_GAPS` longest, ``[ms, innermost host op, outermost host op]`` (CUDA only);
- ``regions_ms``: device time (CPU: CPU time) under the ops named in :data:`REGIONS`, each
  counted once where matches nest (autograd's ``evaluate_function`` wrapper and the node).

On CPU there are no kernels: ``kernels_ms`` is empty and ``busy_ms`` covers top-level ops;
that mode exists to test the accounting without a GPU.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

OPTIMIZER_REGION = "bench.optimizer"
TOP_KERNELS = 12
LONGEST_GAPS = 8
KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # FlexAttention's templates, FA4 (CuTe: its names hold "cutlass" too), cuDNN's fused attention
    ("attention", ("flex", "triton_tem", "flash_attn", "sdpa", "fmha")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul")),
    ("communication", ("nccl",)),
    ("optimizer", ("multi_tensor", "adam")),
    ("compiled_other", ("triton_",)),  # other Inductor kernels (e.g. FlexAttention's backward prologue)
)
REGIONS: dict[str, tuple[str, ...]] = {
    "logprobs": ("_TreeLogprobs",),  # the forward op and _TreeLogprobsBackward (autograd's thread)
    "optimizer": (OPTIMIZER_REGION,),  # the caller wraps its optimizer step in record_function(OPTIMIZER_REGION)
}


def _matches(name: str, needles: tuple[str, ...]) -> bool:
    return any(n in name for n in needles)


def _category(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((category for category, needles in KERNEL_CATEGORIES if _matches(name, needles)), "other")


def _busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """One walk over ``(start_us, end_us)`` intervals: the length in ms of their union, and the
    ``(start_us, end_us)`` gaps between its pieces."""
    total, reach, gaps = 0.0, None, []
    for start, end in sorted(intervals):
        if reach is not None and start > reach:
            gaps.append((reach, start))
        if reach is None or end > reach:
            total += end - (start if reach is None else max(start, reach))
            reach = end
    return total / 1e3, gaps


def _idle_by_host_op(events, gaps: list[tuple[float, float]], top: int = 6, walk: int = 5000) -> tuple[dict, dict]:
    """Gap time attributed to the innermost (latest-starting) host op containing each gap's
    midpoint, and to that op's outermost ancestor (``<none>`` where no op contains it); and the
    ``idle_gaps`` summary (module docstring)."""
    cpu = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in cpu]
    inner: dict[str, float] = {}
    outer: dict[str, float] = {}
    bins = {"under_1ms": [0, 0.0], "1_to_10ms": [0, 0.0], "over_10ms": [0, 0.0]}
    longest = []
    for lo, hi in gaps:
        mid, found = (lo + hi) / 2, None
        i = bisect.bisect_right(starts, mid) - 1
        for j in range(i, max(i - walk, -1), -1):
            if cpu[j].time_range.end >= mid:
                found = cpu[j]
                break
        root = found
        while root is not None and root.cpu_parent is not None:
            root = root.cpu_parent
        ms = (hi - lo) / 1e3
        names = ["<none>" if event is None else event.name[:60] for event in (found, root)]
        for table, name in zip((inner, outer), names):
            table[name] = table.get(name, 0.0) + ms
        entry = bins["under_1ms" if ms < 1 else "1_to_10ms" if ms < 10 else "over_10ms"]
        entry[0] += 1
        entry[1] += ms
        longest.append([ms, *names])
    by_op = {k: dict(sorted(v.items(), key=lambda x: -x[1])[:top]) for k, v in (("innermost", inner), ("outermost", outer))}
    return by_op, {**bins, "longest": sorted(longest, key=lambda x: -x[0])[:LONGEST_GAPS]}


def summarize(events, wall_s: float, cuda: bool) -> dict:
    """The breakdown dict (module docstring) of a profiler's ``events()``."""
    kernels: dict[str, float] = {}
    per_name: dict[str, list] = {}
    intervals = []
    for e in events:
        # record_function ranges show on the GPU timeline too (user annotations): a range, not a kernel
        if cuda and e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            duration = e.time_range.elapsed_us()
            category = _category(e.name)
            kernels[category] = kernels.get(category, 0.0) + duration / 1e3
            entry = per_name.setdefault(e.name[:80], [e.name[:80], 0.0, 0])
            entry[1] += duration / 1e3
            entry[2] += 1
            intervals.append((e.time_range.start, e.time_range.end))
        elif not cuda and e.device_type == DeviceType.CPU and e.cpu_parent is None:
            intervals.append((e.time_range.start, e.time_range.end))
    regions = {}
    for region, needles in REGIONS.items():
        total = 0.0
        for e in events:
            if e.device_type != DeviceType.CPU or not _matches(e.name, needles):
                continue
            parent = e.cpu_parent
            while parent is not None and not _matches(parent.name, needles):
                parent = parent.cpu_parent
            if parent is None:  # outermost match only
                total += (e.device_time_total if cuda else e.cpu_time_total) / 1e3
        regions[region] = total
    busy_ms, gaps = _busy_and_gaps(intervals)
    by_op, idle_gaps = _idle_by_host_op(events, gaps) if cuda else ({}, {})
    return {
        "wall_ms": wall_s * 1e3,
        "busy_ms": busy_ms,
        "kernels_ms": dict(sorted(kernels.items())),
        "regions_ms": regions,
        "top_kernels": sorted(per_name.values(), key=lambda x: -x[1])[:TOP_KERNELS],
        "idle_by_host_op": by_op,
        "idle_gaps": idle_gaps,
    }


def profile_step(fn: Callable[[], object]) -> dict:
    """Run ``fn()`` once under the profiler (CUDA kernels when available) and summarise it."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return summarize(prof.events(), wall, cuda)

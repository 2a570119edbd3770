"""Whether an optional kernel package runs here: its pinned release installed and importable, on a GPU generation it
has kernels for (the CuTe DSL backends, :mod:`~megatron_tree.attention.fa4` and :mod:`~megatron_tree.attention.cudnn_flex`).
Each answer is a reason (a string: what is missing and how to get it) or None."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata

import torch

from megatron_tree.attention.shapes import device_generation

__all__ = ["hopper_or_blackwell_problem", "pinned_import_problem", "unavailable_reason"]


@functools.cache
def pinned_import_problem(distribution: str, version: str, module: str, shown: str | None = None) -> str | None:
    """None when ``distribution`` is installed at ``version`` and ``module`` imports, else why not (``shown``: the
    module's name in the message, default ``module``). Asked once per process."""
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} is not installed (pip install {distribution}=={version})"
    if installed != version:
        return f"{distribution} {installed} is installed; this backend is written for {version} (pip install {distribution}=={version})"
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken CUDA / CuTe DSL install surfaces here
        return f"{shown or module} does not import: {type(exc).__name__}: {exc}"
    return None


def hopper_or_blackwell_problem(device: torch.device | None) -> str | None:
    """None when ``device`` (None: the current CUDA device) is a Hopper (sm90) or Blackwell (sm100) GPU, else why not."""
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU (Hopper sm90 or Blackwell sm100)"
    if device is not None and device.type != "cuda":
        return f"the tensors are on {device}, not on a CUDA GPU"
    major = int(device_generation("cuda" if device is None else device)[2:-1])  # "sm90" -> 9, "sm100" -> 10
    if major not in (9, 10):
        return f"it runs on Hopper (sm90) and Blackwell (sm100) GPUs; this GPU is sm{major}x"
    return None


def unavailable_reason(backend: str, device: torch.device | None, import_problem: str | None, extra: str) -> str | None:
    """Why ``backend``'s kernels cannot run on ``device`` (None: the current CUDA device): the GPU it lacks and the
    package problem (``import_problem``, from :func:`pinned_import_problem`; the fix ``pip install -e '.[extra]'``
    added), or None when they can."""
    problems = [p for p in (hopper_or_blackwell_problem(device),
                            import_problem and f"{import_problem}; or pip install -e '.[{extra}]'") if p]
    return f"the {backend} tree attention backend cannot run: " + "; ".join(problems) if problems else None

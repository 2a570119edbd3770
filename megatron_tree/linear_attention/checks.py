"""Input checks of the linear-attention ops: each failure is a ``ValueError`` naming the tensor and the fix."""

from __future__ import annotations

import torch

__all__ = ["check_carried", "check_floating", "check_finite", "check_shape", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the PyTorch paths of the ops compute in for inputs of ``dtype``: fp64 for fp64 (the exactness checks),
    else fp32 (fp32, bf16, fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_floating(**tensors: torch.Tensor | None) -> None:
    """Each named tensor (None skipped) must be a floating-point ``torch.Tensor``."""
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor (fp64, fp32, bf16 or fp16), got dtype {x.dtype}")


def check_shape(name: str, x: torch.Tensor, expected: tuple[int | None, ...], meaning: str) -> None:
    """``x.shape`` must match ``expected`` (None = any size); ``meaning`` names the dims, e.g. ``"[T, H, Kd]"``."""
    if x.ndim != len(expected) or any(e is not None and s != e for s, e in zip(x.shape, expected)):
        want = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"{name} must be {meaning} = [{want}], got shape {tuple(x.shape)}")


def check_carried(name: str, x: torch.Tensor | None, count: int, expected: tuple[int | None, ...], meaning: str) -> None:
    """What a chunk's scan starts from: ``x`` must be None when the layout carries no state from the chunk's context
    (``count`` R = 0), else of shape ``expected`` (``meaning`` names the dims, R first)."""
    if (x is None) != (count == 0):
        raise ValueError(f"the layout carries {count} states from a chunk's context, so {name} must be "
                         f"{'None' if count == 0 else f'{meaning} with R = {count}'}, got "
                         f"{None if x is None else tuple(x.shape)}")
    if count:
        check_shape(name, x, expected, meaning)


def check_finite(**tensors: torch.Tensor | None) -> None:
    """Each named tensor (None skipped) must hold only finite values: one host sync for all of them."""
    named = [(name, x) for name, x in tensors.items() if x is not None]
    if not named:
        return
    finite = torch.stack([x.detach().isfinite().all() for _, x in named]).tolist()
    bad = [name for (name, _), ok in zip(named, finite) if not ok]
    if bad:
        raise ValueError(f"non-finite values (inf or nan) in {', '.join(bad)}; check what produced them "
                         f"(a diverged step, an overflow in a low-precision cast)")

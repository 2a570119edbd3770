"""Which attention calls a kernel is trusted on: the shapes whose gradients a GPU test compared.

A kernel that is right on one head dim can be silently wrong on another (flash-attn-4 4.0.0b36 on
an H200: head dims 64 / 96 / 128 exact, 72 / 80 / 104 / 112 a wrong dQ, 192 / 256 an error at the
first call). So every tree attention backend declares, as :class:`ProvenShapes`, the calls on
which its forward and backward (out, dQ, dK, dV) were compared against the dense fp64 reference
on a GPU (:mod:`megatron_tree.attention.conformance`), and is used on those only: ``auto``
sends every other call to a backend that is exact there, an explicit backend refuses it.

A call's shape (:class:`AttentionShape`): q/k head dim, v head dim (they differ in MLA), query
heads per key/value head (the GQA ratio), dtype, the device's generation (``"cpu"``,
``"sm90"`` for Hopper, ``"sm100"`` for Blackwell, ...), and whether the mask has a sliding window
(another ``mask_mod`` and other block tables: proven apart, see :attr:`ProvenShapes.windowed`).
Versions (a pinned kernel package) are checked by the backend itself.
"""

from __future__ import annotations

import functools

import itertools
from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["AttentionShape", "ProvenShapes", "device_generation"]

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def device_generation(device: torch.device | str) -> str:
    """``"cpu"`` (or another non-CUDA device type) or ``"sm<major><minor>"`` of a CUDA device (``"sm90"`` on H100/H200)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return _cuda_generation(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_generation(index: int) -> str:
    """``device_generation`` of CUDA device ``index``, asked once (it runs on every attention call)."""
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


@dataclass(frozen=True)
class AttentionShape:
    """What decides whether a kernel computes an attention call right.

    head_dim     q / k head dim (``query.shape[-1]``).
    v_head_dim   value head dim (``value.shape[-1]``; equal to ``head_dim`` except in MLA).
    gqa_ratio    query heads per key/value head (1 = MHA).
    dtype        the inputs' dtype.
    device       :func:`device_generation` of the inputs' device.
    windowed     the tree mask has a sliding window (:mod:`megatron_tree.core.masks`).
    """

    head_dim: int
    v_head_dim: int
    gqa_ratio: int
    dtype: torch.dtype
    device: str
    windowed: bool = False

    @classmethod
    def of(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, windowed: bool = False) -> "AttentionShape":
        """The shape of a call on query ``[b, np, Tq, d]``, key ``[b, ng, T, d]``, value ``[b, ng, T, dv]``."""
        return cls(query.shape[-1], value.shape[-1], query.shape[1] // key.shape[1], query.dtype,
                   device_generation(query.device), windowed)

    def __str__(self) -> str:
        dims = f"head dim {self.head_dim}" + ("" if self.v_head_dim == self.head_dim else f" (v {self.v_head_dim})")
        ratio = "MHA" if self.gqa_ratio == 1 else f"GQA {self.gqa_ratio}:1"
        window = ", sliding window" if self.windowed else ""
        return f"{dims}, {ratio}, {_DTYPE_NAMES.get(self.dtype, str(self.dtype))}{window} on {self.device}"


@dataclass(frozen=True)
class ProvenShapes:
    """The calls on which a backend's forward and backward were compared against the dense reference.

    ``shapes``: ``(head_dim, v_head_dim, gqa_ratio, dtype)`` tuples, each proven on every device
    generation of ``devices``. ``evidence`` names the runs that proved them (tests, committed
    conformance output). ``windowed``: the shapes were proven with a sliding-window mask (True) or
    the plain tree mask (False); a table proves only calls of its own kind. Build the cross product
    of a grid with :meth:`grid`; an empty table (:meth:`none`) proves nothing.
    """

    shapes: frozenset[tuple[int, int, int, torch.dtype]]
    devices: frozenset[str]
    evidence: str
    windowed: bool = False

    @classmethod
    def grid(cls, head_dims: Iterable[int | tuple[int, int]], gqa_ratios: Iterable[int], dtypes: Iterable[torch.dtype],
             devices: Iterable[str], evidence: str, windowed: bool = False) -> "ProvenShapes":
        """Every combination; a head dim is ``d`` (v head dim ``d``) or ``(d, dv)``."""
        dims = [(d, d) if isinstance(d, int) else tuple(d) for d in head_dims]
        shapes = frozenset((d, dv, r, t) for (d, dv), r, t in itertools.product(dims, gqa_ratios, dtypes))
        return cls(shapes, frozenset(devices), evidence, windowed)

    @classmethod
    def none(cls, why: str, windowed: bool = False) -> "ProvenShapes":
        """A table that proves no call (``why``: what would prove one)."""
        return cls(frozenset(), frozenset(), why, windowed)

    def __or__(self, other: "ProvenShapes") -> "ProvenShapes":
        if self.devices != other.devices or self.windowed != other.windowed:
            raise ValueError("ProvenShapes of different devices or mask kinds (windowed) do not combine; keep them apart")
        return ProvenShapes(self.shapes | other.shapes, self.devices, f"{self.evidence}; {other.evidence}", self.windowed)

    def proves(self, shape: AttentionShape) -> bool:
        """True when ``shape``'s exact combination, of this table's mask kind, was compared on ``shape.device``'s generation."""
        return shape.device in self.devices and shape.windowed == self.windowed and (
            (shape.head_dim, shape.v_head_dim, shape.gqa_ratio, shape.dtype) in self.shapes
        )

    def describe(self) -> str:
        """One line per (GQA ratio, dtype): the proven head dims, and the devices."""
        kind = "with a sliding window " if self.windowed else ""
        if not self.shapes:
            return f"{kind}on no shape yet ({self.evidence})"
        rows: dict[tuple[int, str], list[str]] = {}
        for d, dv, r, t in sorted(self.shapes, key=lambda s: (s[2], _DTYPE_NAMES.get(s[3], ""), s[0], s[1])):
            rows.setdefault((r, _DTYPE_NAMES.get(t, str(t))), []).append(str(d) if d == dv else f"{d}/v{dv}")
        lines = [f"{'MHA' if r == 1 else f'GQA {r}:1'} {t}: head dims {', '.join(ds)}" for (r, t), ds in rows.items()]
        return f"{kind}on {', '.join(sorted(self.devices))}: " + "; ".join(lines)


"""What the host checked about a tensor before moving it to the GPU, so a kernel's input check reads no value back.

A GPU kernel's value checks (an interval vector's ends, a label's range) read the tensor back: a host sync, which
drains the launch queue. :class:`~megatron_tree.core.microbatch.TreeMicroBatch.to` checks its masks and measures its
labels' and slots' ranges on the CPU copy and :func:`remember` s the results on the tensors it moves; the checks
(tree attention's mask check, the log-prob kernel's range check) :func:`recall` them and skip the sync. The attention
mask's CPU copy itself is noted as ``host_copy``, for what is cheaper to derive on the host than to read back
(:mod:`megatron_tree.attention.cudnn_flex`'s intervals).

A fact holds for one tensor object as long as it is not modified in place (its version counter): a view, a slice,
a copy or an in-place edit has none, and is checked again the slow way. Facts go with their tensor when it is freed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_FACTS: dict[int, tuple[weakref.ref, int, dict[str, Any]]] = {}
"""id(tensor) -> (weak reference to it, its version when the facts were noted, facts)."""


def remember(tensor: torch.Tensor, **facts: Any) -> None:
    """Note ``facts`` about ``tensor`` as it is now (added to those noted before on the same, unmodified tensor)."""
    key = id(tensor)
    entry = _FACTS.get(key)
    known = entry[2] if entry is not None and entry[0]() is tensor and entry[1] == tensor._version else {}
    ref = weakref.ref(tensor, lambda _, key=key: _forget(key))
    _FACTS[key] = (ref, tensor._version, {**known, **facts})


def _forget(key: int) -> None:
    entry = _FACTS.get(key)
    if entry is not None and entry[0]() is None:
        del _FACTS[key]


def recall(tensor: torch.Tensor, name: str) -> Any:
    """The fact ``name`` noted about this very tensor, None when none was or the tensor changed in place since."""
    entry = _FACTS.get(id(tensor))
    if entry is None or entry[0]() is not tensor or entry[1] != tensor._version:
        return None
    return entry[2].get(name)


def interval_vector_ok(subtree_end: torch.Tensor) -> bool:
    """Whether ``subtree_end`` int ``[b, s]`` is an interval vector: ``j < subtree_end[:, j] <= s`` for every slot j
    (a host sync when it is on a GPU)."""
    slots = subtree_end.shape[-1]
    idx = torch.arange(slots, device=subtree_end.device)
    return bool(((subtree_end > idx) & (subtree_end <= slots)).all())


def value_range(values: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of an integer tensor as host ints, None when it is empty (a host sync on a GPU)."""
    if values.numel() == 0:
        return None
    return int(values.min()), int(values.max())

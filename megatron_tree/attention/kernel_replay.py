"""Replay a host function whose GPU work is one compiled-kernel call, without its per-call Python.

FA4's ``_flash_attn_fwd`` spends ~0.4-0.6 ms of host time per call (argument checks, tile and scheduler
choices, the compile key, block-table normalisation) before one compiled-kernel call; in a tree step of small
micro-batches the GPU waits on it (the 8k-token chunked GRPO step on the H200: ~0.1 s of GPU idle inside its
forward calls). Every layer of a micro-batch calls it with tensors of the same geometry, so all of that work is
the same each time: :class:`KernelReplay` records one call and replays the kernel call for the next calls of
the same geometry.

**Recording** (a call whose key, below, has no plan yet): the wrapped function runs as it is, with its
compile cache swapped (``cache_owner.compile_cache``) for one that records each call of a compiled kernel (the
callable and its arguments). The call becomes a *plan* only if it made exactly one kernel call, and every tensor
in that call's arguments and in the function's result is either a view of one of the call's input tensors (the
tensors in its arguments; the view's geometry is recorded relative to that input, which must be the only input
with that memory) or of a tensor the function allocated and returned (``out``, ``lse``: the kernel writes them,
replay allocates them anew, same sizes and strides). Anything else (a copy of an input, scheduler metadata
computed from values, a second kernel) makes the key run the function as it is from then on.

**Checking**: a plan's first use with a new (kernel, argument structure) is checked: the plan runs once more on
the recording call's inputs and its results must equal the function's own bit for bit (one host sync per
structure and process; the FA4 forward is deterministic). A plan that fails marks its structure as never
replayed (the function runs as it is for those keys) and warns once.

**Key**: every non-tensor argument (callables by identity) and every input tensor's type, sizes, strides,
dtype, device and ``requires_grad``; the inputs' storage offsets may differ (views are replayed relative to
their input). At most ``capacity`` keys are kept (least recently used out).

Imports torch only (the FA4 binding is :mod:`megatron_tree.attention.fa4_kernels`).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["KernelReplay"]

_FALLBACK = object()
"""A key whose calls run the function as it is."""


@dataclass(frozen=True)
class _View:
    """A tensor argument: ``root`` (``("in", i)`` the call's i-th input tensor, ``("out", j)`` the j-th tensor
    the call allocates) viewed with ``size`` / ``stride`` at ``offset`` elements from the root's own offset."""

    root: tuple[str, int]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Plan:
    """One recorded call: the kernel, its argument template and the function's result template (lists and
    tuples of :class:`_View` s and constants), the allocated tensors' ``(size, stride, dtype)``."""

    kernel: Callable
    args: tuple
    result: Any
    allocations: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]

    @property
    def structure(self) -> tuple:
        """What the plan's check vouches for: the kernel and where each argument comes from (not the sizes)."""
        return (id(self.kernel), _shape_free(self.args), _shape_free(self.result))

    def run(self, inputs: list[torch.Tensor]) -> Any:
        device = inputs[0].device
        outs = [torch.empty_strided(size, stride, dtype=dtype, device=device) for size, stride, dtype in self.allocations]
        build = lambda node: _build(node, inputs, outs)  # noqa: E731
        self.kernel(*build(self.args))
        return build(self.result)


class _RecordingCache:
    """Stands in for a compile cache during a recorded call: lookups and stores go to ``cache``; each compiled
    function it hands out records its calls in ``calls``."""

    def __init__(self, cache):
        self.cache = cache
        self.calls: list[tuple[Callable, tuple]] = []

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, fn) -> None:
        self.cache[key] = fn

    def __getitem__(self, key):
        fn = self.cache[key]

        def record(*args):
            self.calls.append((fn, args))
            return fn(*args)

        return record


class KernelReplay:
    """``fn`` (whose GPU work is one call of a kernel from ``cache_owner.compile_cache``) with its calls replayed
    (module docstring). Call it as ``fn``; ``fn`` takes tensors, containers of them and hashable constants."""

    def __init__(self, fn: Callable, cache_owner: Any, capacity: int = 64):
        self.fn, self.cache_owner, self.capacity = fn, cache_owner, capacity
        self.plans: OrderedDict[tuple, Any] = OrderedDict()
        self.checked: dict[tuple, bool] = {}

    def __call__(self, *args, **kwargs):
        inputs: list[torch.Tensor] = []
        try:
            key = (_key(args, inputs), _key(tuple(sorted(kwargs.items())), inputs))
        except TypeError:  # an unhashable constant or a tensor subclass (fake tensors): not replayed
            return self.fn(*args, **kwargs)
        seen: dict[tuple, int] = {}  # which inputs are the same view (a plan reads each view through the first)
        key += (tuple(seen.setdefault((t.data_ptr(), t.shape, t.stride()), i) for i, t in enumerate(inputs)),)
        plan = self.plans.get(key)
        if plan is _FALLBACK:
            self.plans.move_to_end(key)
            return self.fn(*args, **kwargs)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan.run(inputs)
        result, plan = self._record(inputs, args, kwargs)
        if plan is not None and not self._vouched(plan, inputs, result):
            plan = None
        self.plans[key] = _FALLBACK if plan is None else plan
        while len(self.plans) > self.capacity:
            self.plans.popitem(last=False)
        return result

    def _record(self, inputs, args, kwargs) -> tuple[Any, _Plan | None]:
        cache = self.cache_owner.compile_cache
        recorder = _RecordingCache(cache)
        self.cache_owner.compile_cache = recorder
        try:
            result = self.fn(*args, **kwargs)
        finally:
            self.cache_owner.compile_cache = cache
        return result, _plan(recorder.calls, inputs, result)

    def _vouched(self, plan: _Plan, inputs: list[torch.Tensor], result) -> bool:
        structure = plan.structure
        if structure not in self.checked:
            self.checked[structure] = _equal(plan.run(inputs), result)
            if not self.checked[structure]:
                warnings.warn(f"{getattr(self.fn, '__qualname__', self.fn)}: a replayed kernel call did not reproduce "
                              f"the function's own results bit for bit; those calls run the function as it is")
        return self.checked[structure]


def _key(node, inputs: list[torch.Tensor]):
    """The hashable key of ``node`` (tensors by geometry, appended to ``inputs`` in order)."""
    if isinstance(node, torch.Tensor):
        if type(node) is not torch.Tensor:
            raise TypeError("tensor subclass")
        inputs.append(node)
        return ("T", tuple(node.shape), node.stride(), node.dtype, node.device, node.requires_grad)
    if isinstance(node, (tuple, list)):
        return (type(node), tuple(_key(x, inputs) for x in node))
    if callable(node):
        return ("fn", id(node))
    hash(node)
    return node


def _plan(calls, inputs: list[torch.Tensor], result) -> _Plan | None:
    """The plan of a recorded call (module docstring), None where it cannot be replayed."""
    if len(calls) != 1:
        return None
    kernel, args = calls[0]
    outs: list[torch.Tensor] = []
    _collect_results(result, outs)
    try:
        template = _template(args, inputs, outs), _template(result, inputs, outs)
    except ValueError:
        return None
    return _Plan(kernel, template[0], template[1], tuple((tuple(t.shape), t.stride(), t.dtype) for t in outs))


def _collect_results(node, outs: list[torch.Tensor]) -> None:
    if isinstance(node, torch.Tensor):
        outs.append(node)
    elif isinstance(node, (tuple, list)):
        for x in node:
            _collect_results(x, outs)


def _template(node, inputs: list[torch.Tensor], outs: list[torch.Tensor]):
    """``node`` with each tensor as a :class:`_View` of an input or a result; ValueError for any other tensor."""
    if isinstance(node, torch.Tensor):
        return _view(node, inputs, outs)
    if isinstance(node, (tuple, list)):
        items = [_template(x, inputs, outs) for x in node]
        if isinstance(node, list):
            return items
        return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
    return node


def _view(t: torch.Tensor, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> _View:
    storage = t.untyped_storage().data_ptr()
    for kind, roots in (("out", outs), ("in", inputs)):
        same = [i for i, r in enumerate(roots) if r.untyped_storage().data_ptr() == storage]
        exact = [i for i in same if roots[i].data_ptr() == t.data_ptr() and roots[i].shape == t.shape
                 and roots[i].stride() == t.stride()]
        if exact or len(same) == 1:
            i = (exact or same)[0]
            return _View((kind, i), tuple(t.shape), t.stride(), t.storage_offset() - roots[i].storage_offset())
        if same:
            raise ValueError("a view of memory several tensors share")
    raise ValueError("a tensor the function made from its inputs")


def _build(node, inputs: list[torch.Tensor], outs: list[torch.Tensor]):
    if isinstance(node, _View):
        kind, i = node.root
        root = (inputs if kind == "in" else outs)[i]
        if node.offset == 0 and node.size == tuple(root.shape) and node.stride == root.stride():
            return root.detach()  # as the recorded call passed it: DLPack refuses tensors that require grad
        return root.detach().as_strided(node.size, node.stride, root.storage_offset() + node.offset)
    if isinstance(node, list):
        return [_build(x, inputs, outs) for x in node]
    if isinstance(node, tuple):
        items = [_build(x, inputs, outs) for x in node]
        return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
    return node


def _shape_free(node):
    if isinstance(node, _View):
        return node.root
    if isinstance(node, (tuple, list)):
        return (type(node), tuple(_shape_free(x) for x in node))
    return ("const", type(node))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype
                and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (NaN equals NaN of the same bits)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)

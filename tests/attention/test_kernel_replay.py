"""KernelReplay (megatron_tree.attention.kernel_replay) against the function it replays, on CPU stand-ins shaped
like FA4's ``_flash_attn_fwd``: Python work, then one call of a kernel from a compile cache read through an owner."""

from __future__ import annotations

import types
import warnings
from typing import NamedTuple

import pytest
import torch

from megatron_tree.attention.kernel_replay import KernelReplay


class Aux(NamedTuple):
    tensors: list | None
    scalars: tuple | None


def kernel(q, k, v, out, lse, scale, aux):
    """The 'compiled kernel': writes out [n, d] and lse [n] in place."""
    scores = (q @ k.T) * scale + aux.tensors[0][:, 1]
    lse.copy_(scores.logsumexp(-1))
    out.copy_(scores.softmax(-1) @ v)


class Library:
    """A library function in FA4's shape; ``python_calls`` counts its runs, ``mode`` varies how it calls."""

    def __init__(self, mode: str = "plain"):
        self.owner = types.SimpleNamespace(compile_cache={})
        self.mode, self.python_calls = mode, 0

    def fwd(self, q, k, v, *, scale, bias, flag=None):
        self.python_calls += 1
        cache = self.owner.compile_cache
        key = (q.dtype, q.shape[-1])
        if key not in cache:
            cache[key] = kernel
        out = torch.empty(q.shape[0], v.shape[-1], dtype=q.dtype)
        lse = torch.empty(q.shape[0], dtype=torch.float32)
        k_arg = k.contiguous() if self.mode == "copies" else k.detach()
        cache[key](q.detach(), k_arg, v.t().contiguous().t() if self.mode == "copies" else v, out, lse, scale,
                   Aux([bias.expand(4, -1).T], None))
        if self.mode == "two_kernels":
            cache[key](q, k, v, out, lse, scale, Aux([bias.expand(4, -1).T], None))
        if self.mode == "post_edit":
            out.add_(1.0)
        return out, lse, None


def _call(lib, replay, n=5, m=7, d=3, offset=0, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(offset + n * d, generator=g, dtype=torch.float64)
    q = base[offset:].view(n, d)
    k, v = torch.randn(m, d, generator=g, dtype=torch.float64), torch.randn(m, 2, generator=g, dtype=torch.float64)
    bias = torch.randn(offset + m, generator=g, dtype=torch.float64)[offset:]  # the kernel gets a view of it
    ours = replay(q, k, v, scale=0.5, bias=bias, **kw)
    theirs = lib.fwd(q, k, v, scale=0.5, bias=bias, **kw)
    return ours, theirs


def _same(a, b):
    assert a[2] is None and b[2] is None
    for x, y in zip(a[:2], b[:2]):
        assert x.shape == y.shape and x.stride() == y.stride()
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_replays_later_calls_of_a_geometry_and_records_each_new_one():
    lib = Library()
    replay = KernelReplay(lib.fwd, lib.owner)
    for seed in range(3):  # one recording, then replays: the function's Python runs once (plus the reference calls)
        _same(*_call(lib, replay, seed=seed))
    assert lib.python_calls == 1 + 3
    _same(*_call(lib, replay, n=9, seed=5))  # a new geometry records again
    _same(*_call(lib, replay, n=9, seed=6, offset=4))  # a view at another storage offset replays
    assert lib.python_calls == 2 + 5  # two recordings, five reference calls
    assert isinstance(lib.owner.compile_cache, dict)  # the cache is put back after each recording


@pytest.mark.parametrize("mode", ["copies", "two_kernels"])
def test_calls_it_cannot_replay_run_the_function(mode):
    lib = Library(mode)
    replay = KernelReplay(lib.fwd, lib.owner)
    for seed in range(3):
        _same(*_call(lib, replay, seed=seed))
    assert lib.python_calls == 6


def test_a_plan_whose_check_fails_is_never_used_and_warns():
    lib = Library("post_edit")  # the function edits its output after the kernel: replay would miss it
    replay = KernelReplay(lib.fwd, lib.owner)
    with pytest.warns(UserWarning, match="bit for bit"):
        _same(*_call(lib, replay, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(1, 3):
            _same(*_call(lib, replay, seed=seed))
            _same(*_call(lib, replay, n=8, seed=seed))  # same structure, new geometry: not replayed either
    assert lib.python_calls == 2 * 5


def test_inputs_that_were_one_tensor_when_recorded_are_replayed_apart():
    lib = Library()
    replay = KernelReplay(lib.fwd, lib.owner)
    k = torch.randn(6, 3, dtype=torch.float64)
    q, bias = torch.randn(4, 3, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    replay(q, k, k, scale=1.0, bias=bias)  # v is k
    v = torch.randn(6, 3, dtype=torch.float64)
    _same(replay(q, k, v, scale=1.0, bias=bias), lib.fwd(q, k, v, scale=1.0, bias=bias))


def test_keys_on_constants_and_keeps_at_most_capacity_plans():
    lib = Library()
    replay = KernelReplay(lib.fwd, lib.owner, capacity=2)
    _same(*_call(lib, replay, flag="a"))
    _same(*_call(lib, replay, flag="b"))  # another constant: another recording
    assert lib.python_calls == 4
    _same(*_call(lib, replay, n=6))
    assert len(replay.plans) == 2
    _same(*_call(lib, replay, flag="a"))  # evicted: recorded again
    assert lib.python_calls == 8


def test_tensor_subclasses_and_unhashable_constants_run_the_function():
    lib = Library()
    replay = KernelReplay(lib.fwd, lib.owner)
    _same(*_call(lib, replay, flag={"a": 1}))
    _same(*_call(lib, replay, flag={"a": 1}))
    q, k, bias = torch.nn.Parameter(torch.randn(4, 3)), torch.randn(6, 3), torch.zeros(6)
    for _ in range(2):
        with torch.no_grad():
            _same(replay(q, k, k, scale=1.0, bias=bias), lib.fwd(q, k, k, scale=1.0, bias=bias))
    assert lib.python_calls == 8 and not replay.plans

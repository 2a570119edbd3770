"""tree_gated_delta_rule: every slot's output (and every input's gradient) equals the gated delta rule
run along each root path alone (the fp64 per-token loop of ``megatron_tree.testing``); one chunked call
per level; children start from their parent segment's final state (a zero start is detected); state
gradients of siblings add up at the branch point; bad inputs are refused naming the tensor.
``gpu``: fla's kernels against the PyTorch path on a tree.
"""

from __future__ import annotations

import os

import pytest
import torch
from gdn_trees import FLA_OFF, gdn_inputs, per_path, rel_err, tree_cases

import megatron_tree.linear_attention.chunked_delta_rule as chunk_module
import megatron_tree.linear_attention.tree_delta_rule as tree_module
from megatron_tree.linear_attention import tree_gated_delta_rule, tree_scan_layout
from megatron_tree.testing import gated_delta_rule_reference

CASES = tree_cases()


def _reference(q, k, v, g, beta):
    return gated_delta_rule_reference(q, k, v, g, beta)[0]


def _compare(end, scale=None, seed=0):
    layout = tree_scan_layout(end, conv_kernel=4)
    inputs = gdn_inputs(end.shape[0], seed=seed)
    weight = torch.randn(end.shape[0], 3, 12, generator=torch.Generator().manual_seed(seed + 1))
    o = tree_gated_delta_rule(*inputs, layout, scale=scale)
    grads = torch.autograd.grad((o * weight).sum(), inputs)
    ref_fn = _reference if scale is None else (lambda *x: gated_delta_rule_reference(*x, scale=scale)[0])
    ref, loss = per_path(ref_fn, end, inputs, weight)
    ref_grads = torch.autograd.grad(loss, inputs)
    return o, ref, grads, ref_grads


@pytest.mark.parametrize("name", list(CASES))
def test_tree_equals_each_root_path_alone(name):
    o, ref, grads, ref_grads = _compare(CASES[name])
    assert o.dtype == torch.float32
    errors = {"o": rel_err(o, ref)}
    errors |= {f"d{n}": rel_err(a, b) for n, a, b in zip("q k v g beta".split(), grads, ref_grads)}
    assert max(errors.values()) < 1e-5, errors


def test_scale_is_passed_through():
    o, ref, _, _ = _compare(CASES["random-bushy"], scale=0.3)
    assert rel_err(o, ref) < 1e-5


def test_one_chunked_call_per_level(monkeypatch):
    end = CASES["handmade"]
    layout = tree_scan_layout(end, conv_kernel=4)
    calls = []
    real = tree_module.unchecked_chunk_gated_delta_rule

    def counting(*args, **kwargs):
        calls.append(len(kwargs["lengths"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(tree_module, "unchecked_chunk_gated_delta_rule", counting)
    tree_gated_delta_rule(*gdn_inputs(end.shape[0]), layout)
    assert len(calls) == layout.num_levels
    assert sum(calls) == len(layout.segment_start) > layout.num_levels  # many segments, few calls


def test_a_child_started_from_zero_is_detected(monkeypatch):
    """The comparison can fail: children that ignore their parent's state are far off."""
    real = tree_module.unchecked_chunk_gated_delta_rule

    def zero_start(*args, **kwargs):
        return real(*args, **(kwargs | {"initial_state": None}))

    monkeypatch.setattr(tree_module, "unchecked_chunk_gated_delta_rule", zero_start)
    o, ref, _, _ = _compare(CASES["handmade"])
    assert rel_err(o, ref) > 1e-2


def test_sibling_state_gradients_add_up_at_the_branch_point():
    """A root segment with two children, loss on the children only: the root's gradients are the sum of
    what each child's sequence alone sends back through the state (non-zero for k, v, g, beta; q reads only)."""
    end = torch.tensor([7, 7, 7, 5, 5, 7, 7], dtype=torch.int32)  # [0 1 2] -> [3 4], [5 6]
    layout = tree_scan_layout(end, conv_kernel=1)
    assert layout.level_lengths == ((3,), (2, 2))
    inputs = gdn_inputs(7, seed=3)
    weight = torch.randn(7, 3, 12)
    weight[:3] = 0
    o = tree_gated_delta_rule(*inputs, layout)
    tree_grads = torch.autograd.grad((o * weight).sum(), inputs)
    parts = []
    for path in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6]):
        idx = torch.tensor(path)
        y = _reference(*(x[idx] for x in inputs))
        parts.append(torch.autograd.grad((y * weight[idx]).sum(), inputs))
    for n, tree_grad, a, b in zip("q k v g beta".split(), tree_grads, *parts):
        if n != "q":
            assert a[:3].abs().max() > 1e-3 and b[:3].abs().max() > 1e-3, n
        assert rel_err(tree_grad, a + b) < 1e-5, n


def test_bad_inputs_are_refused_naming_the_tensor():
    end = CASES["random-bushy"]
    layout = tree_scan_layout(end, conv_kernel=4)
    q, k, v, g, beta = (x.detach() for x in gdn_inputs(end.shape[0]))
    with pytest.raises(ValueError, match=r"q must be \[T, H, Kd\] with T = layout.num_slots"):
        tree_gated_delta_rule(q[:-1], k, v, g, beta, layout)
    with pytest.raises(ValueError, match=r"v must be \[T, H, Vd\]"):
        tree_gated_delta_rule(q, k, v[:, :2], g, beta, layout)
    with pytest.raises(ValueError, match=r"beta must be \[T, H\]"):
        tree_gated_delta_rule(q, k, v, g, beta[..., None], layout)
    with pytest.raises(ValueError, match="share one dtype"):
        tree_gated_delta_rule(q, k.double(), v, g, beta, layout)
    with pytest.raises(ValueError, match="g must be a floating-point tensor"):
        tree_gated_delta_rule(q, k, v, g.long(), beta, layout)
    bad = g.clone()
    bad[5, 1] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite values \(inf or nan\) in g;"):
        tree_gated_delta_rule(q, k, v, bad, beta, layout)
    with pytest.raises(ValueError, match=r"layout.to\(q.device\)"):
        tree_gated_delta_rule(q, k, v, g, beta, layout.to("meta"))


@pytest.mark.gpu
def test_fla_tree_within_twice_fla_per_path_on_gpu(monkeypatch):
    """bf16 on CUDA: the tree through fla (one varlen call per level, children from their parent's state) within 2x
    the error of fla on every root path alone (the flat path users run), both against the fp32 PyTorch tree on the
    fp32 inputs (equal to the CPU's): output and gradients of q, k, v, g, beta."""
    if not torch.cuda.is_available() or chunk_module._fla_chunk_gated_delta_rule is None:
        pytest.skip("needs a CUDA GPU and flash-linear-attention (fla-core >= 0.6)")
    if not os.environ.get("MEGATRON_TREE_FLA_CHECK"):
        pytest.skip(FLA_OFF)
    monkeypatch.setattr(chunk_module, "FLA_DTYPES", (torch.bfloat16, torch.float16))
    end = CASES["random-bushy"]
    layout = tree_scan_layout(end.cuda(), conv_kernel=4)
    inputs = [x.detach().cuda() for x in gdn_inputs(end.shape[0], heads=4, dk=64, dv=32)]
    weight = torch.randn(end.shape[0], 4, 32, generator=torch.Generator().manual_seed(5)).cuda()

    def tree(xs):
        xs = [x.clone().requires_grad_() for x in xs]
        o = tree_gated_delta_rule(*xs, layout)
        return [o, *torch.autograd.grad((o.float() * weight).sum(), xs)]

    def paths(xs):
        xs = [x.clone().requires_grad_() for x in xs]
        o, loss = per_path(lambda *p: chunk_gated_delta_rule(*(x[None] for x in p))[0][0], end.cuda(), xs, weight)
        return [o, *torch.autograd.grad(loss, xs)]

    exact = tree(inputs)
    cpu_layout = tree_scan_layout(end, conv_kernel=4)
    cpu = [x.clone().cpu().requires_grad_() for x in inputs]
    o = tree_gated_delta_rule(*cpu, cpu_layout)
    for a, b in zip(exact, [o, *torch.autograd.grad((o * weight.cpu()).sum(), cpu)]):
        assert rel_err(a.cpu(), b) < 1e-5
    low = [x.bfloat16() if i < 3 else x for i, x in enumerate(inputs)]
    got, flat = tree(low), paths(low)
    for name, a, b, e in zip("o dq dk dv dg dbeta".split(), got, flat, exact):
        print(f"{name}: tree fla bf16 {rel_err(a, e):.2e}, per-path fla bf16 {rel_err(b, e):.2e}")
        assert rel_err(a, e) <= 2 * rel_err(b, e) + 1e-6, name

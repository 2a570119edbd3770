"""tree_causal_conv1d: every slot equals ``nn.Conv1d(D, D, K, groups=D, padding=K-1)`` run on its root path
alone (values and gradients of x, weight, bias, fp32), any width K, with and without bias; low precision
keeps its dtype; bad inputs are refused naming the tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gdn_trees import per_path, rel_err, tree_cases

from megatron_tree.linear_attention import tree_causal_conv1d, tree_scan_layout

CASES = tree_cases()


def _conv_alone(x, weight, bias):
    """x [L, D] of one sequence -> [L, D], fp64, as nn.Conv1d(groups=D, padding=K-1) truncated to L."""
    k = weight.shape[1]
    y = F.conv1d(x.double().T[None], weight.double()[:, None], None if bias is None else bias.double(),
                 padding=k - 1, groups=x.shape[1])
    return y[0, :, : x.shape[0]].T


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kernel,with_bias", [(4, True), (2, False), (1, True), (7, True)])
def test_tree_conv_equals_each_root_path_alone(name, kernel, with_bias):
    end = CASES[name]
    t, d = end.shape[0], 5
    layout = tree_scan_layout(end, conv_kernel=kernel)
    gen = torch.Generator().manual_seed(kernel)
    x = torch.randn(t, d, generator=gen, requires_grad=True)
    weight = torch.randn(d, kernel, generator=gen, requires_grad=True)
    bias = torch.randn(d, generator=gen, requires_grad=True) if with_bias else None
    params = [p for p in (x, weight, bias) if p is not None]
    w_out = torch.randn(t, d, generator=gen)
    y = tree_causal_conv1d(x, weight, bias, layout)
    grads = torch.autograd.grad((y * w_out).sum(), params)
    ref, loss = per_path(lambda xs: _conv_alone(xs, weight, bias), end, [x], w_out)
    ref_grads = torch.autograd.grad(loss, params)
    errors = {"y": rel_err(y, ref)} | {f"d{n}": rel_err(a, b) for n, a, b in zip(("x", "w", "b"), grads, ref_grads)}
    assert max(errors.values()) < 1e-5, errors


def test_low_precision_keeps_its_dtype():
    end = CASES["random-bushy"]
    layout = tree_scan_layout(end, conv_kernel=4)
    x = torch.randn(end.shape[0], 6, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(6, dtype=torch.bfloat16, requires_grad=True)
    y = tree_causal_conv1d(x, weight, bias, layout)
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.bfloat16
    exact = tree_causal_conv1d(x.float(), weight.float(), bias.float(), layout)
    assert rel_err(y, exact) < 1e-2


def test_bad_inputs_are_refused_naming_the_tensor():
    end = CASES["random-bushy"]
    layout = tree_scan_layout(end, conv_kernel=4)
    x, weight, bias = torch.randn(end.shape[0], 6), torch.randn(6, 4), torch.randn(6)
    with pytest.raises(ValueError, match=r"x must be \[T, D\] with T = layout.num_slots"):
        tree_causal_conv1d(x[1:], weight, bias, layout)
    with pytest.raises(ValueError, match=r"weight must be \[D, K\].*= \[6, 4\], got shape \(6, 1, 4\)"):
        tree_causal_conv1d(x, weight[:, None], bias, layout)
    with pytest.raises(ValueError, match=r"weight must be \[D, K\]"):
        tree_causal_conv1d(x, weight[:, :3], bias, layout)
    with pytest.raises(ValueError, match=r"bias must be \[D\]"):
        tree_causal_conv1d(x, weight, bias[:5], layout)
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        tree_causal_conv1d(x.long(), weight, bias, layout)
    bad = weight.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite values \(inf or nan\) in weight;"):
        tree_causal_conv1d(x, bad, bias, layout)
    with pytest.raises(ValueError, match=r"layout.to\(x.device\)"):
        tree_causal_conv1d(x, weight, bias, layout.to("meta"))

"""The causal depthwise conv1d of a recurrent layer (Qwen3-Next / Mamba's short conv) on a tree.

Shape legend: T = slots, D = channels, K = kernel width.

Run alone, a sequence x [L, D] gives ``nn.Conv1d(D, D, K, groups=D, padding=K-1)(x.T)[..., :L]``:
``y[t] = bias + sum_c weight[:, c] * x[t - (K-1) + c]`` (zeros before the sequence's start). On a tree
the K - 1 previous tokens of a slot are its nearest ancestors (``TreeScanLayout.conv_ancestors``), so
every slot gets exactly what its sequences get alone; in a chunk of a larger tree the ancestors that earlier
chunks computed come as their *windows* (:func:`tree_conv_windows`). Pre-activation (apply SiLU after).
"""

from __future__ import annotations

import torch

from megatron_tree.linear_attention.checks import (check_carried, check_finite, check_floating, check_shape,
                                                   compute_dtype)
from megatron_tree.linear_attention.scan_layout import TreeScanLayout

__all__ = ["tree_causal_conv1d", "tree_conv_windows"]


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       layout: TreeScanLayout, carried_windows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv of ``x`` [T, D] along every slot's root path -> [T, D] in x's dtype (math in fp64 for
    fp64 ``x``, else fp32).

    ``weight`` [D, K] is ``nn.Conv1d(D, D, K, groups=D).weight.squeeze(1)``, ``bias`` [D] or None, and
    ``layout`` comes from ``tree_scan_layout(subtree_end, conv_kernel=K, ...)``. ``carried_windows``
    [R, K-1, D] (R = ``layout.num_carried`` > 0 only, else None): the conv inputs of each carried context slot
    and its nearest ancestors (:func:`tree_conv_windows` of the chunk that computed them). Differentiable in
    all four; saves only the inputs and weight for the backward.
    """
    x_ext = _extended_input(x, weight, bias, layout, carried_windows)
    return _TreeCausalConv1d.apply(x_ext, weight, bias, layout.conv_ancestors)


def tree_conv_windows(x: torch.Tensor, layout: TreeScanLayout, carried_windows: torch.Tensor | None = None,
                      ) -> torch.Tensor:
    """The conv windows of ``layout.state_exports``: [Q, K-1, D], row c the conv input ``K - 1 - c`` steps above
    a child of the export (zero above a root), what a later chunk passes as ``carried_windows``. ``x`` and
    ``carried_windows`` as :func:`tree_causal_conv1d`'s; differentiable."""
    x_ext = _extended_input(x, None, None, layout, carried_windows)
    return _padded(x_ext).to(x.dtype)[layout.export_windows]


def _extended_input(x, weight, bias, layout, carried_windows) -> torch.Tensor:
    """``[carried windows' rows | x]`` [W + T, D] after checking the inputs."""
    check_floating(x=x, weight=weight, bias=bias, carried_windows=carried_windows)
    check_shape("x", x, (layout.num_slots, None), f"[T, D] with T = layout.num_slots")
    d = x.shape[1]
    if weight is not None:
        check_shape("weight", weight, (d, layout.conv_kernel), "[D, K] (nn.Conv1d(groups=D).weight.squeeze(1)) "
                    "with K = layout.conv_kernel")
    if bias is not None:
        check_shape("bias", bias, (d,), "[D]")
    r = layout.num_carried
    check_carried("carried_windows", carried_windows, r, (r, layout.conv_kernel - 1, d), "[R, K-1, D]")
    devices = {t.device for t in (x, weight, bias, carried_windows) if t is not None} | {layout.device}
    if len(devices) > 1:
        raise ValueError(f"x, weight, bias, carried_windows and layout must be on one device, got "
                         f"{sorted(map(str, devices))}; move the layout with layout.to(x.device)")
    check_finite(x=x, weight=weight, bias=bias, carried_windows=carried_windows)
    return x if not r else torch.cat([carried_windows.reshape(-1, d).to(x.dtype), x])


class _TreeCausalConv1d(torch.autograd.Function):
    """y [T, D] = bias + sum_c weight[:, c] * x_pad[taps[:, c]], the last tap being the slot itself: row
    ``W + slot`` of ``x`` [W + T, D] (W rows of carried windows first)."""

    @staticmethod
    def forward(ctx, x, weight, bias, ancestors):
        ctx.save_for_backward(x, weight, ancestors)
        ctx.bias_dtype = None if bias is None else bias.dtype
        xp = _padded(x)
        w = weight.to(xp.dtype)
        own = x.shape[0] - ancestors.shape[0]
        y = xp[own:-1] * w[:, -1]
        for c in range(ancestors.shape[1]):
            y = y + xp[ancestors[:, c]] * w[:, c]
        if bias is not None:
            y = y + bias.to(xp.dtype)
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, ancestors = ctx.saved_tensors
        xp = _padded(x)
        dy = dy.to(xp.dtype)
        w = weight.to(xp.dtype)
        own = x.shape[0] - ancestors.shape[0]
        dx = torch.zeros_like(xp)
        dx[own:-1] = dy * w[:, -1]
        dw = torch.empty_like(w)
        dw[:, -1] = (dy * xp[own:-1]).sum(0)
        for c in range(ancestors.shape[1]):
            dx.index_add_(0, ancestors[:, c], dy * w[:, c])
            dw[:, c] = (dy * xp[ancestors[:, c]]).sum(0)
        dbias = None if ctx.bias_dtype is None else dy.sum(0).to(ctx.bias_dtype)
        return dx[:-1].to(x.dtype), dw.to(weight.dtype), dbias, None


def _padded(x: torch.Tensor) -> torch.Tensor:
    """[N + 1, D] in ``compute_dtype(x.dtype)``: x then a zero row (what a missing ancestor reads)."""
    dtype = compute_dtype(x.dtype)
    return torch.cat([x.to(dtype), x.new_zeros((1, x.shape[1]), dtype=dtype)])

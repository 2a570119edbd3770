"""The causal depthwise conv1d of a recurrent layer (Qwen3-Next / Mamba's short conv) on a tree.

Shape legend: T = slots, D = channels, K = kernel width.

Run alone, a sequence x [L, D] gives ``nn.Conv1d(D, D, K, groups=D, padding=K-1)(x.T)[..., :L]``:
``y[t] = bias + sum_c weight[:, c] * x[t - (K-1) + c]`` (zeros before the sequence's start). On a tree
the K - 1 previous tokens of a slot are its nearest ancestors (``TreeScanLayout.conv_ancestors``), so
every slot gets exactly what its sequences get alone. Pre-activation (apply SiLU after).
"""

from __future__ import annotations

import torch

from megatron_tree.linear_attention.checks import check_finite, check_floating, check_shape
from megatron_tree.linear_attention.scan_layout import TreeScanLayout

__all__ = ["tree_causal_conv1d"]


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       layout: TreeScanLayout) -> torch.Tensor:
    """Causal depthwise conv of ``x`` [T, D] along every slot's root path -> [T, D] in x's dtype (fp32 math).

    ``weight`` [D, K] is ``nn.Conv1d(D, D, K, groups=D).weight.squeeze(1)``, ``bias`` [D] or None, and
    ``layout`` comes from ``tree_scan_layout(subtree_end, conv_kernel=K)``. Differentiable in all three;
    saves only x and weight for the backward.
    """
    check_floating(x=x, weight=weight, bias=bias)
    check_shape("x", x, (layout.num_slots, None), f"[T, D] with T = layout.num_slots")
    d = x.shape[1]
    check_shape("weight", weight, (d, layout.conv_kernel), "[D, K] (nn.Conv1d(groups=D).weight.squeeze(1)) with "
                "K = layout.conv_kernel")
    if bias is not None:
        check_shape("bias", bias, (d,), "[D]")
    devices = {t.device for t in (x, weight, bias) if t is not None} | {layout.device}
    if len(devices) > 1:
        raise ValueError(f"x, weight, bias and layout must be on one device, got {sorted(map(str, devices))}; "
                         f"move the layout with layout.to(x.device)")
    check_finite(x=x, weight=weight, bias=bias)
    return _TreeCausalConv1d.apply(x, weight, bias, layout.conv_ancestors)


class _TreeCausalConv1d(torch.autograd.Function):
    """y [T, D] = bias + sum_c weight[:, c] * x_pad[taps[:, c]], the last tap being the slot itself."""

    @staticmethod
    def forward(ctx, x, weight, bias, ancestors):
        ctx.save_for_backward(x, weight, ancestors)
        ctx.bias_dtype = None if bias is None else bias.dtype
        xp = _padded(x)
        w = weight.float()
        y = x.float() * w[:, -1]
        for c in range(ancestors.shape[1]):
            y = y + xp[ancestors[:, c]] * w[:, c]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, ancestors = ctx.saved_tensors
        dy = dy.float()
        xp = _padded(x)
        w = weight.float()
        t = x.shape[0]
        dx = torch.zeros_like(xp)
        dx[:t] = dy * w[:, -1]
        dw = torch.empty_like(w)
        dw[:, -1] = (dy * xp[:t]).sum(0)
        for c in range(ancestors.shape[1]):
            dx.index_add_(0, ancestors[:, c], dy * w[:, c])
            dw[:, c] = (dy * xp[ancestors[:, c]]).sum(0)
        dbias = None if ctx.bias_dtype is None else dy.sum(0).to(ctx.bias_dtype)
        return dx[:t].to(x.dtype), dw.to(weight.dtype), dbias, None


def _padded(x: torch.Tensor) -> torch.Tensor:
    """fp32 [T + 1, D]: x then a zero row (what a missing ancestor, index T, reads)."""
    return torch.cat([x.float(), x.new_zeros((1, x.shape[1]), dtype=torch.float32)])

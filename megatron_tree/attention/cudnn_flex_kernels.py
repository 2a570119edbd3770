"""cuDNN frontend's flex attention kernels (``nvidia-cudnn-frontend``, pinned 1.32.0), launched without its per-call Python.

``cudnn.flex_attention.flex_attn_func`` spends about half a millisecond of host time on a forward call, and more on
a backward, before it launches its kernels: argument checks, tile configuration, plan normalisation, cache keys. In a
tree step the GPU waits on it. On an H100, the 0.6B shape's profiled GRPO step sat idle 191 ms in gaps under 1 ms,
70 ms of them inside the frontend's forward calls, against 29 ms in all with FA4 (multi-turn: 148 ms against 66;
docs/results.md). Every layer of a micro-batch makes the same call: same mask plan, same tensor geometry.

So each geometry is resolved once, with the frontend's own code, and every call of it launches the compiled
kernels directly (the cache lives in the micro-batch's :class:`~megatron_tree.attention.cudnn_flex.CudnnFlexTreeMask`):

- **forward**: the frontend's explicit API (``FlexAttentionFwd``: checks, compile) and its dispatch (``_prepare``:
  tile configuration, the normalised plan). Each call then runs ``dispatch._launch_flex_attn_fwd``, the frontend's
  own launch of its compiled kernel.
- **backward** (SM90): the explicit ``FlexAttentionBwd`` runs the first call, and the arguments of its main kernel are
  recorded (the plan's normalised runtime tensors and the sequence bounds, which the frontend derives on every call).
  Every later call launches the compiled kernels as ``dispatch._flex_attn_bwd`` of 1.32.0 does on SM90 (not
  deterministic, no LSE gradient): the dO · O preprocess, the main kernel, the dQ conversion and, with GQA, the dK / dV
  conversions from zero-filled fp32 accumulators.

The kernels, their arguments and their order are the frontend's; only its per-call Python is skipped. Checked on the
GPU by tests/attention/test_cudnn_flex.py: the forward bit for bit against ``flex_attn_func``, the gradients within
bf16 rounding of it (its GQA dK / dV are fp32 atomic sums, in no fixed order), and both against the dense fp64
reference. Imports the frontend: only :mod:`megatron_tree.attention.cudnn_flex` imports this module, where the
kernels run.
"""

from __future__ import annotations

import dataclasses

import torch
from cudnn.flex_attention import FlexAttentionBwd, FlexAttentionFwd
from cudnn.flex_attention import dispatch as frontend_dispatch
from cudnn.flex_attention import execution as frontend_execution

__all__ = ["flex_attention"]

_ZEROED = ("dk_accum", "dv_accum")
"""Backward workspaces the main kernel adds into (fp32 atomics): zero-filled on every call, as the frontend does."""


def _signature(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


class _Forward:
    """The forward of one (mask plan, q / k / v geometry, with or without the LSE the backward needs)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, with_lse: bool):
        meta = plan.metadata
        if meta.mode == "varlen":
            out_shape, lse_shape = (meta.total_q, meta.num_q_heads, meta.head_dim_v), (meta.num_q_heads, meta.total_q)
        else:
            s = meta.total_q // meta.batch_size
            out_shape = (meta.batch_size, s, meta.num_q_heads, meta.head_dim_v)
            lse_shape = (meta.batch_size, meta.num_q_heads, s)
        out = q.new_empty(out_shape)
        lse = q.new_empty(lse_shape, dtype=torch.float32) if with_lse else None
        api = FlexAttentionFwd(q, k, v, out, plan, lse)
        api.check_support()
        api.compile()
        self.kernel = api._compiled_kernel
        self.dispatch = api._prepare(q, k, v, plan)
        self.cu_q, self.cu_k, _, _ = frontend_execution._sequence_args(plan)
        self.with_lse = with_lse

    def __call__(self, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        d = self.dispatch
        out = torch.empty(d.output_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(d.lse_shape, dtype=torch.float32, device=q.device) if self.with_lse else None
        counter = torch.empty(1, dtype=torch.int32, device=q.device) if d.arch == 90 else None  # zeroed by the launch
        frontend_dispatch._launch_flex_attn_fwd(d, self.kernel, q, k, v, out, lse, scale, self.cu_q, self.cu_k, counter)
        return out, lse


class _Backward:
    """The backward of one (mask plan, q / k / v / out / dO / LSE geometry, scale): the compiled kernels and the main
    kernel's per-plan arguments, from a recorded call (:meth:`record`)."""

    def __init__(self, compiled, main_args: tuple):
        if len(main_args) != 18 or not isinstance(main_args[15], tuple):
            raise RuntimeError("cuDNN frontend's flex backward called its main kernel with arguments this launch path "
                               "does not know (it is written against nvidia-cudnn-frontend 1.32.0's SM90 backward); "
                               "install the pinned version")
        self.compiled = compiled
        self.cu_q, self.cu_k, self.sparse, self.max_q, self.max_k = (main_args[i] for i in (10, 11, 15, 16, 17))

    @classmethod
    def record(cls, q, k, v, out, dout, lse, plan, scale: float) -> tuple[_Backward, tuple[torch.Tensor, ...]]:
        """Run the backward through the frontend's explicit API, recording its main kernel's arguments: the launch
        for later calls, and this call's (dq, dk, dv)."""
        grads = tuple(torch.empty_like(x) for x in (q, k, v))
        api = FlexAttentionBwd(q, k, v, out, dout, lse, *grads, plan)
        api.check_support()
        api.compile()
        compiled, recorded = api._compiled_kernel, []

        def main(*args):
            recorded.append(args)
            return compiled.main(*args)

        api._compiled_kernel = dataclasses.replace(compiled, main=main)
        workspace = torch.empty(api.workspace_size, dtype=torch.uint8, device=q.device)
        api.execute(q, k, v, out, dout, lse, *grads, plan, workspace=workspace, softmax_scale=scale)
        if len(recorded) != 1:
            raise RuntimeError(f"cuDNN frontend's flex backward called its main kernel {len(recorded)} times, not once "
                               f"(this launch path is written against nvidia-cudnn-frontend 1.32.0); install it")
        return cls(compiled, recorded[0]), grads

    def __call__(self, q, k, v, out, dout, lse, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, dev = self.compiled, q.device
        ws = {name: None if shape is None else (torch.zeros if name in _ZEROED else torch.empty)(
            shape, dtype=dtype, device=dev) for name, shape, dtype in c.workspace_specs}
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        gqa = ws["dk_accum"] is not None
        c.preprocess(out, dout, ws["dpsum"], lse, ws["lse_log2"], ws["dq_accum"], self.cu_q, None, self.max_q)
        c.main(q.detach(), k.detach(), v.detach(), dout, ws["lse_log2"], ws["dpsum"], ws["dq_accum"],
               ws["dk_accum"] if gqa else dk, ws["dv_accum"] if gqa else dv, scale, self.cu_q, self.cu_k,
               None, None, None, self.sparse, self.max_q, self.max_k)
        c.post_dq(ws["dq_accum"], dq, scale, self.cu_q, self.max_q)
        if gqa:
            c.post_dk(ws["dk_accum"], dk, scale, self.cu_k, self.max_k)
            c.post_dv(ws["dv_accum"], dv, 1.0, self.cu_k, self.max_k)
        return dq, dk, dv


def _forward(q, k, v, plan, launches: dict, scale: float, with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    key = ("fwd", id(plan), _signature(q, k, v), with_lse)
    launch = launches.get(key)
    if launch is None:
        launch = launches[key] = _Forward(q, k, v, plan, with_lse)
    return launch(q, k, v, scale)


class _FlexAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, launches: dict, scale: float):
        out, lse = _forward(q, k, v, plan, launches, scale, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.launches, ctx.scale = plan, launches, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        key = ("bwd", id(ctx.plan), _signature(q, k, v, out, dout, lse), ctx.scale)
        launch = ctx.launches.get(key)
        if launch is None:
            ctx.launches[key], grads = _Backward.record(q, k, v, out, dout, lse, ctx.plan, ctx.scale)
        else:
            grads = launch(q, k, v, out, dout, lse, ctx.scale)
        return (*grads, None, None, None)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, scale: float, launches: dict) -> torch.Tensor:
    """``flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale)`` with each geometry's per-call Python done once
    (module docstring). Differentiable. q ``[B, Sq, h, d]`` / k ``[B, Sk, hkv, d]`` / v ``[B, Sk, hkv, dv]`` (BSHD), or
    ``[total, heads, d]`` (THD) for a plan built with ``cu_seqlens``; returns ``[B, Sq, h, dv]`` or ``[total_q, h, dv]``.
    ``launches``: the cache of resolved geometries (keyed by the plan's identity: keep it no longer than the plan)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _FlexAttention.apply(q, k, v, plan, launches, float(scale))
    return _forward(q, k, v, plan, launches, float(scale), False)[0]

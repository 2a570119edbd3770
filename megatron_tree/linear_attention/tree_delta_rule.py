"""The gated delta rule on a tree: every slot's output as if its root path ran alone from a zero state.

Shape legend: T = slots, H = heads, Kd = query/key head dim, Vd = value head dim, L = levels,
N_l = segments of level l, T_l = slots of level l.

The scan runs level by level (``TreeScanLayout``): the segments of a level are independent sequences of
one varlen :func:`~megatron_tree.linear_attention.chunked_delta_rule.chunk_gated_delta_rule` call,
each starting from the final state of its parent segment (siblings from the same state, roots from
zero, or, in a chunk of a larger tree, from the state an earlier chunk's scan ended with at their parent). Calls: L, the tree's depth in segments, whatever the number of segments. The backward carries
each segment's initial-state gradient to its parent's final state; siblings' gradients add up there.
"""

from __future__ import annotations

import torch

from megatron_tree.linear_attention.checks import (check_carried, check_finite, check_floating, check_shape,
                                                   compute_dtype)
from megatron_tree.linear_attention.chunked_delta_rule import unchecked_chunk_gated_delta_rule
from megatron_tree.linear_attention.scan_layout import TreeScanLayout

__all__ = ["tree_gated_delta_rule"]


def tree_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          layout: TreeScanLayout, *, scale: float | None = None,
                          initial_states: torch.Tensor | None = None, output_states: bool = False):
    """Gated delta rule of ``q``, ``k`` [T, H, Kd], ``v`` [T, H, Vd], ``g`` (log decay, <= 0), ``beta`` [T, H]
    along every slot's root path -> ``o`` [T, H, Vd] in q's dtype.

    ``layout`` is ``tree_scan_layout(subtree_end, ...)`` of the micro-batch; ``scale`` defaults to
    ``Kd ** -0.5`` (no l2 norm inside). Semantics per path: ``chunk_gated_delta_rule`` (fla's) from a zero
    state, or, for slots hanging from a chunk's context, from ``initial_states`` [R, H, Kd, Vd] (R =
    ``layout.num_carried`` > 0 only: the states the earlier chunks' scans ended with at the carried slots).
    ``output_states``: return ``(o, states [Q, H, Kd, Vd])``, the states at ``layout.state_exports``, in
    ``compute_dtype(q.dtype)`` (fp64 for fp64 inputs, the math's dtype then, else fp32).
    Differentiable in q, k, v, g, beta and initial_states.
    """
    check_floating(q=q, k=k, v=v, g=g, beta=beta, initial_states=initial_states)
    check_shape("q", q, (layout.num_slots, None, None), "[T, H, Kd] with T = layout.num_slots")
    t, h, dk = q.shape
    check_shape("k", k, (t, h, dk), "[T, H, Kd] like q")
    check_shape("v", v, (t, h, None), "[T, H, Vd] like q")
    check_shape("g", g, (t, h), "[T, H] like q")
    check_shape("beta", beta, (t, h), "[T, H] like q")
    r = layout.num_carried
    check_carried("initial_states", initial_states, r, (r, h, dk, v.shape[2]), "[R, H, Kd, Vd]")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; cast them")
    devices = {x.device for x in (q, k, v, g, beta, initial_states) if x is not None} | {layout.device}
    if len(devices) > 1:
        raise ValueError(f"q, k, v, g, beta, initial_states and layout must be on one device, got "
                         f"{sorted(map(str, devices))}; move the layout with layout.to(q.device)")
    check_finite(q=q, k=k, v=v, g=g, beta=beta, initial_states=initial_states)

    dtype = compute_dtype(q.dtype)
    final = None
    if r:  # level 0 starts from the carried states, or from the zero row R
        final = torch.cat([initial_states.to(dtype), initial_states.new_zeros((1,) + initial_states.shape[1:],
                                                                              dtype=dtype)])
    outputs, picks = [], []
    for level in range(layout.num_levels):
        slots = layout.level_slots[level]
        exports = layout.level_exports[level] if output_states else None
        o, final = unchecked_chunk_gated_delta_rule(
            q[slots][None], k[slots][None], v[slots][None], g[slots][None], beta[slots][None],
            scale=scale,
            initial_state=None if final is None else final[layout.level_parent[level] if level else layout.root_carried],
            output_final_state=level + 1 < layout.num_levels or (output_states and exports.numel() > 0),
            cu_seqlens=layout.level_cu_seqlens[level],
            lengths=layout.level_lengths[level],
        )
        outputs.append(o[0])
        if output_states:
            picks.append(final[exports] if exports.numel() else o.new_zeros((0, h, dk, v.shape[2]), dtype=dtype))
    o = torch.cat(outputs)[layout.scan_position]
    return (o, torch.cat(picks)[layout.export_order]) if output_states else o

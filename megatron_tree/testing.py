"""Helpers for megatron_tree's own tests: the references a tree run is compared with (Hugging Face logits,
the per-token gated delta rule).

The run-time helpers that lived here (``cpu_mode``, ``init_cpu_distributed``, ``destroy_cpu_distributed``,
``save_tiny_hf_checkpoint``, ``save_hf_config``, ``tiny_hf_config``, ``TINY_ARCHS``) are in
:mod:`megatron_tree.runtime` now; importing them from here still works for a release, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["gated_delta_rule_reference", "hf_reference_logits"]

_MOVED = {
    "cpu_mode": "cpu_mode",
    "init_cpu_distributed": "init_cpu_distributed",
    "destroy_cpu_distributed": "destroy_distributed",
    "save_tiny_hf_checkpoint": "save_tiny_hf_checkpoint",
    "save_hf_config": "save_hf_config",
    "tiny_hf_config": "tiny_hf_config",
    "TINY_ARCHS": "TINY_ARCHS",
}


def __getattr__(name: str):
    if name in _MOVED:
        from megatron_tree import runtime

        warnings.warn(f"megatron_tree.testing.{name} moved to megatron_tree.runtime.{_MOVED[name]}",
                      DeprecationWarning, stacklevel=2)
        return getattr(runtime, _MOVED[name])
    raise AttributeError(f"module 'megatron_tree.testing' has no attribute {name!r}")


def hf_reference_logits(hf_path: str | os.PathLike, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, S, V]`` fp32 of the HF model at ``hf_path`` (eval, causal) for ``input_ids`` ``[b, S]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.fspath(hf_path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def gated_delta_rule_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of one sequence, one token at a time, in fp64 (differentiable).

    ``q``, ``k`` [L, H, Kd], ``v`` [L, H, Vd], ``g`` (log decay), ``beta`` [L, H], ``initial_state``
    [H, Kd, Vd] (zero if None) -> (``o`` [L, H, Vd], final state [H, Kd, Vd]), both fp64. Per head, with
    state S [Kd, Vd]: ``S = exp(g_t) S``; ``S = S + k_t (beta_t (v_t - S^T k_t))^T``; ``o_t = scale S^T q_t``
    (``scale`` defaults to ``Kd ** -0.5``).
    """
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = (q.new_zeros(q.shape[1], q.shape[2], v.shape[2]) if initial_state is None
             else initial_state.double())
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(scale * torch.einsum("hkv,hk->hv", state, q[t]))
    o = torch.stack(out) if out else v.new_zeros(v.shape)
    return o, state

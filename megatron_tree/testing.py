"""Helpers for megatron_tree's own tests: the Hugging Face reference a tree run is compared with.

The run-time helpers that lived here (``cpu_mode``, ``init_cpu_distributed``, ``destroy_cpu_distributed``,
``save_tiny_hf_checkpoint``, ``save_hf_config``, ``tiny_hf_config``, ``TINY_ARCHS``) are in
:mod:`megatron_tree.runtime` now; importing them from here still works for a release, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["hf_reference_logits"]

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

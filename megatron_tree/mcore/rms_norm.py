"""RMSNorm for megatron-core's local (non-Transformer-Engine) spec, zero-centred gamma included.

megatron-core's local norm (``WrappedTorchNorm``) refuses ``layernorm_zero_centered_gamma``; Transformer Engine's
``TENorm`` honours it. Qwen3-Next and Qwen3.5 need it: their norms compute ``x / rms(x) * (1 + w)``. This module is
what the local hybrid spec (:mod:`megatron_tree.mcore.hybrid_spec`) builds in place of both, with the parameter name
(``weight``) and the call contract (``config, hidden_size, eps``) of megatron-core's norms.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["RMSNorm"]


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x²) + eps) * g`` over the last dim, computed in fp32 (fp64 for fp64 ``x``: the exactness
    checks) and cast back to ``x``'s dtype;
    ``g = 1 + weight`` when ``config.layernorm_zero_centered_gamma`` (weight starts at 0), else ``weight`` (starts
    at 1). ``x [..., hidden_size]``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"megatron_tree.mcore.rms_norm.RMSNorm is an RMSNorm, but the config has normalization="
                f"{config.normalization!r}; use megatron-core's own norm for other normalizations"
            )
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.to(xc.dtype)
        return (y * (weight + 1.0 if self.zero_centered_gamma else weight)).to(x.dtype)

"""A transformer layer that also normalises what its attention and its MLP return ("sandwich" norms: Gemma 2 / 3).

Gemma 3's decoder layer is ``h = h + post_attn_norm(attn(input_norm(h)))``, then
``h = h + post_ffn_norm(mlp(pre_ffn_norm(h)))``. megatron-core 0.16-0.19's ``TransformerLayer`` has the two norms
before (``input_layernorm``, ``pre_mlp_layernorm``, fused into ``linear_qkv`` / ``linear_fc1`` under Transformer
Engine) and none after. :class:`SandwichNormTransformerLayer` adds ``post_self_attn_layernorm`` and
``post_mlp_layernorm`` and applies each to its sublayer's output inside the layer's bias-dropout-add, before the
residual is added, so everything else (recompute, offloading, Transformer Engine fusions) stays megatron-core's.
Biases cannot be normalised apart from their output: the layer refuses ``add_bias_linear``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["SandwichNormLayerSubmodules", "SandwichNormTransformerLayer", "sandwich_norm_layer"]


@dataclasses.dataclass
class SandwichNormLayerSubmodules(TransformerLayerSubmodules):
    """``TransformerLayerSubmodules`` plus the norms of the attention's and the MLP's outputs (norm classes built
    as megatron-core builds ``pre_mlp_layernorm``: ``(config=, hidden_size=, eps=)``)."""

    post_self_attn_layernorm: ModuleSpec | type = IdentityOp
    post_mlp_layernorm: ModuleSpec | type = IdentityOp


def _norm_then(norm: Callable, bda: Callable) -> Callable:
    """A bias-dropout-add builder (``bda(training, fused)(out_with_bias, residual, p)``) that normalises the output
    first."""

    def build(training: bool, fused: bool) -> Callable:
        add = bda(training, fused)

        def norm_dropout_add(out_with_bias, residual, prob):
            out, bias = out_with_bias
            return add((norm(out), bias), residual, prob)

        return norm_dropout_add

    return build


class SandwichNormTransformerLayer(TransformerLayer):
    """megatron-core's ``TransformerLayer`` with ``post_self_attn_layernorm`` (on the attention output) and
    ``post_mlp_layernorm`` (on the MLP output), each applied before its residual add. Submodules:
    :class:`SandwichNormLayerSubmodules`; other arguments as ``TransformerLayer``."""

    def __init__(self, config, submodules: SandwichNormLayerSubmodules, *args: Any, **kwargs: Any):
        if config.add_bias_linear:
            raise ValueError(
                "SandwichNormTransformerLayer normalises the attention and MLP outputs before the residual add, where "
                "megatron-core adds the linear biases: build it with add_bias_linear=False"
            )
        if getattr(config, "inference_fuse_tp_communication", False):
            raise ValueError("SandwichNormTransformerLayer: inference_fuse_tp_communication adds the residual inside "
                             "the linear layers, before the output norm could run; turn it off")
        super().__init__(config, submodules, *args, **kwargs)
        norm_args = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, **norm_args)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm_args)
        self.self_attn_bda = _norm_then(self.post_self_attn_layernorm, self.self_attn_bda)
        self.mlp_bda = _norm_then(self.post_mlp_layernorm, self.mlp_bda)


def sandwich_norm_layer(layer: ModuleSpec, norm: ModuleSpec | type) -> ModuleSpec:
    """The ``TransformerLayer`` spec ``layer`` as a :class:`SandwichNormTransformerLayer` whose output norms are
    ``norm`` (the spec's other submodules and params unchanged)."""
    sub = layer.submodules
    fields = {f.name: getattr(sub, f.name) for f in dataclasses.fields(sub)}
    submodules = SandwichNormLayerSubmodules(**fields, post_self_attn_layernorm=norm, post_mlp_layernorm=norm)
    return ModuleSpec(module=SandwichNormTransformerLayer, params=layer.params, submodules=submodules)

"""Refuse models that would run tree micro-batches on the wrong attention or RoPE.

A tree micro-batch is one packed row: only tree attention reads its interval mask, and only
per-token RoPE rotates a branch laid out after a sibling by its depth. An upstream model
given the same tensors either fails deep inside (``masked_fill_ only supports boolean
masks``) or, with Transformer Engine's causal attention, returns wrong log-probs silently.
:func:`check_tree_model` walks each model chunk once and raises one error naming the first
offending module (path and class) and how to build a tree model; a chunk that passed is
remembered, so the entry points (``tree_forward_backward``, the launcher) call it every step
for free.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

from megatron_tree.mcore.core_attention import TreeCoreAttention
from megatron_tree.mcore.gated_delta_net import TreeGatedDeltaNet
from megatron_tree.mcore.rope import LAYER_ROPE_ATTENTIONS, TreeRotaryEmbedding

__all__ = ["check_tree_model"]

_HOW_TO_BUILD = (
    "build it with megatron_tree.build_tree_model(hf_path), or under `with "
    "megatron_tree.patch_bridge_for_tree_training():` around AutoBridge.from_pretrained(...) and "
    "bridge.get_model(...), or as GPTModel(transformer_layer_spec=megatron_tree.tree_layer_spec(spec), "
    "...) followed by megatron_tree.convert_to_tree_model(model)"
)

_PASSED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _path(name: str, attr: str) -> str:
    return f"'{name}.{attr}'" if name else f"'{attr}'"


def _cls(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _problems(chunk: torch.nn.Module) -> list[str]:
    """Every reason ``chunk`` cannot run tree micro-batches: attention first, then RoPE."""
    problems, rope_problems = [], []
    gpt_models = 0
    for name, module in chunk.named_modules():
        if isinstance(module, GPTModel):
            gpt_models += 1
            rope = getattr(module, "rotary_pos_emb", None)
            model_rope = module.position_embedding_type in ("rope", "yarn") and not module.config.multi_latent_attention
            if model_rope and not isinstance(rope, TreeRotaryEmbedding):
                rope_problems.append(
                    f"{_path(name, 'rotary_pos_emb')} is {_cls(rope)}, which rotates slot i as position i "
                    f"(wrong for every branch laid out after a sibling; convert_to_tree_model swaps it)"
                )
        if isinstance(module, LAYER_ROPE_ATTENTIONS) and not isinstance(module.rotary_pos_emb, TreeRotaryEmbedding):
            rope_problems.append(
                f"{_path(name, 'rotary_pos_emb')} is {_cls(module.rotary_pos_emb)}: this {type(module).__name__} "
                f"layer's own RoPE rotates slot i as position i (convert_to_tree_model swaps it)"
            )
        if isinstance(module, BaseTransformerLayer):
            attn = getattr(module, "self_attention", None)
            if isinstance(attn, GatedDeltaNet):
                problems.append(
                    f"{_path(name, 'self_attention')} is {_cls(attn)}, whose conv and recurrent state run in packed "
                    f"order (tree_layer_spec swaps it for megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet)"
                )
            elif not isinstance(attn, IdentityOp | TreeGatedDeltaNet) and not isinstance(
                getattr(attn, "core_attention", None), torch.nn.Module
            ):
                problems.append(
                    f"{_path(name, 'self_attention')} is {_cls(attn)}, which has no core_attention to "
                    f"replace by tree attention (linear, state-space or custom token mixers mix by packed order)"
                )
        core = getattr(module, "core_attention", None)
        if isinstance(core, torch.nn.Module) and not isinstance(core, TreeCoreAttention):
            problems.append(
                f"{_path(name, 'core_attention')} is {_cls(core)}, not megatron_tree.attention.TreeCoreAttention "
                f"(it would ignore the tree's interval mask or fail on it)"
            )
        if isinstance(module, TreeCoreAttention) and not module.positions_from_ids:
            rope_problems.append(
                f"'{name}' is TreeCoreAttention with positions_from_ids=False: its model's RoPE was not "
                f"switched to per-token positions (convert_to_tree_model does it)"
            )
    if not gpt_models:
        problems.append(f"there is no megatron.core GPTModel (got {_cls(chunk)}); tree training supports GPTModel")
    return problems + rope_problems


def check_tree_model(model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
    """Raise ``ValueError`` unless every chunk of ``model`` can run tree micro-batches.

    ``model``: a ``GPTModel``, a wrapper holding one (DDP, ``Float16Module``), or the list of
    model chunks ``get_model`` returns. Each chunk needs a ``GPTModel`` whose RoPE (if any; under
    multi-latent attention each attention layer's) is :class:`~megatron_tree.mcore.rope.TreeRotaryEmbedding`, every ``core_attention`` a
    :class:`~megatron_tree.attention.TreeCoreAttention` fed per-token positions
    (``positions_from_ids``), and every transformer layer's ``self_attention`` either such an
    attention, a :class:`~megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet` or ``IdentityOp``. The error names the first offending module (path inside the
    chunk and class) and how many more there are. A chunk that passes is remembered (weakly,
    by identity) and not walked again.
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(
                f"check_tree_model takes a module or a list of model chunks, got an element of type "
                f"{type(chunk).__name__}"
            )
        if chunk in _PASSED:
            continue
        problems = _problems(chunk)
        if problems:
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            where = f"model chunk {index}" if len(chunks) > 1 else "the model"
            raise ValueError(
                f"tree micro-batches need a model built for tree training (tree attention and per-token "
                f"RoPE), but in {where} {problems[0]}{more}. To fix, {_HOW_TO_BUILD}."
            )
        _PASSED.add(chunk)

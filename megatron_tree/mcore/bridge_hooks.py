"""Hooks into mbridge's model building: every decoder block spec, and every model chunk, through a function.

Tree training is built on these two (:func:`megatron_tree.mcore.bridge.patch_bridge_for_tree_training`):
context managers, reverted on exit, nestable; entering one with a transform that is already active is
a no-op. They wrap mbridge 0.15.1's ``LLMBridge._get_transformer_layer_spec`` and ``Bridge.get_model``
(the swap points every registered LLM bridge inherits).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from megatron_tree.core.patching import AttrPatch, PatchScope

__all__ = ["layer_spec_hook", "model_hook"]


_SPEC_TRANSFORMS: list[Callable[[Any], Any]] = []
_MODEL_TRANSFORMS: list[Callable[[Any], Any]] = []


def _apply_transforms(transforms: list[Callable[[Any], Any]], value: Any, what: str) -> Any:
    for transform in tuple(transforms):
        result = transform(value)
        if result is None:
            raise TypeError(f"{transform!r} returned None for a {what}; return the (possibly modified) {what}")
        value = result
    return value


def _spec_hook_patch(cls: type) -> AttrPatch:
    original = vars(cls)["_get_transformer_layer_spec"]

    @functools.wraps(original)
    def _get_transformer_layer_spec(self, vp_stage=None):
        return _apply_transforms(_SPEC_TRANSFORMS, original(self, vp_stage), "layer spec")

    return AttrPatch(cls, "_get_transformer_layer_spec", _get_transformer_layer_spec, "layer_spec_hook")


def _spec_hook_patches() -> list[AttrPatch]:
    from mbridge.core.llm_bridge import LLMBridge

    from megatron_tree.mcore.bridges import BRIDGES

    # Our bridges build their own (hybrid) spec without calling LLMBridge's, so each is wrapped too.
    own = {next(c for c in cls.__mro__ if "_get_transformer_layer_spec" in vars(c)) for cls in BRIDGES.values()}
    return [_spec_hook_patch(cls) for cls in (LLMBridge, *sorted(own - {LLMBridge}, key=lambda c: c.__name__))]


def _model_hook_patches() -> list[AttrPatch]:
    from mbridge.core.bridge import Bridge

    original = Bridge.get_model

    @functools.wraps(original)
    def get_model(self, *args, **kwargs):
        return [_apply_transforms(_MODEL_TRANSFORMS, chunk, "model chunk") for chunk in original(self, *args, **kwargs)]

    return [AttrPatch(Bridge, "get_model", get_model, "model_hook")]


_SPEC_SCOPE = PatchScope(_spec_hook_patches)
_MODEL_SCOPE = PatchScope(_model_hook_patches)


@contextlib.contextmanager
def _transform_hook(
    transforms: list[Callable[[Any], Any]], scope: PatchScope, transform: Callable[[Any], Any], arg: str
) -> Iterator[None]:
    if not callable(transform):
        raise TypeError(f"{arg} must be callable, got {transform!r} ({type(transform).__name__})")
    if transform in transforms:
        yield
        return
    with scope.active():
        transforms.append(transform)
        try:
            yield
        finally:
            transforms.remove(transform)


def layer_spec_hook(spec_transform: Callable[[Any], Any]) -> contextlib.AbstractContextManager[None]:
    """Pass every decoder block spec an mbridge LLM bridge builds through ``spec_transform`` inside the block.

    Wraps ``LLMBridge._get_transformer_layer_spec`` (mbridge 0.15.1), which every registered
    LLM bridge inherits: Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, LLaMA, Mixtral, GLM4-MoE,
    MiMo, DeepSeek-V3 (GLM4-VL overrides it but calls it first), and the override of each of our
    bridges (:mod:`megatron_tree.mcore.bridges`: Qwen3-Next, Qwen3.5). What it returns -- and
    ``spec_transform`` receives and must return -- is megatron-core's
    ``TransformerBlockSubmodules`` (``layer_specs``: one ``ModuleSpec`` per layer of this
    pipeline stage / virtual stage, ``layer_norm``: the final norm class), built for the
    bridge's ``TransformerConfig`` by ``get_gpt_decoder_block_spec``.

    The spec is built lazily, inside ``bridge.get_model(...)``, once per model chunk:
    keep the block open across ``get_model``. Nested hooks apply outermost first;
    entering with a transform that is already active changes nothing.
    """
    return _transform_hook(_SPEC_TRANSFORMS, _SPEC_SCOPE, spec_transform, "spec_transform")


def model_hook(model_transform: Callable[[Any], Any]) -> contextlib.AbstractContextManager[None]:
    """Pass every model chunk ``bridge.get_model(...)`` returns through ``model_transform`` inside the block.

    Wraps ``Bridge.get_model`` (mbridge 0.15.1; no bridge overrides it). Each chunk (one
    per virtual pipeline stage; a ``GPTModel``, wrapped in ``Float16Module`` for bf16/fp16
    and in DDP for ``wrap_with_ddp=True``) is replaced by ``model_transform(chunk)``,
    after weights given as ``get_model(weight_path=...)`` are loaded. Nested hooks apply
    outermost first; entering with a transform that is already active changes nothing.
    """
    return _transform_hook(_MODEL_TRANSFORMS, _MODEL_SCOPE, model_transform, "model_transform")

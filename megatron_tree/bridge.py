"""Build tree-training models with mbridge: one context manager around the bridge calls.

::

    with patch_bridge_for_tree_training():
        bridge = AutoBridge.from_pretrained(hf_path)
        model = bridge.get_model(...)          # layer spec and RoPE are swapped in here
        bridge.load_weights(model, hf_path)
    # the model keeps tree attention and per-token RoPE; bridge.load/export/save_weights work any time.

:func:`build_tree_model` does those three calls with the ``TransformerConfig`` overrides a
tree-training run needs on this machine. Without mbridge, on plain megatron-core: build
``GPTModel(transformer_layer_spec=tree_layer_spec(spec), ...)`` and call
``enable_tree_rope(model)`` on what you built.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator

import torch

from megatron_tree.attention import get_tree_attention_backend
from megatron_tree.config_overrides import tree_training_overrides
from megatron_tree.layer_spec import tree_layer_spec
from megatron_tree.rope import enable_tree_rope

__all__ = ["build_tree_model", "patch_bridge_for_tree_training"]


@contextlib.contextmanager
def patch_bridge_for_tree_training(enable: bool = True, *, backend: str = "auto") -> Iterator[None]:
    """While open, mbridge builds tree-attention models; ``enable=False`` does nothing.

    Keep it open across ``AutoBridge.from_pretrained(path)`` *and* ``bridge.get_model(...)``
    (mbridge builds the layer spec lazily inside ``get_model``). Inside it:

    - the compatibility patches (:func:`megatron_tree.patches.apply_compat_patches`) are active;
    - every decoder block spec a bridge builds goes through :func:`tree_layer_spec`
      (``backend`` names the tree attention backend), which raises for layers it cannot
      convert (MLA, linear or sliding-window attention);
    - every model chunk ``get_model`` returns goes through :func:`enable_tree_rope`.

    Class-level changes are reverted on exit. The models built inside keep their tree
    attention and RoPE, and their bridges can load, export and save weights at any time
    after it (see :mod:`megatron_tree.patches.mbridge`); MoE runs without a block open.
    """
    if not enable:
        yield
        return
    get_tree_attention_backend(backend)
    from megatron_tree.patches import apply_compat_patches
    from megatron_tree.patches.mbridge import layer_spec_hook, model_hook

    spec_transform = functools.partial(tree_layer_spec, backend=backend)
    with apply_compat_patches(), layer_spec_hook(spec_transform), model_hook(enable_tree_rope):
        yield


def build_tree_model(
    hf_path: str | os.PathLike,
    *,
    tree: bool = True,
    backend: str = "auto",
    bf16: bool = False,
    recompute: str = "none",
    load_weights: bool = True,
    extra_args: dict[str, Any] | None = None,
    **get_model_kwargs: Any,
) -> tuple[Any, list[torch.nn.Module]]:
    """Build a megatron-core model from the HF checkpoint at ``hf_path`` with mbridge: ``(bridge, chunks)``.

    ``chunks`` is what ``bridge.get_model`` returns: one module per virtual pipeline stage of
    this rank. Call it after ``parallel_state.initialize_model_parallel`` (on CPU inside
    :func:`megatron_tree.testing.cpu_mode`).

    - ``tree=True``: tree attention (``backend``) and per-token RoPE, built under
      :func:`patch_bridge_for_tree_training`; ``tree=False``: the upstream causal model (the
      flat reference). The compatibility patches are active while building either way.
    - ``TransformerConfig`` overrides: :func:`~megatron_tree.config_overrides.tree_training_overrides`
      (MoE read from the checkpoint, ``recompute`` = "none" | "full" | "selective"), then
      ``extra_args`` (e.g. ``attention_dropout=0.0``).
    - ``bridge.get_model(bf16=bf16, fp16=False, **get_model_kwargs)`` (e.g. ``wrap_with_ddp``,
      ``ddp_config``), weights loaded from ``hf_path`` unless ``load_weights=False`` (then
      Megatron's random initialisation stays). With DDP wrapping, the config's
      ``finalize_model_grads_func`` is set to megatron-core's ``finalize_model_grads``, as
      Megatron's training loop does.
    """
    from megatron_tree.patches import apply_compat_patches

    path = os.fspath(hf_path)
    with apply_compat_patches(), patch_bridge_for_tree_training(enable=tree, backend=backend):
        from mbridge import AutoBridge

        bridge = AutoBridge.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
        moe = bridge.config.num_moe_experts is not None
        overrides = tree_training_overrides(
            moe=moe, recompute=recompute, wrap_with_ddp=get_model_kwargs.get("wrap_with_ddp", False)
        )
        bridge.set_extra_args(**{**overrides, **(extra_args or {})})
        chunks = bridge.get_model(bf16=bf16, fp16=False, **get_model_kwargs)
        if load_weights:
            bridge.load_weights(chunks, path)
    if get_model_kwargs.get("wrap_with_ddp", False):
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        get_model_config(chunks[0]).finalize_model_grads_func = finalize_model_grads
    return bridge, chunks

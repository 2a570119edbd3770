"""Build tree-training models with mbridge: one context manager around the bridge calls.

::

    with patch_bridge_for_tree_training():
        bridge = AutoBridge.from_pretrained(hf_path)
        model = bridge.get_model(...)          # layer spec and RoPE are swapped in here
        bridge.load_weights(model, hf_path)
    # the model keeps tree attention and per-token RoPE; nothing stays patched.

Without mbridge, on plain megatron-core: build ``GPTModel(transformer_layer_spec=
tree_layer_spec(spec), ...)`` and call ``enable_tree_rope(model)`` on what you built.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

from megatron_tree.attention import get_tree_attention_backend
from megatron_tree.layer_spec import tree_layer_spec
from megatron_tree.rope import enable_tree_rope

__all__ = ["patch_bridge_for_tree_training"]


@contextlib.contextmanager
def patch_bridge_for_tree_training(enable: bool = True, *, backend: str = "auto") -> Iterator[None]:
    """While open, mbridge builds tree-attention models; ``enable=False`` does nothing.

    Keep it open across ``AutoBridge.from_pretrained(path)`` *and* ``bridge.get_model(...)``
    (mbridge builds the layer spec lazily inside ``get_model``). Inside it:

    - the compatibility patches (:func:`patches.apply_compat_patches`) are active;
    - every decoder block spec a bridge builds goes through :func:`tree_layer_spec`
      (``backend`` names the tree attention backend), which raises for layers it cannot
      convert (MLA, linear or sliding-window attention);
    - every model chunk ``get_model`` returns goes through :func:`enable_tree_rope`.

    Everything is reverted on exit; the models built inside keep their tree attention and RoPE.
    """
    if not enable:
        yield
        return
    get_tree_attention_backend(backend)
    from patches import apply_compat_patches
    from patches.mbridge import layer_spec_hook, model_hook

    spec_transform = functools.partial(tree_layer_spec, backend=backend)
    with apply_compat_patches(), layer_spec_hook(spec_transform), model_hook(enable_tree_rope):
        yield

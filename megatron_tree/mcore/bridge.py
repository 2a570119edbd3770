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
``convert_to_tree_model(model)`` on what you built.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any, Iterator

import torch

from megatron_tree.attention import get_tree_attention_backend
from megatron_tree.core.platform import have_transformer_engine
from megatron_tree.mcore.config_overrides import tree_training_overrides
from megatron_tree.mcore.grouped_gemm import use_cutlass_grouped_gemm
from megatron_tree.mcore.layer_spec import tree_layer_spec
from megatron_tree.mcore.rope import convert_to_tree_model

__all__ = ["build_flat_model", "build_model", "build_tree_model", "patch_bridge_for_tree_training"]


@contextlib.contextmanager
def patch_bridge_for_tree_training(enable: bool = True, *, backend: str = "auto") -> Iterator[None]:
    """While open, mbridge builds tree-attention models; ``enable=False`` does nothing.

    Keep it open across ``AutoBridge.from_pretrained(path)`` *and* ``bridge.get_model(...)``
    (mbridge builds the layer spec lazily inside ``get_model``). Inside it:

    - the compatibility patches (:func:`megatron_tree.compat.apply_compat_patches`) are active, and our
      bridges of the families mbridge lacks (Qwen3-Next, Qwen3.5: :mod:`megatron_tree.mcore.bridges`) registered;
    - every decoder block spec a bridge builds goes through :func:`tree_layer_spec`
      (``backend`` names the tree attention backend; Gated DeltaNet layers become
      :class:`~megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet`), which raises for layers it cannot
      convert (other linear-attention or state-space mixers);
    - every model chunk ``get_model`` returns goes through :func:`~megatron_tree.mcore.rope.convert_to_tree_model`.

    Class-level changes are reverted on exit. The models built inside keep their tree
    attention and RoPE, and their bridges can load, export and save weights at any time
    after it (see :mod:`megatron_tree.compat.mbridge`); MoE runs without a block open.
    """
    if not enable:
        yield
        return
    get_tree_attention_backend(backend)
    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.mcore.bridge_hooks import layer_spec_hook, model_hook
    from megatron_tree.mcore.bridges import register_bridges

    register_bridges()

    spec_transform = functools.partial(tree_layer_spec, backend=backend)
    with apply_compat_patches(), layer_spec_hook(spec_transform), model_hook(convert_to_tree_model):
        yield


def _check_upstream_context_parallel() -> None:
    """Refuse an upstream model under context parallel without Transformer Engine: megatron-core's
    own attention has no context parallel (it would assert deep inside the model build)."""
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    if cp > 1 and not have_transformer_engine():
        raise ValueError(
            f"the upstream model (tree=False) cannot run under context parallel size {cp} without Transformer "
            f"Engine: megatron-core's own attention has no context parallel. Build the tree model (tree=True; for a "
            f"flat baseline pack with share_prefixes=False) or use context_parallel_size=1"
        )


def build_tree_model(
    hf_path: str | os.PathLike,
    *,
    tree: bool = True,
    backend: str = "auto",
    bf16: bool = False,
    recompute: str = "none",
    load_weights: bool = True,
    value_head: bool = False,
    extra_args: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    **get_model_kwargs: Any,
) -> tuple[Any, list[torch.nn.Module]]:
    """Build a megatron-core model from the HF checkpoint at ``hf_path`` with mbridge: ``(bridge, chunks)``.

    ``chunks`` is what ``bridge.get_model`` returns: one module per virtual pipeline stage of
    this rank. Call it after ``parallel_state.initialize_model_parallel`` (on CPU inside
    :func:`megatron_tree.runtime.cpu.cpu_mode`).

    - Tree attention (``backend``) and per-token RoPE, built under :func:`patch_bridge_for_tree_training`
      (``tree=False``, deprecated: the upstream model, :func:`build_flat_model`). The compatibility
      patches are active while building.
    - ``TransformerConfig`` overrides: :func:`~megatron_tree.mcore.config_overrides.tree_training_overrides`
      (MoE read from the checkpoint, ``recompute`` = "none" | "full" | "selective"), then
      ``extra_args`` (e.g. ``attention_dropout=0.0``).
    - ``bridge.get_model(bf16=bf16, fp16=False, **get_model_kwargs)`` (e.g. ``wrap_with_ddp``,
      ``ddp_config``), weights loaded from ``hf_path`` unless ``load_weights=False`` (then
      Megatron's random initialisation stays). With DDP wrapping, the config's
      ``finalize_model_grads_func`` is set to megatron-core's ``finalize_model_grads``, as
      Megatron's training loop does.
    - ``value_head=True``: a critic or reward model (``head="values"`` / ``"scores"``): the output
      layer is mbridge's value head (``make_value_model``, weight ``[1, hidden]``, output
      ``[1, T, 1]``, the same on every rank). Its weight is ``lm_head.weight`` of a checkpoint
      that holds a ``[1, hidden]`` one (``bridge.save_weights`` of a value model writes it);
      from a language-model checkpoint it is drawn from N(0, ``init_method_std``²) with a fixed
      seed, so every tensor- and data-parallel rank starts from the same head. The checkpoint
      must have untied embeddings (see the ``ValueError``).
    - ``trust_remote_code=True``: read a config that ships its own code (``auto_map``, e.g. MiMo's
      ``configuration_mimo.py``), as ``transformers.AutoConfig`` does with it; only the config is read that way.
    """
    if not tree:
        warnings.warn("build_tree_model(tree=False) is now build_flat_model(...) (the upstream model, no tree)",
                      DeprecationWarning, stacklevel=2)
    return _build(hf_path, tree, backend, bf16, recompute, load_weights, value_head, extra_args, trust_remote_code,
                  get_model_kwargs)


def build_flat_model(
    hf_path: str | os.PathLike,
    *,
    bf16: bool = False,
    recompute: str = "none",
    load_weights: bool = True,
    value_head: bool = False,
    extra_args: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    **get_model_kwargs: Any,
) -> tuple[Any, list[torch.nn.Module]]:
    """The upstream model of the HF checkpoint at ``hf_path``, built as :func:`build_tree_model` builds a tree
    model (same keywords, ``TransformerConfig`` overrides and weights) but with megatron-core's own attention
    and RoPE: the flat baseline (:func:`~megatron_tree.mcore.schedule.flat_forward_backward` with Transformer
    Engine). Returns ``(bridge, chunks)``."""
    if "backend" in get_model_kwargs:
        raise TypeError("build_flat_model builds megatron-core's own attention: backend= is build_tree_model's")
    return _build(hf_path, False, "auto", bf16, recompute, load_weights, value_head, extra_args, trust_remote_code,
                  get_model_kwargs)


def build_model(hf_path: str | os.PathLike, *, tree: bool, backend: str = "auto", **kwargs: Any):
    """:func:`build_tree_model` (``tree=True``, with ``backend``) or :func:`build_flat_model` (``tree=False``),
    for code that builds either (the launcher's ``--no-tree-training``, benchmarks)."""
    return build_tree_model(hf_path, backend=backend, **kwargs) if tree else build_flat_model(hf_path, **kwargs)


def _build(hf_path, tree, backend, bf16, recompute, load_weights, value_head, extra_args, trust_remote_code,
           get_model_kwargs):
    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.mcore.bridges import register_bridges

    register_bridges()
    path = os.path.expanduser(os.fspath(hf_path))
    if (os.path.isabs(path) or path.startswith(".")) and not os.path.isdir(path):
        raise FileNotFoundError(
            f"no Hugging Face checkpoint directory at {path!r} (a local path that does not exist); pass the directory "
            f"holding config.json (and the weights), or a Hub repo id"
        )
    if not tree:
        _check_upstream_context_parallel()
    with apply_compat_patches(), patch_bridge_for_tree_training(enable=tree, backend=backend):
        from mbridge import AutoBridge

        bridge = AutoBridge.from_pretrained(path, trust_remote_code=trust_remote_code,
                                            dtype=torch.bfloat16 if bf16 else torch.float32)
        if value_head:
            get_model_kwargs["post_model_creation_callbacks"] = _value_head_callbacks(bridge, path, get_model_kwargs)
        moe = bridge.config.num_moe_experts is not None
        if moe and have_transformer_engine():
            use_cutlass_grouped_gemm(bf16=bf16)  # the experts' GEMMs in one kernel on Hopper
        overrides = tree_training_overrides(
            moe=moe, recompute=recompute, wrap_with_ddp=get_model_kwargs.get("wrap_with_ddp", False)
        )
        if tree and getattr(bridge.config, "multi_latent_attention", False):
            overrides["apply_rope_fusion"] = False  # MLA's fused RoPE reads cos / sin by packed index
        bridge.set_extra_args(**{**overrides, **(extra_args or {})})
        if tree and getattr(bridge.config, "mtp_num_layers", None):
            raise ValueError(
                f"{path} has {bridge.config.mtp_num_layers} multi-token prediction layer(s) "
                f"(num_nextn_predict_layers); tree training cannot run them (MTP predicts the token one slot "
                f"later, which is not the next token at a branch point). Build without them: "
                f"extra_args={{'mtp_num_layers': None}} (the checkpoint's MTP weights are then not loaded; the "
                f"launcher: --skip-mtp-layers)"
            )
        chunks = bridge.get_model(bf16=bf16, fp16=False, **get_model_kwargs)
        if value_head:
            _init_value_head(chunks, bridge.config.init_method_std)
        if load_weights:
            bridge.load_weights(chunks, path)
    if get_model_kwargs.get("wrap_with_ddp", False):
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        get_model_config(chunks[0]).finalize_model_grads_func = finalize_model_grads
    return bridge, chunks


def _value_head_callbacks(bridge: Any, path: str, get_model_kwargs: dict[str, Any]) -> list:
    """``post_model_creation_callbacks`` with mbridge's ``make_value_model`` added; refuses tied embeddings."""
    from mbridge.utils.post_creation_callbacks import make_value_model

    if getattr(bridge.hf_config, "tie_word_embeddings", False):
        raise ValueError(
            f"value_head=True needs untied embeddings, but {path} has tie_word_embeddings=True: mbridge 0.15.1 "
            f"then maps the value head onto model.embed_tokens.weight and cannot load it (and under pipeline "
            f"parallel megatron-core would sum the value head's gradient with the embedding's). Save an untied "
            f"copy first: AutoModelForCausalLM.from_pretrained(path) with config.tie_word_embeddings=False and "
            f"lm_head.weight = embed_tokens.weight cloned, then save_pretrained"
        )
    return [*get_model_kwargs.get("post_model_creation_callbacks", []), make_value_model]


def _init_value_head(chunks: list[torch.nn.Module], std: float, seed: int = 0) -> None:
    """Draw every value head weight ``[1, hidden]`` from N(0, std²) with a fixed-seed generator: the
    same on every rank (mbridge's head is a plain ``torch.nn.Linear``, initialised from each rank's own
    RNG state, so tensor-parallel replicas would differ)."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name.endswith("output_layer.weight") and param.shape[0] == 1:
                gen = torch.Generator().manual_seed(seed)
                with torch.no_grad():
                    param.copy_(torch.randn(param.shape, generator=gen).mul_(std).to(param))

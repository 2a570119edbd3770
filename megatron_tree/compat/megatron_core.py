"""Fixes of megatron-core problems (``megatron.core``), one function per problem.

Each function returns the :class:`~megatron_tree.core.patching.AttrPatch` list its problem needs in
this process (empty when the installed version does not have the problem); nothing is applied
here. Entry point: :func:`megatron_tree.compat.apply_compat_patches` (the lasting fixes).
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_tree.core.patching import AttrPatch


def moe_te_general_gemm() -> list[AttrPatch]:
    """Define ``moe_utils.te_general_gemm = None`` when Transformer Engine is absent.

    Needed by megatron-core 0.16.x without Transformer Engine: ``moe/moe_utils.py`` imports
    ``te_general_gemm`` only inside its ``try: import transformer_engine`` block but the
    router GEMM (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None``
    unconditionally, so every MoE forward raises ``NameError``. ``None`` selects the
    plain-PyTorch path that is already there. No-op where the name is defined.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return []
    return [
        AttrPatch(moe_utils, "te_general_gemm", None, "megatron-core without TE: router GEMM NameError")
    ]


def torch_optimizers_without_cuda() -> list[AttrPatch]:
    """``megatron.core.optimizer`` on torch's AdamW / SGD in a process without CUDA.

    Needed by megatron-core (0.16 - 0.19 at least) where Transformer Engine or Apex is installed but no GPU
    is usable (a CPU run on a GPU host: ``CUDA_VISIBLE_DEVICES=""``): the module
    binds ``Adam`` / ``SGD`` at import to TE's (or Apex's) fused optimizers whenever they import, which run
    CUDA kernels only. The patch sets what megatron-core sets when neither is installed
    (``USING_PYTORCH_OPTIMIZER = True``, torch's classes). No-op with CUDA or where it already is so.
    """
    import torch
    from megatron.core import optimizer

    if torch.cuda.is_available() or getattr(optimizer, "USING_PYTORCH_OPTIMIZER", True):
        return []
    from megatron.core.optimizer import distrib_optimizer

    why = "no CUDA: torch optimizers, not TE's / Apex's fused ones"
    return [
        AttrPatch(optimizer, "USING_PYTORCH_OPTIMIZER", True, why),
        AttrPatch(optimizer, "Adam", torch.optim.AdamW, why),
        AttrPatch(optimizer, "SGD", torch.optim.SGD, why),
        # the distributed optimizer's state (de)serialisation follows the optimizer it wraps: torch's
        *(AttrPatch(distrib_optimizer, name, value, why)
          for name, value in (("HAVE_APEX_OR_TE", False), ("USING_TE_OPTIMIZER", False),
                              ("USING_APEX_OPTIMIZER", False)) if hasattr(distrib_optimizer, name)),
    ]


def local_attention_mla_channels() -> list[AttrPatch]:
    """Let megatron-core's local ``DotProductAttention`` be multi-latent attention's core attention.

    Needed by megatron-core 0.16.x (local, non-TE spec): ``MLASelfAttention`` builds its core attention with
    ``k_channels`` (q / k head dim) and ``v_channels`` (value head dim), which only Transformer Engine's
    attention accepts, so an MLA model (DeepSeek-V3) on the local spec raises ``TypeError`` at build; and the
    local attention reshapes its output to ``kv_channels`` per head, wrong whenever the value head dim differs.
    Wraps ``DotProductAttention.__init__`` to take both keywords and size the output ``[sq, b, np * v_channels]``
    (all other shapes come from the tensors; MLA passes its own ``softmax_scale``). No-op where the class
    already takes ``v_channels``. Only building needs it: modules built inside the block keep their sizes.
    """
    import functools
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.__init__
    if "v_channels" in inspect.signature(original).parameters:
        return []

    @functools.wraps(original)
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return [AttrPatch(DotProductAttention, "__init__", __init__, "local attention refuses MLA's k/v_channels")]


def mla_without_transformer_engine() -> list[AttrPatch]:
    """Let ``MLASelfAttention`` build where Transformer Engine is not installed.

    Needed by megatron-core 0.16.x without TE: ``megatron.core.extensions.transformer_engine`` then stands TE in
    with a ``MagicMock``, so ``multi_latent_attention`` imports TE's classes as mock objects and sets
    ``HAVE_TE = True``; its ``__init__`` runs ``isinstance(self.linear_proj, TELinear)`` and every MLA model
    (DeepSeek-V3) raises ``TypeError: isinstance() arg 2 must be a type``. Sets ``HAVE_TE = False`` there (what
    the module means when TE is absent) while models are built. No-op where ``TELinear`` is a real class.
    """
    from megatron.core.transformer import multi_latent_attention

    if isinstance(multi_latent_attention.TELinear, type) or not multi_latent_attention.HAVE_TE:
        return []
    return [AttrPatch(multi_latent_attention, "HAVE_TE", False, "TE absent: megatron-core's MLA imports mocks")]


def _torch_distributed_optimizers(optimizer) -> list:
    """The ``DistributedOptimizer`` s in ``optimizer`` (chained or not) that wrap a torch optimizer (no Apex /
    Transformer Engine: megatron-core keeps Adam's ``step`` per parameter then); empty elsewhere."""
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return []
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(o, distrib_optimizer.DistributedOptimizer)]


def distributed_optimizer_state_for_load(optimizer) -> None:
    """Give a distributed optimizer that has taken no step yet its torch Adam state (zero moments, ``step`` 0), so
    that its loading state dict can be built.

    Needed by megatron-core 0.16 - 0.20 without Apex / Transformer Engine: ``DistributedOptimizer.state_dict()``
    (which ``sharded_state_dict(is_loading=True)`` calls) asserts one ``step`` over the wrapped torch optimizer's
    per-parameter states, of which a fresh optimizer (a resumed run) has none. Call before building the state dict
    to load; the checkpoint's values replace these. No-op elsewhere, and on an optimizer that has state.
    """
    import torch

    for opt in _torch_distributed_optimizers(optimizer):
        inner = opt.optimizer
        if len(inner.state) or opt.init_state_fn is None:
            continue
        opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))


def distributed_optimizer_restore_steps(optimizer) -> None:
    """Give each parameter's torch Adam state its own ``step`` tensor, of the value the checkpoint saved, after a
    distributed optimizer's ``load_state_dict``.

    Needed by megatron-core 0.16 - 0.20 without Apex / Transformer Engine: ``DistributedOptimizer.load_state_dict``
    puts one ``step`` tensor into every parameter's state (torch's Adam increments each parameter's step in place,
    so a shared one would advance once per parameter per update), then its ``dp_reshardable`` parameter-state load
    copies the not-saved per-parameter ``step`` of the state it loaded into (0 on a fresh optimizer) over it. The
    saved step survives in each param group's ``step`` (megatron-core writes it there for torch optimizers).
    No-op elsewhere.
    """
    import torch

    for opt in _torch_distributed_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                if "step" in inner.state.get(param, {}):
                    inner.state[param]["step"] = torch.tensor(float(group["step"]))


def mla_query_without_low_rank() -> list[AttrPatch]:
    """Build multi-latent attention without a low-rank query (``q_lora_rank=None``) as megatron-core <= 0.18 did.

    Needed by megatron-core 0.19: ``MLASelfAttention._resolve_qk_norm_config`` (``mla_qk_norm_config``), with
    ``qk_layernorm=True`` (mbridge's DeepSeek bridges always set it, for the latent KV norm) and no ``q_lora_rank``
    (DeepSeek-V2-Lite's plain ``q_proj``), (a) refuses the local spec's ``q_layernorm`` ("ValueError:
    `q_layernorm=...WrappedTorchNorm` is non-trivial, but `q_lora_rank is None`"), and (b) swaps the spec's
    ``linear_q_proj`` for a fused norm+linear, a query norm with a weight that the Hugging Face model does not
    have (NVIDIA-NeMo/Megatron-Bridge#5261). Resolves with ``q_layernorm=IdentityOp`` (nothing for a norm to act
    on without a low-rank query) and keeps the spec's ``linear_q_proj``: the model megatron-core 0.16 builds.
    No-op where the resolver does not exist; the resolver is untouched when ``q_lora_rank`` is set. Only
    building needs it.
    """
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    original = vars(MLASelfAttention).get("_resolve_qk_norm_config")
    if original is None:
        return []

    @functools.wraps(original)
    def _resolve_qk_norm_config(self, submodules):
        if self.config.q_lora_rank is not None:
            return original(self, submodules)
        from megatron.core.transformer.identity_op import IdentityOp

        resolved = dict(original(self, dataclasses.replace(submodules, q_layernorm=IdentityOp)))
        if submodules.linear_q_proj is not None:
            resolved["linear_q_proj"] = submodules.linear_q_proj
        return resolved

    return [AttrPatch(MLASelfAttention, "_resolve_qk_norm_config", _resolve_qk_norm_config,
                      "megatron-core 0.19: MLA without q_lora_rank gets a query norm HF does not have")]


def forget_checkpoint_writer_queue() -> None:
    """Drop megatron-core's cached queue of its checkpoint writers, whose spawn ``Manager`` process was stopped.

    megatron-core (0.16 - 0.19 at least) starts a ``multiprocessing`` Manager at the first distributed
    checkpoint save and keeps its queue in ``filesystem_async._results_queue`` for the process's life;
    the Manager outlives the run (and, after a SIGKILL or SIGTERM, the trainer). The launcher stops it
    when a run ends; the next save in the same process (runs one after another, tests) then needs a
    new queue, so the cached one is forgotten. No-op where the module or the cache is absent.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", None) is not None:
        filesystem_async._results_queue = None


def compat_patches() -> list[AttrPatch]:
    """The revertible megatron-core fixes this process needs (applied by :func:`megatron_tree.compat.apply_compat_patches`)."""
    return (torch_optimizers_without_cuda() + local_attention_mla_channels() + mla_without_transformer_engine()
            + mla_query_without_low_rank())


def lasting_fixes() -> list[AttrPatch]:
    """Fixes of upstream bugs (a missing name) that this process needs and models rely on for
    their whole life: :func:`megatron_tree.compat.apply_compat_patches` applies them once and
    never reverts them."""
    return moe_te_general_gemm()

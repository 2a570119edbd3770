"""Fixes of mbridge problems, one function per problem (mbridge 0.15.1).

Compatibility pieces (each returns the :class:`~megatron_tree.core.patching.AttrPatch` list its problem
needs in this process, empty when the installed versions do not have it; applied by
:func:`megatron_tree.compat.apply_compat_patches`):

- :func:`model_type_encoder_and_decoder` -- megatron-core releases whose ModelType lacks ``encoder_and_decoder``.
- :func:`hf_rope_theta` -- transformers >= 5 moved ``rope_theta`` into ``rope_parameters``.
- :func:`local_layer_spec` -- no Transformer Engine: build megatron-core's local spec.
- :func:`local_spec_weight_names` -- map the local spec's parameter names to HF names.
- :func:`qwen_moe_norm_topk_prob` -- follow the HF config's ``norm_topk_prob`` in the router.
- :func:`qwen2_moe_shared_expert_gate` -- build Qwen2-MoE's sigmoid shared-expert gate.
- :func:`mixtral_router_renormalise` -- Mixtral's router renormalises the top-k probabilities.
- :func:`glm4_moe_router_and_shared_experts` -- GLM-4.5's expert groups and shared-expert size.
- :func:`deepseek_v3_config` -- DeepSeek-V3's MLA config: a renamed YaRN field, transformers-5 RoPE, expert groups.
- :func:`deepseek_v3_fp32_weights` -- DeepSeek-V3 checkpoints load in fp32 too.
- :func:`tied_embedding_mapping_per_bridge` -- a tied-embedding bridge must not rename ``output_layer`` for all others.
- :func:`hf_sliding_window` -- pass the HF config's sliding window (and which layers have it) to megatron-core.

The class-level swaps last only while the block is open. What a bridge built inside it needs
later is stored on that bridge and stays for its whole life: the local-spec weight-name
mapping (bound on the instance by ``get_model``), a Qwen-MoE or Mixtral bridge's ``_build_config``, a
Qwen2-MoE bridge's ``_build_base_config``, and the ``rope_theta`` written onto its HF config.

The hooks tree training builds on (a spec and a model transform) are feature code:
:mod:`megatron_tree.mcore.bridge_hooks`. Checked against mbridge 0.15.1.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from typing import Any, Callable

import torch

from megatron_tree.core.patching import AttrPatch
from megatron_tree.core.platform import have_transformer_engine

# --------------------------------------------------------------------------- compat pieces

_REMOVED_MODEL_TYPE = object()


def model_type_encoder_and_decoder() -> list[AttrPatch]:
    """Give ``mbridge.core.util`` a ``ModelType`` that still has ``encoder_and_decoder``.

    Needed by mbridge 0.15.1 with megatron-core releases whose ``ModelType`` (the one in
    ``megatron.core.transformer.enums`` that mbridge imports) has no ``encoder_and_decoder``
    at all: ``mbridge.core.util.get_model`` compares against it and raises
    ``AttributeError`` on every ``bridge.get_model``. (megatron-core 0.16.1 keeps it as a
    deprecated class property, so the comparison is merely False there and this is a no-op.) The replacement namespace
    holds the real members plus a sentinel for the removed one that equals no model type,
    so mbridge's encoder-decoder branches are never taken. megatron-core's enum itself is
    left untouched. No-op where the member exists.
    """
    from mbridge.core import util

    if hasattr(util.ModelType, "encoder_and_decoder"):
        return []
    members = {member.name: member for member in util.ModelType}
    legacy = types.SimpleNamespace(**members, encoder_and_decoder=_REMOVED_MODEL_TYPE)
    return [AttrPatch(util, "ModelType", legacy, "megatron-core without ModelType.encoder_and_decoder")]


_READS_ROPE_SCALING = {"deepseek_v3"}  # bridges whose RoPE scaling a compat piece reads (deepseek_v3_config)


def _expose_rope_theta(hf_config: Any) -> None:
    """Set ``hf_config.rope_theta`` (and ``partial_rotary_factor``, where ``rope_parameters`` holds one) from
    ``hf_config.rope_parameters`` (transformers >= 5) if they are missing."""
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict):
        return
    if not hasattr(hf_config, "partial_rotary_factor") and "partial_rotary_factor" in params:
        hf_config.partial_rotary_factor = params["partial_rotary_factor"]  # GLM-4.5: RoPE on half of each head
    if hasattr(hf_config, "rope_theta") or "rope_theta" not in params:
        return
    rope_type = params.get("rope_type", "default")
    if rope_type != "default" and getattr(hf_config, "model_type", None) not in _READS_ROPE_SCALING:
        raise ValueError(
            f"{type(hf_config).__name__}.rope_parameters has rope_type={rope_type!r}; mbridge 0.15.1 reads only "
            f"rope_theta under transformers>=5 and would silently drop the scaling. Use a checkpoint with "
            f"rope_type='default' or a transformers<5 / newer mbridge release."
        )
    hf_config.rope_theta = params["rope_theta"]


def hf_rope_theta() -> list[AttrPatch]:
    """Make ``hf_config.rope_theta`` exist again before a bridge is built (transformers >= 5).

    Needed by mbridge 0.15.1 with transformers >= 5, where config classes keep RoPE
    settings only in ``config.rope_parameters`` (``{"rope_type", "rope_theta", ...}``) and
    ``config.rope_theta`` raises ``AttributeError``; mbridge reads ``hf_config.rope_theta``
    (``LLMBridge._get_gptmodel_args``, ``LLaMABridge``), and GLM-4.5's bridge
    ``hf_config.partial_rotary_factor``. Wraps ``Bridge.__init__`` to copy ``rope_parameters["rope_theta"]``
    (and ``"partial_rotary_factor"``) onto the config (and its ``text_config``, if any).
    Non-default ``rope_type`` raises ``ValueError`` because mbridge would ignore it (except for DeepSeek-V3,
    whose scaling :func:`deepseek_v3_config` reads).
    No-op when the config class still has ``rope_theta``.
    """
    import transformers
    from mbridge.core.bridge import Bridge

    if int(transformers.__version__.split(".")[0]) < 5:
        return []
    original = Bridge.__init__

    @functools.wraps(original)
    def __init__(self, hf_config, *args, **kwargs):
        _expose_rope_theta(hf_config)
        text_config = getattr(hf_config, "text_config", None)
        if text_config is not None:
            _expose_rope_theta(text_config)
        original(self, hf_config, *args, **kwargs)

    return [AttrPatch(Bridge, "__init__", __init__, "transformers>=5 moved rope_theta into rope_parameters")]


def local_layer_spec() -> list[AttrPatch]:
    """Build megatron-core's local (non-TE) GPT layer spec when Transformer Engine is unavailable.

    Needed by mbridge 0.15.1 (all megatron-core versions) without Transformer Engine:
    ``LLMBridge._get_transformer_layer_spec`` always calls
    ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``, which fails
    without TE. The replacement forces ``use_transformer_engine=False`` and passes the
    config's ``normalization`` (so RMSNorm uses torch's RMSNorm even when Apex is
    installed). No-op when megatron-core imported TE.
    """
    from mbridge.core import llm_bridge

    if have_transformer_engine():
        return []
    original = llm_bridge.get_gpt_decoder_block_spec

    @functools.wraps(original)
    def get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization=None, *args, **kwargs):
        return original(config, False, normalization or config.normalization, *args, **kwargs)

    return [
        AttrPatch(
            llm_bridge, "get_gpt_decoder_block_spec", get_gpt_decoder_block_spec, "no Transformer Engine: local spec"
        )
    ]


_MLA_LOCAL_NORM = re.compile(r"\.self_attention\.(q_layernorm|kv_layernorm)\.weight$")
_MLA_NORM_TO_UP_PROJ = {"q_layernorm": "linear_q_up_proj", "kv_layernorm": "linear_kv_up_proj"}
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _local_name_to_te_name(bridge: Any, name: str, consider_ep: bool) -> str:
    """The TE-spec name mbridge's tables know for local-spec parameter ``name`` (unchanged if none).

    ``…input_layernorm.weight`` -> ``…self_attention.linear_qkv.layer_norm_weight``;
    unless the bridge maps ``input_layernorm`` itself (MLA bridges);
    ``…pre_mlp_layernorm.weight`` -> ``…mlp.linear_fc1.layer_norm_weight`` unless the bridge
    maps ``pre_mlp_layernorm`` itself (MoE bridges); MLA's ``…self_attention.q_layernorm.weight`` /
    ``kv_layernorm`` -> ``…self_attention.linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj``
    (TE fuses them into the up projections) unless the bridge maps them (Qwen3's q/k norms); ``…mlp.experts.local_experts.I.linear_fcK.weight``
    -> ``…mlp.experts.linear_fcK.weight{G}`` with the global expert id
    ``G = I + num_experts / ep_size * ep_rank`` when ``consider_ep`` (else ``G = I``, as
    mbridge's export expects before it gathers over expert parallel).
    """
    if name.endswith(".input_layernorm.weight"):
        if "input_layernorm.weight" in getattr(bridge, "_ATTENTION_MAPPING", {}):  # MLA bridges map it themselves
            return name
        return name[: -len("input_layernorm.weight")] + "self_attention.linear_qkv.layer_norm_weight"
    mla_norm = _MLA_LOCAL_NORM.search(name)
    if mla_norm is not None and not any(mla_norm.group(0)[1:] in key for key in getattr(bridge, "_ATTENTION_MAPPING", {})):
        return f"{name[: mla_norm.start()]}.self_attention.{_MLA_NORM_TO_UP_PROJ[mla_norm.group(1)]}.layer_norm_weight"
    if name.endswith(".pre_mlp_layernorm.weight"):
        if any("pre_mlp_layernorm" in key for key in bridge._MLP_MAPPING):
            return name
        return name[: -len("pre_mlp_layernorm.weight")] + "mlp.linear_fc1.layer_norm_weight"
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        return name
    expert = int(match.group(1))
    if consider_ep and bridge.mpu.ep_size > 1:
        expert += bridge.config.num_moe_experts // bridge.mpu.ep_size * bridge.mpu.ep_rank
    return f"{name[: match.start()]}.mlp.experts.{match.group(2)}.weight{expert}"


def _bind_local_spec_weight_names(bridge: Any) -> None:
    """Give ``bridge`` (the instance, for its whole life) a ``_weight_name_mapping_mcore_local_to_global``
    whose "global" names are TE-spec names (:func:`_local_name_to_te_name`); no-op if it has one."""
    if "_weight_name_mapping_mcore_local_to_global" in vars(bridge):
        return
    original = type(bridge)._weight_name_mapping_mcore_local_to_global

    @functools.wraps(original)
    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep=True):
        mapping = original(self, model, consider_ep=consider_ep)
        return {local: _local_name_to_te_name(self, name, consider_ep) for local, name in mapping.items()}

    bridge._weight_name_mapping_mcore_local_to_global = types.MethodType(
        _weight_name_mapping_mcore_local_to_global, bridge
    )


def local_spec_weight_names() -> list[AttrPatch]:
    """Map local-spec parameter names onto the names mbridge's weight tables know, for the bridge's whole life.

    Needed by mbridge 0.15.1 whenever the local (non-TE) spec is used (see
    :func:`local_layer_spec`): its tables only know TE-spec names, so
    ``bridge.load_weights`` / ``export_weights`` / ``save_weights`` raise ``NotImplementedError`` on
    ``input_layernorm``, ``pre_mlp_layernorm`` (dense models) and
    ``mlp.experts.local_experts.I.linear_fc{1,2}`` (MoE ``SequentialMLP``). Wraps
    ``Bridge.get_model`` inside the block: a bridge that builds a model there gets, on the
    instance and never reverted, a ``_weight_name_mapping_mcore_local_to_global`` whose
    "global" names are TE-spec names (:func:`_local_name_to_te_name`), so its weights load,
    export and save at any time after the block. Expert ids become global under expert
    parallel, as mbridge does for TE's grouped experts. Local experts are loaded through
    the tensor-parallel path (fine at expert-tensor-parallel size = TP size, the megatron
    default). The ``Bridge`` class is left as it was. No-op when megatron-core imported TE.
    """
    from mbridge.core.bridge import Bridge

    if have_transformer_engine():
        return []
    original = Bridge.get_model

    @functools.wraps(original)
    def get_model(self, *args, **kwargs):
        _bind_local_spec_weight_names(self)
        return original(self, *args, **kwargs)

    return [AttrPatch(Bridge, "get_model", get_model, "no Transformer Engine: local-spec weight names")]


def _method_fix(cls: type, name: str, fix: Callable[..., Any], why: str) -> AttrPatch:
    """An :class:`AttrPatch` replacing the method ``cls.name`` by ``fix(self, original, *args, **kwargs)``
    (``original``: ``cls``'s own ``name``, else the inherited one). A bridge that calls it inside the compat
    block keeps, as its own attribute, its class's resolution of ``name`` with the fix in place at ``cls``, so the
    fix holds for the bridge's life (mbridge rebuilds its config later, e.g. in ``set_extra_args``) and a subclass's
    override that calls ``super()`` (our bridges of multimodal checkpoints) stays in the chain."""
    original = vars(cls)[name] if name in vars(cls) else getattr(cls, name)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if name not in vars(self):
            setattr(self, name, types.MethodType(replay, self))
        return fix(self, original, *args, **kwargs)

    def replay(self, *args, **kwargs):
        own = vars(cls).get(name)
        setattr(cls, name, method)
        try:
            return getattr(type(self), name)(self, *args, **kwargs)
        finally:
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)

    return AttrPatch(cls, name, method, why)


def qwen_moe_norm_topk_prob() -> list[AttrPatch]:
    """Make the Qwen2-MoE / Qwen3-MoE router normalise the top-k probabilities iff ``hf_config.norm_topk_prob``.

    Needed by mbridge 0.15.1 (all versions of the other libraries): ``Qwen3MoEBridge``
    hard-codes ``moe_router_pre_softmax=False`` (softmax over the top-k logits = normalised
    top-k probabilities) and ``Qwen2MoEBridge`` hard-codes ``True`` (softmax over all
    experts, top-k taken unnormalised), ignoring the checkpoint's ``norm_topk_prob``; a
    Qwen3-MoE checkpoint with ``norm_topk_prob=False`` then gives logits off by ~0.3 on a
    tiny model. Wraps both bridges' ``_build_config`` to set
    ``moe_router_pre_softmax = not norm_topk_prob`` unless the caller set it through
    ``bridge.set_extra_args``. A bridge built inside the block keeps the wrapped
    ``_build_config`` on the instance, so a later ``set_extra_args`` keeps the fix.
    """
    from mbridge.models.qwen2moe import Qwen2MoEBridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge

    def fix(self, original):
        config = original(self)
        pre_softmax = not getattr(self.hf_config, "norm_topk_prob", not config.moe_router_pre_softmax)
        if "moe_router_pre_softmax" in self.extra_args or config.moe_router_pre_softmax == pre_softmax:
            return config
        return dataclasses.replace(config, moe_router_pre_softmax=pre_softmax)

    return [_method_fix(cls, "_build_config", fix, "mbridge ignores norm_topk_prob") for cls in (Qwen2MoEBridge, Qwen3MoEBridge)]


def qwen2_moe_shared_expert_gate() -> list[AttrPatch]:
    """Give a Qwen2-MoE model its shared-expert gate (``sigmoid(x @ shared_expert_gate.weight) * shared_expert(x)``).

    Needed by mbridge 0.15.1 (all versions of the other libraries): ``Qwen2MoEBridge`` maps
    ``mlp.shared_expert_gate.weight`` onto ``shared_experts.gate_weight`` but its ``_build_config``
    leaves ``moe_shared_expert_gate`` at megatron-core's default ``False``, so the model has no
    gate parameter, the checkpoint's gate is silently dropped and the shared expert's output is
    added ungated (log-probs off by ~1.3 on the tiny model). Wraps ``Qwen2MoEBridge._build_base_config``
    to pass ``moe_shared_expert_gate=True`` unless mbridge passes it itself (``bridge.set_extra_args``
    still wins). A bridge built inside the block keeps the wrapped method on the instance.
    """
    from mbridge.models.qwen2moe import Qwen2MoEBridge

    def fix(self, original, *args, **kwargs):
        if getattr(self.hf_config, "model_type", None) != "qwen2_moe":  # subclasses: Qwen3-MoE, GLM-4.5 (no gate)
            return original(self, *args, **kwargs)
        return original(self, *args, **{"moe_shared_expert_gate": True, **kwargs})

    return [_method_fix(Qwen2MoEBridge, "_build_base_config", fix, "mbridge drops the shared-expert gate")]


def mixtral_router_renormalise() -> list[AttrPatch]:
    """Make the Mixtral router renormalise its top-k probabilities, as Hugging Face's ``MixtralTopKRouter`` does.

    Needed by mbridge 0.15.1 (all versions of the other libraries): ``MixtralBridge._build_config``
    hard-codes ``moe_router_pre_softmax=True`` (softmax over all experts, the top-k probabilities
    taken unnormalised), but HF Mixtral takes softmax over all experts, then top-k, then divides by
    their sum -- equal to megatron-core's ``moe_router_pre_softmax=False`` (softmax over the top-k
    logits). Without the fix the expert outputs are scaled by the top-k mass (< 1): log-probs ~0.59
    off HF on the tiny model (1.4e-6 with it). Wraps ``MixtralBridge._build_config`` to set
    ``moe_router_pre_softmax=False`` unless the caller set it through ``bridge.set_extra_args``. A
    bridge built inside the block keeps the wrapped ``_build_config`` on the instance, so a later
    ``set_extra_args`` keeps the fix.
    """
    from mbridge.models.mixtral import MixtralBridge

    def fix(self, original):
        config = original(self)
        if "moe_router_pre_softmax" in self.extra_args or not config.moe_router_pre_softmax:
            return config
        return dataclasses.replace(config, moe_router_pre_softmax=False)

    return [_method_fix(MixtralBridge, "_build_config", fix, "mbridge leaves Mixtral's top-k unnormalised")]


def glm4_moe_router_and_shared_experts() -> list[AttrPatch]:
    """Build GLM-4.5's router and shared experts as Hugging Face's ``Glm4MoeMoE`` computes them.

    Needed by mbridge 0.15.1 (all versions of the other libraries): ``GLM4MoEBridge._build_config``
    ignores ``n_group`` / ``topk_group`` (HF chooses experts only within the ``topk_group`` best of
    ``n_group`` groups, scored by each group's two best biased scores: megatron-core's
    ``moe_router_num_groups`` / ``moe_router_group_topk``), and sizes the shared experts at
    ``moe_intermediate_size`` where HF has ``moe_intermediate_size * n_shared_experts``. (GLM-4.5's own
    checkpoints have one group and one shared expert, where both agree.) Wraps ``_build_config`` to pass
    both unless the caller set them through ``bridge.set_extra_args``; a bridge built inside the block
    keeps the wrapped method on the instance.
    """
    from mbridge.models.glm4moe import GLM4MoEBridge

    def fix(self, original):
        config = original(self)
        hf = self.hf_config
        changes: dict[str, Any] = {}
        if getattr(hf, "n_group", 1) > 1 and "moe_router_num_groups" not in self.extra_args:
            changes.update(moe_router_num_groups=hf.n_group, moe_router_group_topk=hf.topk_group)
        shared = hf.moe_intermediate_size * getattr(hf, "n_shared_experts", 1)
        if "moe_shared_expert_intermediate_size" not in self.extra_args and config.moe_shared_expert_intermediate_size != shared:
            changes.update(moe_shared_expert_intermediate_size=shared)
        return dataclasses.replace(config, **changes) if changes else config

    return [_method_fix(GLM4MoEBridge, "_build_config", fix,
                        "mbridge drops GLM-4.5's expert groups and sizes its shared experts for one")]


_HF_ROPE_TO_MLA = {"default": "rope", "yarn": "yarn"}


def _mla_rope_args(hf: Any) -> dict[str, Any]:
    """``MLATransformerConfig`` RoPE fields equal to Hugging Face's DeepSeek-V3 RoPE (``hf.rope_parameters``).

    HF's YaRN: cos / sin scaled by ``get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)`` when both are
    set, else ``get_mscale(f)``; the softmax scale by ``get_mscale(f, mscale_all_dim) ** 2``. megatron-core's
    ``YarnRotaryEmbedding`` and ``MLASelfAttention`` compute the same from the fields returned here.
    """
    params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _HF_ROPE_TO_MLA:
        raise ValueError(f"DeepSeek-V3 rope_type={rope_type!r}: megatron-core's MLA has only {sorted(_HF_ROPE_TO_MLA)}")
    if rope_type == "default":
        return dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    unsupported = {k: params[k] for k in ("attention_factor", "truncate") if params.get(k) not in (None, True)}
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        unsupported.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    if unsupported:
        raise ValueError(
            f"DeepSeek-V3 YaRN parameters {unsupported} have no megatron-core MLA equivalent; use a checkpoint "
            f"with mscale and mscale_all_dim both set (or neither), no attention_factor and truncate=True"
        )
    factor = params.get("factor") or hf.max_position_embeddings / params["original_max_position_embeddings"]
    both = bool(mscale and mscale_all_dim)
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=factor,
        mscale=mscale if both else 1.0,
        mscale_all_dim=mscale_all_dim if both else 0.0,
        original_max_position_embeddings=params["original_max_position_embeddings"],
        beta_fast=params.get("beta_fast") or 32,
        beta_slow=params.get("beta_slow") or 1,
    )


def deepseek_v3_config() -> list[AttrPatch]:
    """Build DeepSeek-V3's ``MLATransformerConfig`` as Hugging Face's ``DeepseekV3ForCausalLM`` computes.

    Needed by mbridge 0.15.1 with megatron-core >= 0.14 and transformers >= 5 (three problems in
    ``DeepseekV3Bridge._build_config``):

    - it passes ``max_position_embeddings`` (YaRN's original context), which megatron-core's
      ``MLATransformerConfig`` renamed ``original_max_position_embeddings``: every build raises ``TypeError``;
    - it reads RoPE scaling from ``hf_config.rope_scaling`` and its ``"type"`` key; transformers >= 5 keeps it
      in ``rope_parameters`` (``"rope_type"``), so a YaRN checkpoint would silently get plain RoPE, and mbridge's
      fallbacks (``mscale_all_dim=1``) differ from HF's (``0``) where a checkpoint leaves them out;
    - it ignores ``n_group`` / ``topk_group`` (megatron-core's ``moe_router_num_groups`` /
      ``moe_router_group_topk``): DeepSeek-V3 chooses experts within 4 of 8 groups, mbridge among all;
    - a checkpoint without MTP layers (``num_nextn_predict_layers=0``) gets ``mtp_num_layers=0``, which
      megatron-core's ``GPTModel`` takes for an MTP model (its forward then needs ``labels``); ``None`` is "no MTP";
    - it hard-codes ``attention_backend=fused``, which megatron-core enforces through process-wide ``NVTE_*``
      variables: a DeepSeek-V3 model and a model of any other bridge (``auto``) cannot be built in one process
      (``AssertionError: NVTE_FLASH_ATTN set to 1, but expected 0``). The fix keeps megatron-core's default.

    Wraps ``DeepseekV3Bridge._build_base_config`` to fix its keywords (``bridge.set_extra_args`` still wins);
    a bridge built inside the block keeps the wrapped method on the instance.
    """
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge
    from megatron.core.transformer import MLATransformerConfig

    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    def fix(self, original, *args, **kwargs):
        if "max_position_embeddings" in kwargs and "max_position_embeddings" not in fields:
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        kwargs.update(_mla_rope_args(self.hf_config))
        kwargs.pop("attention_backend", None)  # megatron-core's default (auto), as every other bridge
        if kwargs.get("mtp_num_layers") == 0:  # "no MTP" is None: megatron-core takes 0 for an MTP model
            kwargs.update(mtp_num_layers=None)
        hf = self.hf_config
        if (getattr(hf, "n_group", None) or 1) > 1:
            kwargs.update(moe_router_num_groups=hf.n_group, moe_router_group_topk=hf.topk_group)
        return original(self, *args, **kwargs)

    return [_method_fix(DeepseekV3Bridge, "_build_base_config", fix,
                        "mbridge's DeepSeek-V3 config: renamed YaRN field, transformers-5 RoPE, expert groups, MTP 0, attention backend")]


def deepseek_v3_fp32_weights() -> list[AttrPatch]:
    """Let a DeepSeek-V3 bridge of any dtype but bf16 read its checkpoint with mbridge's plain ``SafeTensorIO``.

    Needed by mbridge 0.15.1 (all versions of the other libraries): ``DeepseekV3Bridge._get_safetensor_io``
    supports only bf16 (FP8 checkpoints dequantised on load) and for fp32 runs ``raise NotImplemented(...)``,
    itself a ``TypeError``, so fp32 ``load_weights`` always fails. Wraps it to return ``Bridge``'s reader for
    dtypes other than bf16 (bf16 keeps mbridge's); the bridge keeps the wrapped method once it has loaded
    inside the block.
    """
    from mbridge.core.bridge import Bridge
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    def fix(self, original, weights_path):
        if self.dtype == torch.bfloat16:
            return original(self, weights_path)
        return Bridge._get_safetensor_io(self, weights_path)

    return [_method_fix(DeepseekV3Bridge, "_get_safetensor_io", fix, "mbridge's DeepSeek-V3 loads only bf16")]


def export_weights_without_autograd() -> list[AttrPatch]:
    """Run ``Bridge.export_weights`` (RL weight sync) with autograd off.

    Needed by mbridge 0.15.1 (all versions of the other libraries): ``export_weights`` gathers the
    parameters with in-place collectives (``broadcast_``) while autograd records, so the next backward
    warns ``c10d::broadcast_: an autograd kernel was not registered ... may lead to silently incorrect
    behavior`` once per gathered tensor (the gradients were checked unchanged). A lasting fix (applied
    at the first :func:`~megatron_tree.compat.apply_compat_patches`, never reverted: weight sync runs
    at any time in an RL loop); ``torch.no_grad`` on a generator function is active only while it runs.
    No-op once applied.
    """
    from mbridge.core.bridge import Bridge

    original = Bridge.export_weights
    if getattr(original, "_megatron_tree_no_grad", False):
        return []
    wrapped = functools.wraps(original)(torch.no_grad()(original))
    wrapped._megatron_tree_no_grad = True
    return [AttrPatch(Bridge, "export_weights", wrapped, "mbridge's export collectives run under autograd")]


def lasting_fixes() -> list[AttrPatch]:
    """Fixes :func:`megatron_tree.compat.apply_compat_patches` applies once and never reverts."""
    return export_weights_without_autograd()


def tied_embedding_mapping_per_bridge() -> list[AttrPatch]:
    """Keep a tied-embedding checkpoint's ``output_layer.weight -> model.embed_tokens.weight`` on its own bridge.

    Needed by mbridge 0.15.1 (all versions of the other libraries): ``_adjust_mapping_for_shared_weights``
    (Qwen2 and its subclasses Qwen3 / Qwen2.5-VL, Gemma3, InternVL3) writes into the *class*
    ``_DIRECT_MAPPING`` dict when ``tie_word_embeddings`` is set, so after one tied bridge every later
    bridge of that family, tied or not, maps ``output_layer.weight`` onto the embedding: an untied
    model then loads its embedding as ``lm_head`` or fails (``Weights set() not found``), e.g. a
    critic or reward model (untied, value head) built in the process of a tied actor. Wraps each
    override to give the bridge its own copy of ``_DIRECT_MAPPING`` first; the class dict is never
    written. Bridges built inside the block keep their copy for their whole life.
    """
    from mbridge.core.bridge import Bridge

    def all_subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from all_subclasses(sub)

    def wrap(original):
        @functools.wraps(original)
        def _adjust_mapping_for_shared_weights(self):
            self._DIRECT_MAPPING = dict(self._DIRECT_MAPPING)
            original(self)

        return _adjust_mapping_for_shared_weights

    why = "mbridge writes the tied-embedding mapping into the class dict"
    return [
        AttrPatch(cls, "_adjust_mapping_for_shared_weights", wrap(vars(cls)["_adjust_mapping_for_shared_weights"]), why)
        for cls in all_subclasses(Bridge)
        if "_adjust_mapping_for_shared_weights" in vars(cls)
    ]


_SLIDING, _FULL = "sliding_attention", "full_attention"


def hf_window_args(hf_config: Any) -> dict[str, Any]:
    """megatron-core's ``window_size`` / ``window_attn_skip_freq`` equal to a Hugging Face config's sliding window.

    HF: a ``sliding_attention`` layer's query i sees keys j with ``i - sliding_window < j <= i``
    (``transformers.masking_utils.sliding_window_overlay``); megatron-core's ``window_size=(left, 0)`` sees
    ``i - left <= j <= i``, so ``left = sliding_window - 1``. Which layers: ``hf_config.layer_types`` where the
    config has it (transformers >= 5 derives it: Qwen2 / Qwen3 ``i >= max_window_layers``, Qwen2-MoE its own
    pattern); else every layer (Mixtral, Qwen3-MoE), or, with ``max_window_layers`` (Qwen2 / Qwen3 on older
    transformers), the layers from it on. ``use_sliding_window=False`` or no ``sliding_window`` (None / 0): no
    window. Returns ``{}`` without a window, else ``window_size`` and ``window_attn_skip_freq`` (None: every layer;
    else a list, 1 = windowed, per layer). Layer types other than sliding / full raise ``ValueError``.
    """
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{type(hf_config).__name__}.sliding_window={window!r}: a sliding window is a number of "
                         f"tokens, an int >= 1 (null or 0: no window)")
    layers = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - {_SLIDING, _FULL})
        if unknown:
            raise ValueError(
                f"{type(hf_config).__name__}.layer_types has {unknown}: megatron-core (and tree attention) build only "
                f"{_SLIDING!r} and {_FULL!r} layers"
            )
        pattern = [t == _SLIDING for t in types]
    elif getattr(hf_config, "max_window_layers", None) is not None:
        pattern = [i >= hf_config.max_window_layers for i in range(layers)]
    else:
        pattern = [True] * layers
    if not any(pattern):
        return {}
    return dict(window_size=(int(window) - 1, 0), window_attn_skip_freq=None if all(pattern) else [int(p) for p in pattern])


def _with_hf_window(bridge: Any, config: Any) -> Any:
    """``config`` with the HF config's sliding window (:func:`hf_window_args`) unless the caller set one
    through ``bridge.set_extra_args``."""
    if "window_size" in bridge.extra_args:
        return config
    args = hf_window_args(bridge.hf_config)
    if not args or all(getattr(config, k) == v for k, v in args.items()):
        return config
    return dataclasses.replace(config, **args)


def hf_sliding_window() -> list[AttrPatch]:
    """Give megatron-core the Hugging Face config's sliding window (Qwen2 / Qwen3 ``use_sliding_window``, Mixtral ...).

    Needed by mbridge 0.15.1 (all versions of the other libraries): no LLM bridge reads ``sliding_window``,
    ``use_sliding_window``, ``max_window_layers`` or ``layer_types``, so a checkpoint with a sliding window
    builds a megatron-core model with full causal attention in every layer: its log-probs differ from HF's on
    every sequence longer than the window (tree or not). Sets ``window_size`` / ``window_attn_skip_freq``
    (:func:`hf_window_args`) on every LLM bridge built inside the block (an ``LLMBridge.__init__`` that calls
    ``Bridge.__init__``, then fixes ``bridge.config`` and wraps the instance's ``_build_config``, so a later
    ``set_extra_args`` keeps the window; ``set_extra_args(window_size=...)`` wins). Vision-language bridges
    (Gemma 3 builds its own windowed layers) are left alone. No-op for checkpoints without a window.
    """
    from mbridge.core.llm_bridge import LLMBridge
    from mbridge.core.vlm_bridge import VLMBridge

    own_init = vars(LLMBridge).get("__init__")  # None in 0.15.1: Bridge.__init__ runs

    def __init__(self, hf_config, *args, **kwargs):
        if own_init is not None:
            own_init(self, hf_config, *args, **kwargs)
        else:
            super(LLMBridge, self).__init__(hf_config, *args, **kwargs)  # Bridge.__init__, as patched now
        if isinstance(self, VLMBridge) or not hf_window_args(self.hf_config):
            return
        inner = self._build_config  # bound: the class method, or an instance fix (see _method_fix)

        def _build_config(bridge):
            return _with_hf_window(bridge, inner())

        self._build_config = types.MethodType(_build_config, self)
        self.config = _with_hf_window(self, self.config)

    return [AttrPatch(LLMBridge, "__init__", __init__, "mbridge drops the HF config's sliding window")]


def compat_patches() -> list[AttrPatch]:
    """The mbridge compatibility patches this process needs (see each function)."""
    return (
        model_type_encoder_and_decoder()
        + hf_rope_theta()
        + local_layer_spec()
        + local_spec_weight_names()
        + qwen_moe_norm_topk_prob()
        + qwen2_moe_shared_expert_gate()
        + mixtral_router_renormalise()
        + glm4_moe_router_and_shared_experts()
        + deepseek_v3_config()
        + deepseek_v3_fp32_weights()
        + tied_embedding_mapping_per_bridge()
        + hf_sliding_window()
    )

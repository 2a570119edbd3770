"""megatron_tree.compat (and the feature hooks beside it): each compatibility piece and hook applies, nests and reverts exactly; the local-spec
weight names round-trip through mbridge (load is covered by tests/runtime/test_cpu_mode.py, export here);
what a bridge built inside the block needs stays with it after the block (load, export, save,
MoE forward and backward with no block open)."""

from __future__ import annotations

import enum
import types

import pytest
import torch

pytest.importorskip("mbridge")

from mbridge import AutoBridge  # noqa: E402
from mbridge.core import llm_bridge, util  # noqa: E402
from mbridge.core.bridge import Bridge  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from megatron_tree.mcore.bridge import build_flat_model, build_tree_model  # noqa: E402
from megatron_tree.mcore.config_overrides import cpu_transformer_overrides  # noqa: E402
from megatron_tree.runtime import (  # noqa: E402
    cpu_mode,
    save_tiny_hf_checkpoint,
)
from megatron_tree.compat import apply_compat_patches  # noqa: E402
from megatron_tree.testing import hf_reference_logits  # noqa: E402
from megatron_tree.compat import mbridge as mbridge_patches  # noqa: E402
from megatron_tree.compat import megatron_core as megatron_core_patches  # noqa: E402
from megatron_tree.runtime.cpu import cpu_rng_state  # noqa: E402
from megatron_tree.mcore.bridge_hooks import layer_spec_hook, model_hook  # noqa: E402
from scripts.parity_common import branching_forest, hf_logprobs, max_diff, micro_batches, tree_logprobs  # noqa: E402

_ABSENT = object()
_MBRIDGE_MAPPING = Bridge._weight_name_mapping_mcore_local_to_global  # as imported, before any block
PIECES = [
    mbridge_patches.model_type_encoder_and_decoder,
    mbridge_patches.hf_rope_theta,
    mbridge_patches.local_layer_spec,
    mbridge_patches.local_spec_weight_names,
    mbridge_patches.qwen_moe_norm_topk_prob,
    mbridge_patches.qwen2_moe_shared_expert_gate,
    mbridge_patches.mixtral_router_renormalise,
    mbridge_patches.glm4_moe_router_and_shared_experts,
    mbridge_patches.export_weights_without_autograd,
    mbridge_patches.deepseek_v3_config,
    mbridge_patches.deepseek_v3_fp32_weights,
    mbridge_patches.tied_embedding_mapping_per_bridge,
    megatron_core_patches.moe_te_general_gemm,
    megatron_core_patches.torch_optimizers_without_cuda,
    megatron_core_patches.local_attention_mla_channels,
    megatron_core_patches.mla_without_transformer_engine,
    megatron_core_patches.mla_query_without_low_rank,
    cpu_rng_state,
]



INPUT_IDS = torch.randint(0, 160, (1, 9), generator=torch.Generator().manual_seed(0))


def flat_logits(chunks):
    """Logits ``[1, 9, V]`` of a flat model's first chunk on ``INPUT_IDS`` (eval mode, no grad)."""
    with torch.no_grad():
        return chunks[0].eval()(INPUT_IDS, torch.arange(9)[None], attention_mask=None)


def hf_error(path, logits):
    """Max |logits - HF's logits| of the checkpoint ``path`` on ``INPUT_IDS``."""
    return (logits - hf_reference_logits(path, INPUT_IDS)).abs().max().item()


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny_hf_checkpoint(arch, root / arch) for arch in ("qwen2", "qwen3_moe")}


def _own(owner, name):
    return vars(owner).get(name, _ABSENT)


@pytest.mark.parametrize("piece", PIECES, ids=lambda f: f.__name__)
def test_each_piece_restores_the_exact_original(piece):
    patches = piece()  # empty where this process does not need the piece (e.g. ModelType on megatron-core 0.16)
    saved = [_own(p.owner, p.name) for p in patches]
    for p in patches:
        p.apply()
        assert getattr(p.owner, p.name) is p.new
    for p in reversed(patches):
        p.revert()
    assert [_own(p.owner, p.name) for p in patches] == saved
    for p in patches:
        with pytest.raises(RuntimeError, match="not applied"):
            p.revert()


def test_optimizers_are_torch_ones_without_cuda_where_te_bound_fused_ones(monkeypatch):
    """TE installed, no usable GPU (a CPU run on a GPU host): megatron-core's fused Adam / SGD become torch's."""
    from megatron.core import optimizer

    monkeypatch.setattr(optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(optimizer, "Adam", object)  # stands for TE's FusedAdam
    from megatron.core.optimizer import distrib_optimizer

    patches = megatron_core_patches.torch_optimizers_without_cuda()
    assert {p.name: p.new for p in patches if p.owner is optimizer} == {
        "USING_PYTORCH_OPTIMIZER": True, "Adam": torch.optim.AdamW, "SGD": torch.optim.SGD}
    # the distributed optimizer (de)serialises the torch optimizer's state, not a fused one's
    assert {p.name: p.new for p in patches if p.owner is distrib_optimizer} == {
        "HAVE_APEX_OR_TE": False, "USING_TE_OPTIMIZER": False, "USING_APEX_OPTIMIZER": False}
    with apply_compat_patches():
        assert optimizer.Adam is torch.optim.AdamW and optimizer.USING_PYTORCH_OPTIMIZER is True
        assert distrib_optimizer.HAVE_APEX_OR_TE is False
    assert optimizer.Adam is object


def test_apply_compat_patches_is_nested_safe_and_reverts():
    originals = {
        (Bridge, "__init__"): Bridge.__init__,
        (Bridge, "_weight_name_mapping_mcore_local_to_global"): Bridge._weight_name_mapping_mcore_local_to_global,
        (llm_bridge, "get_gpt_decoder_block_spec"): llm_bridge.get_gpt_decoder_block_spec,
        (Bridge, "get_model"): Bridge.get_model,
        (util, "ModelType"): util.ModelType,
    }
    with apply_compat_patches() as applied:
        with apply_compat_patches() as inner:
            assert inner == applied
        for p in applied:  # still applied after the inner block
            assert getattr(p.owner, p.name) is p.new
        assert hasattr(moe_utils, "te_general_gemm")
    for (owner, name), original in originals.items():
        assert getattr(owner, name) is original, name
    assert hasattr(moe_utils, "te_general_gemm")  # an upstream fix (a missing name) stays applied


class _Frozen:
    def __setattr__(self, name, value):
        raise RuntimeError("boom")


def test_patch_failure_during_apply_reverts_what_was_applied(monkeypatch):
    real = mbridge_patches.compat_patches
    # the last patch cannot apply: the ones applied before it must be reverted
    failing = mbridge_patches.AttrPatch(_Frozen(), "x", 0)
    monkeypatch.setattr(mbridge_patches, "compat_patches", lambda: real() + [failing])
    before = Bridge.get_model, llm_bridge.get_gpt_decoder_block_spec
    with pytest.raises(RuntimeError, match="boom"):
        with apply_compat_patches():
            pass
    assert (Bridge.get_model, llm_bridge.get_gpt_decoder_block_spec) == before


def test_model_type_patch_only_where_the_member_is_missing(monkeypatch):
    if hasattr(util.ModelType, "encoder_and_decoder"):
        assert mbridge_patches.model_type_encoder_and_decoder() == []
    stripped = enum.Enum("ModelType", ["encoder_or_decoder"])
    monkeypatch.setattr(util, "ModelType", stripped)
    (patch,) = mbridge_patches.model_type_encoder_and_decoder()
    patch.apply()
    assert util.ModelType.encoder_or_decoder is stripped.encoder_or_decoder
    assert all(util.ModelType.encoder_and_decoder != member for member in stripped)
    patch.revert()
    assert util.ModelType is stripped


def test_rope_theta_exposed_from_rope_parameters():
    config = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 123.0})
    mbridge_patches._expose_rope_theta(config)
    assert config.rope_theta == 123.0
    scaled = types.SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        mbridge_patches._expose_rope_theta(scaled)


def test_bridge_rotary_base_comes_from_the_checkpoint(tiny_paths, cpu_dist):
    with apply_compat_patches():
        bridge = AutoBridge.from_pretrained(tiny_paths["qwen2"])
    assert bridge._get_gptmodel_args()["rotary_base"] == 1e6


def test_local_names_map_to_te_names_with_global_expert_ids():
    moe = types.SimpleNamespace(
        _MLP_MAPPING={"pre_mlp_layernorm": []},
        mpu=types.SimpleNamespace(ep_size=2, ep_rank=1),
        config=types.SimpleNamespace(num_moe_experts=8),
    )
    dense = types.SimpleNamespace(_MLP_MAPPING={"mlp.linear_fc1.weight": []})
    name = mbridge_patches._local_name_to_te_name
    assert name(dense, "decoder.layers.3.input_layernorm.weight", True) == (
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    )
    assert name(dense, "decoder.layers.3.pre_mlp_layernorm.weight", True) == (
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
    )
    assert name(moe, "decoder.layers.3.pre_mlp_layernorm.weight", True) == "decoder.layers.3.pre_mlp_layernorm.weight"
    local = "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight"
    assert name(moe, local, True) == "decoder.layers.3.mlp.experts.linear_fc2.weight5"  # 1 + 8/2 * 1
    assert name(moe, local, False) == "decoder.layers.3.mlp.experts.linear_fc2.weight1"
    assert name(moe, "decoder.layers.3.self_attention.linear_qkv.weight", True).endswith("linear_qkv.weight")
    mla = types.SimpleNamespace(_ATTENTION_MAPPING={"input_layernorm.weight": [], "linear_q_up_proj.layer_norm_weight": []})
    assert name(mla, "decoder.layers.3.input_layernorm.weight", True) == "decoder.layers.3.input_layernorm.weight"
    assert name(mla, "decoder.layers.3.self_attention.kv_layernorm.weight", True) == (
        "decoder.layers.3.self_attention.linear_kv_up_proj.layer_norm_weight"
    )
    qwen3 = types.SimpleNamespace(_ATTENTION_MAPPING={"self_attention.q_layernorm.weight": []})
    assert name(qwen3, "decoder.layers.3.self_attention.q_layernorm.weight", True).endswith("q_layernorm.weight")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_export_weights_round_trips_hf_checkpoint(arch, tiny_paths, cpu_dist):
    hf = load_file(f"{tiny_paths[arch]}/model.safetensors")
    with apply_compat_patches(), cpu_mode():
        bridge, chunks = build_flat_model(tiny_paths[arch])
        exported = dict(bridge.export_weights(chunks))
    assert sorted(exported) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(exported[key], value), key


def test_router_follows_norm_topk_prob(tmp_path, cpu_dist):
    path = save_tiny_hf_checkpoint("qwen3_moe", tmp_path, norm_topk_prob=False)
    with apply_compat_patches(), cpu_mode():
        bridge, chunks = build_flat_model(path)
        logits = flat_logits(chunks)
        assert bridge.config.moe_router_pre_softmax
        bridge.set_extra_args(moe_router_pre_softmax=False)  # an explicit choice wins
        assert not bridge.config.moe_router_pre_softmax
    assert hf_error(path, logits) < 1e-5


def test_qwen2_moe_keeps_its_shared_expert_gate(tmp_path, cpu_dist):
    path = save_tiny_hf_checkpoint("qwen2_moe", tmp_path)
    with apply_compat_patches(), cpu_mode():
        bridge, chunks = build_flat_model(path)
        assert sum(name.endswith("shared_experts.gate_weight") for name, _ in chunks[0].named_parameters()) == 2
        logits = flat_logits(chunks)
    bridge.set_extra_args(attention_dropout=0.0)  # rebuilt after the block: the gate stays
    assert bridge.config.moe_shared_expert_gate
    assert hf_error(path, logits) < 1e-5


def test_mixtral_router_renormalises_top_k(tmp_path, cpu_dist):
    """mbridge 0.15.1 builds Mixtral's router with unnormalised top-k probabilities; HF renormalises them."""
    path = save_tiny_hf_checkpoint("mixtral", tmp_path)
    with apply_compat_patches(), cpu_mode():
        bridge, chunks = build_flat_model(path)
        logits = flat_logits(chunks)
        assert not bridge.config.moe_router_pre_softmax
        bridge.set_extra_args(moe_router_pre_softmax=True)  # an explicit choice wins
        assert bridge.config.moe_router_pre_softmax
    bridge.extra_args.pop("moe_router_pre_softmax")
    bridge.set_extra_args(attention_dropout=0.0)  # rebuilt after the block: the fix stays
    assert not bridge.config.moe_router_pre_softmax
    assert hf_error(path, logits) < 1e-5


def test_glm4_moe_routes_within_groups_and_sizes_its_shared_experts(tmp_path, cpu_dist):
    """mbridge 0.15.1 drops GLM-4.5's n_group / topk_group and sizes the shared experts for one; with two
    groups of which one is chosen and two shared experts the logits then differ from HF's."""
    path = save_tiny_hf_checkpoint("glm4_moe", tmp_path, n_shared_experts=2)
    with apply_compat_patches(), cpu_mode():
        bridge, chunks = build_flat_model(path)
        logits = flat_logits(chunks)
        config = bridge.config
        assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
        assert config.moe_shared_expert_intermediate_size == 64 and not config.moe_shared_expert_gate
        assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert hf_error(path, logits) < 1e-5


def test_deepseek_v3_builds_loads_and_matches_hf(tmp_path, cpu_dist):
    """mbridge 0.15.1's DeepSeek-V3 bridge on megatron-core 0.16 / transformers 5 without TE: the config raises
    TypeError (renamed YaRN field), the local MLA attention and MLA without TE raise TypeError at build, fp32
    weights do not load; with the pieces the flat model (YaRN as DeepSeek-V3, 2 expert groups) matches HF."""
    from mbridge.core.safetensor_io import SafeTensorIO
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    path = save_tiny_hf_checkpoint("deepseek_v3", tmp_path)
    with apply_compat_patches(), cpu_mode():
        bridge, chunks = build_flat_model(path)
        logits = flat_logits(chunks)
    config = bridge.config
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    assert config.original_max_position_embeddings == 4096 and config.mtp_num_layers is None
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.attention_backend.name == "auto"  # mbridge's "fused" clashes with every other model's NVTE_* env
    assert type(bridge._get_safetensor_io(path)) is SafeTensorIO  # kept on the bridge after the block
    with pytest.raises(TypeError):  # mbridge's own: raise NotImplemented(...)
        DeepseekV3Bridge._get_safetensor_io(bridge, path)
    assert hf_error(path, logits) < 1e-5


def test_mla_rope_arguments_follow_hf_defaults():
    hf = types.SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                "original_max_position_embeddings": 16}, max_position_embeddings=64)
    args = mbridge_patches._mla_rope_args(hf)
    assert (args["mscale"], args["mscale_all_dim"], args["beta_fast"], args["beta_slow"]) == (1.0, 0.0, 32, 1)
    hf.rope_parameters["attention_factor"] = 2.0
    with pytest.raises(ValueError, match="attention_factor"):
        mbridge_patches._mla_rope_args(hf)
    default = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert mbridge_patches._mla_rope_args(default)["rope_type"] == "rope"


def test_mla_without_low_rank_query_builds_no_query_norm():
    """megatron-core 0.19's MLA without q_lora_rank refuses the local spec's q_layernorm and fuses a query norm
    into linear_q_proj that HF does not have; the patch resolves what megatron-core 0.16 builds."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if not hasattr(MLASelfAttention, "_resolve_qk_norm_config"):
        assert megatron_core_patches.mla_query_without_low_rank() == []
        pytest.skip("megatron-core < 0.19 builds no query norm without q_lora_rank")
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    submodules = spec.submodules.self_attention.submodules
    assert submodules.q_layernorm is not IdentityOp and submodules.linear_q_proj is ColumnParallelLinear

    def resolve(q_lora_rank):
        config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=q_lora_rank,
                                      kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                                      rope_type="rope", qk_layernorm=True, normalization="RMSNorm",
                                      use_cpu_initialization=True)
        return MLASelfAttention._resolve_qk_norm_config(types.SimpleNamespace(config=config), submodules)

    with pytest.raises(ValueError, match="q_lora_rank is None"):
        resolve(None)
    with_lora = resolve(32)
    with apply_compat_patches():
        without = resolve(None)
        assert resolve(32) == with_lora  # untouched with a low-rank query
    assert without["linear_q_proj"] is ColumnParallelLinear and without["q_layernorm"] is IdentityOp
    assert without["kv_layernorm"] is submodules.kv_layernorm  # the latent KV norm stays


def test_local_attention_takes_mla_value_head_dim(cpu_dist):
    """megatron-core 0.16's local DotProductAttention refuses MLA's k/v_channels and sizes its output by kv_channels."""
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=None,
                                  kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                                  rope_type="rope", use_cpu_initialization=True, masked_softmax_fusion=False,
                                  attention_dropout=0.0)
    with pytest.raises(TypeError, match="k_channels"):
        DotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=0.2, k_channels=24, v_channels=12)
    q, k, v = (torch.randn(5, 1, 4, d) for d in (24, 24, 12))
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)[None, None]
    with apply_compat_patches(), cpu_mode():
        attn = DotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=0.2, k_channels=24, v_channels=12)
        out = attn(q, k, v, causal, attn_mask_type=AttnMaskType.causal)
    want = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                                            scale=0.2)
    assert out.shape == (5, 1, 48)
    assert (out - want.permute(2, 0, 1, 3).reshape(5, 1, 48)).abs().max().item() < 1e-6


def test_weight_export_leaves_no_autograd_warning_behind(tiny_paths, cpu_dist):
    """RL weight sync: mbridge's export collectives ran under autograd, and the next backward warned once per
    tensor that an in-place collective has no autograd kernel ("may lead to silently incorrect behavior")."""
    import warnings

    with apply_compat_patches(), cpu_mode():
        bridge, chunks = build_flat_model(tiny_paths["qwen2"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exported = dict(bridge.export_weights(chunks))
            assert torch.is_grad_enabled()  # no_grad only while the generator runs
            chunks[0](INPUT_IDS, torch.arange(9)[None], attention_mask=None).sum().backward()
    assert exported and not [w for w in caught if "autograd kernel was not registered" in str(w.message)]


def test_tied_bridge_keeps_its_output_mapping_to_itself(tmp_path, cpu_dist):
    """mbridge writes a tied checkpoint's output_layer -> embed_tokens mapping into the class dict;
    under the patches it stays on that bridge, and an untied model built later loads its lm_head."""
    tied = save_tiny_hf_checkpoint("qwen2", tmp_path / "tied", tie_word_embeddings=True)
    untied = save_tiny_hf_checkpoint("qwen2", tmp_path / "untied")
    with apply_compat_patches(), cpu_mode():
        tied_bridge, _ = build_flat_model(tied)
        _, chunks = build_flat_model(untied)
        logits = flat_logits(chunks)
    assert tied_bridge._DIRECT_MAPPING["output_layer.weight"] == "model.embed_tokens.weight"
    assert type(tied_bridge)._DIRECT_MAPPING["output_layer.weight"] == "lm_head.weight"
    assert hf_error(untied, logits) < 1e-5


class _Wrapped(torch.nn.Module):
    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk


def test_layer_spec_and_model_hooks_apply_nest_and_revert(tiny_paths, cpu_dist):
    calls = []

    def final_norm_to_identity(spec):
        calls.append(("outer", type(spec)))
        return type(spec)(layer_specs=spec.layer_specs, layer_norm=IdentityOp)

    def record(spec):
        calls.append("inner")
        return spec

    original_spec, original_get_model = llm_bridge.LLMBridge._get_transformer_layer_spec, Bridge.get_model
    with apply_compat_patches(), cpu_mode():
        bridge = AutoBridge.from_pretrained(tiny_paths["qwen2"], dtype=torch.float32)
        bridge.set_extra_args(**cpu_transformer_overrides(moe=False))
        with layer_spec_hook(final_norm_to_identity), model_hook(_Wrapped):
            with layer_spec_hook(record), layer_spec_hook(final_norm_to_identity), model_hook(_Wrapped):
                chunks = bridge.get_model(bf16=False, fp16=False, wrap_with_ddp=False)
            assert llm_bridge.LLMBridge._get_transformer_layer_spec is not original_spec  # outer still open
        plain = bridge.get_model(bf16=False, fp16=False, wrap_with_ddp=False)
    assert calls == [("outer", TransformerBlockSubmodules), "inner"]
    (chunk,) = chunks
    assert isinstance(chunk, _Wrapped) and isinstance(chunk.chunk.decoder.final_layernorm, IdentityOp)
    assert not isinstance(plain[0], _Wrapped) and not isinstance(plain[0].decoder.final_layernorm, IdentityOp)
    assert llm_bridge.LLMBridge._get_transformer_layer_spec is original_spec
    assert Bridge.get_model is original_get_model


def test_hooks_reject_bad_transforms(tiny_paths, cpu_dist):
    with pytest.raises(TypeError, match="spec_transform"):
        with layer_spec_hook("not callable"):
            pass
    with pytest.raises(TypeError, match="model_transform"):
        with model_hook(None):
            pass
    with apply_compat_patches(), cpu_mode():
        bridge = AutoBridge.from_pretrained(tiny_paths["qwen2"], dtype=torch.float32)
        bridge.set_extra_args(**cpu_transformer_overrides(moe=False))
        with pytest.raises(TypeError, match="returned None"):
            with layer_spec_hook(lambda spec: None):
                bridge.get_model(bf16=False, fp16=False, wrap_with_ddp=False)


def test_patches_install_only_under_megatron_tree():
    """setup.py ships patches/ as megatron_tree.compat (a link), never as a top-level ``patches``."""
    import pathlib

    from setuptools import find_packages

    root = pathlib.Path(__file__).resolve().parents[2]
    packages = find_packages(str(root), include=["megatron_tree", "megatron_tree.*"])
    assert "megatron_tree.compat" in packages
    assert not any(p == "patches" or p.startswith("patches.") for p in packages)
    assert "find_packages(include=[\"megatron_tree\", \"megatron_tree.*\"])" in (root / "setup.py").read_text()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_bridge_built_in_the_block_loads_exports_and_saves_after_it(arch, tiny_paths, cpu_dist, tmp_path):
    hf = load_file(f"{tiny_paths[arch]}/model.safetensors")
    with cpu_mode():
        bridge, chunks = build_tree_model(tiny_paths[arch])  # opens and closes patch_bridge_for_tree_training
    assert Bridge._weight_name_mapping_mcore_local_to_global is _MBRIDGE_MAPPING  # the class is mbridge's again
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.zero_()
    bridge.load_weights(chunks, tiny_paths[arch])
    exported = dict(bridge.export_weights(chunks))
    bridge.save_weights(chunks, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    for got in (exported, saved):
        assert sorted(got) == sorted(hf)
        for key, value in hf.items():
            assert torch.equal(got[key], value), key


def test_norm_topk_prob_fix_outlives_the_block(tmp_path, cpu_dist):
    path = save_tiny_hf_checkpoint("qwen3_moe", tmp_path, norm_topk_prob=False)
    with apply_compat_patches():
        bridge = AutoBridge.from_pretrained(path)
    bridge.set_extra_args(attention_dropout=0.0)  # rebuilds bridge.config after the block
    assert bridge.config.moe_router_pre_softmax


def test_fix_keeps_a_subclass_override_in_the_chain_after_the_block(tmp_path, cpu_dist):
    """GLM-4.5V's bridge overrides _build_config (mRoPE sections, no qk-norm) above mbridge's GLM-4.5 bridge, whose
    _build_config a compat fix wraps: rebuilt after the block, the config has both the override's and the fix's."""
    from megatron_tree.mcore.bridges import register_bridges

    path = save_tiny_hf_checkpoint("glm4v_moe", tmp_path)
    with apply_compat_patches():
        register_bridges()
        bridge = AutoBridge.from_pretrained(path)
    bridge.set_extra_args(attention_dropout=0.0)  # rebuilds bridge.config after the block
    config = bridge.config
    assert config.mrope_section == [1, 1, 2] and not config.qk_layernorm
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)


def test_moe_forward_and_backward_with_no_block_open(tiny_paths, cpu_dist, monkeypatch):
    if getattr(moe_utils, "te_general_gemm", _ABSENT) is None:  # our fix, from an earlier block: undo it here
        monkeypatch.delattr(moe_utils, "te_general_gemm")
    seqs = branching_forest()
    with cpu_mode():
        _, chunks = build_tree_model(tiny_paths["qwen3_moe"])
        model = chunks[0].train()
        logprobs = tree_logprobs(model, micro_batches(seqs))
        sum(lp.sum() for lp in logprobs.values()).backward()
    assert max_diff(logprobs, hf_logprobs(tiny_paths["qwen3_moe"], seqs)) < 1e-5
    router = model.decoder.layers[0].mlp.router.weight.grad
    assert router is not None and torch.isfinite(router).all() and router.abs().max() > 0

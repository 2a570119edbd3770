"""Per-token RoPE on plain megatron-core models (no mbridge): tree_layer_spec + convert_to_tree_model.

The model-level check: log-probs of a branching forest packed as trees equal those of the same
model run on each sequence alone (a chain, where depth == slot index), for every RoPE variant
GPTModel builds (plain, llama-3 scaling, linear interpolation, interleaved, partial, YaRN).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from scripts.parity_common import branching_forest, micro_batches

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.mcore.core_attention import TreeCoreAttention
from megatron_tree.mcore.layer_spec import tree_layer_spec
from megatron_tree.ops.logprobs import gather_tree_logprobs
from megatron_tree.mcore.rope import TreeRotaryEmbedding, convert_to_tree_model, enable_tree_rope
from megatron_tree.mcore.config_overrides import cpu_transformer_overrides

VOCAB = 160
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
YARN = dict(
    yarn_rotary_scaling_factor=4.0,
    yarn_original_max_position_embeddings=16,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=0.0,
    yarn_correction_range_round_to_int=True,
)
VARIANTS = {
    "plain": ({}, {}),
    "llama3_scaling": ({}, dict(rope_scaling=True, rope_scaling_factor=8.0)),
    "interpolation": ({}, dict(seq_len_interpolation_factor=2.0)),
    "interleaved": (dict(rotary_interleaved=True), {}),
    "partial": ({}, dict(rotary_percent=0.5)),
    "yarn": ({}, dict(position_embedding_type="yarn")),
}


pytestmark = pytest.mark.usefixtures("cpu_megatron")  # tests/conftest.py


def tiny_config(**overrides) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        normalization="RMSNorm",
        qk_layernorm=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **{**cpu_transformer_overrides(moe=False), **overrides},
    )


def tiny_tree_gpt(config_overrides=None, model_kwargs=None, *, enable=True) -> GPTModel:
    config = tiny_config(**(config_overrides or {}))
    model_kwargs = dict(model_kwargs or {})
    if model_kwargs.get("position_embedding_type") == "yarn":
        for name, value in YARN.items():
            setattr(config, name, value)
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=tree_layer_spec(get_gpt_layer_local_spec(qk_layernorm=True)),
        vocab_size=VOCAB,
        max_sequence_length=256,
        position_embedding_type=model_kwargs.pop("position_embedding_type", "rope"),
        rotary_base=10000,
        **model_kwargs,
    )
    with torch.no_grad():  # random, non-trivial norms so every path matters
        for name, p in model.named_parameters():
            if name.endswith("layer_norm_weight") or "layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.to(DEVICE)
    return convert_to_tree_model(model).eval() if enable else model.eval()


def logprobs_of(model, mbs) -> dict[int, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for mb in mbs:
            mb = mb.to(DEVICE)
            lp = gather_tree_logprobs(model(mb.input_ids, mb.position_ids, mb.attention_mask), mb)
            for k, sid in enumerate(mb.sequence_ids):
                out[sid] = lp[mb.cu_targets[k] : mb.cu_targets[k + 1]]
    return out


def max_err(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tree_packed_equals_each_sequence_alone(variant):
    config_overrides, model_kwargs = VARIANTS[variant]
    model = tiny_tree_gpt(config_overrides, model_kwargs)
    seqs = branching_forest(seed=3)
    mbs = micro_batches(seqs)
    alone = {}
    for sid, seq in enumerate(seqs):  # a chain: depth == slot index, any RoPE is right here
        alone[sid] = logprobs_of(model, pack_trees([seq], MicroBatchSpec(max_tokens_per_mb=64)))[0]
    err = max_err(logprobs_of(model, mbs), alone)
    model.rotary_pos_emb = model.rotary_pos_emb.inner  # back to upstream: packed index
    packed_err = max_err(logprobs_of(model, mbs), alone)
    print(f"{variant}: tree RoPE {err:.3g}, packed-index RoPE {packed_err:.3g}")
    assert err < 1e-5
    assert packed_err > 1e-3


def test_table_rows_follow_position_ids():
    inner = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    rope = TreeRotaryEmbedding(inner, apply_rope_fusion=True)
    table = inner(6)  # [6, 1, 1, 8]
    assert rope(6).shape == (6, 1, 1, 8)  # no position_ids: upstream table
    rope.position_ids = torch.tensor([[0, 1, 2, 1, 2, 3]])
    got = rope(6)
    # The fused (TE) kernel reads row s of a [S, 1, 1, D] table for slot s: keep that layout.
    assert got.shape == (6, 1, 1, 8)
    torch.testing.assert_close(got, table[[0, 1, 2, 1, 2, 3]])
    rope.position_ids = torch.tensor([[0, 1, 2, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="apply_rope_fusion=False"):
        rope(6)
    rope.apply_rope_fusion = False
    got = rope(6)
    assert got.shape == (6, 2, 1, 8)
    torch.testing.assert_close(got[:, 1], table[:, 0])
    with pytest.raises(ValueError, match=r"position_ids \[b, 7\]"):
        rope(7)


def test_enable_is_idempotent_and_takes_model_chunks():
    model = tiny_tree_gpt(enable=False)
    cores = [m for m in model.modules() if isinstance(m, TreeCoreAttention)]
    assert len(cores) == 2 and not any(c.positions_from_ids for c in cores)
    assert convert_to_tree_model([model]) == [model]
    with pytest.deprecated_call(match="now megatron_tree.convert_to_tree_model"):
        enable_tree_rope(model)  # the 0.1 name
    assert isinstance(model.rotary_pos_emb, TreeRotaryEmbedding)
    assert isinstance(model.rotary_pos_emb.inner, RotaryEmbedding)
    assert all(c.positions_from_ids for c in cores)
    assert model.state_dict().keys() == tiny_tree_gpt(enable=False).state_dict().keys()


def test_tree_attention_refuses_a_model_without_tree_rope():
    model = tiny_tree_gpt(enable=False)
    mb = micro_batches(branching_forest())[0].to(DEVICE)
    with torch.no_grad(), pytest.raises(RuntimeError, match="convert_to_tree_model"):
        model(mb.input_ids, mb.position_ids, mb.attention_mask)


def test_position_ids_required_with_a_tree_mask():
    model = tiny_tree_gpt()
    mb = micro_batches(branching_forest())[0].to(DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match="position_ids=None"):
        model(mb.input_ids, None, mb.attention_mask)
    with torch.no_grad(), pytest.raises(ValueError, match="position_ids has shape"):
        model(mb.input_ids, mb.position_ids[:, :-1], mb.attention_mask)
    assert model.rotary_pos_emb.position_ids is None  # released after every forward


def test_refusals():
    with pytest.raises(TypeError, match="no megatron.core GPTModel"):
        convert_to_tree_model(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="list of model chunks"):
        convert_to_tree_model([object()])
    model = tiny_tree_gpt(enable=False)
    model.config = dataclasses.replace(model.config, multi_latent_attention=True, apply_rope_fusion=True)
    with pytest.raises(ValueError, match="multi-latent attention with apply_rope_fusion=True"):
        convert_to_tree_model(model)
    model = tiny_tree_gpt(enable=False)
    model.position_embedding_type = "mrope"
    with pytest.raises(ValueError, match="mrope"):
        convert_to_tree_model(model)

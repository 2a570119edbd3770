"""Tree-packed models built by mbridge under patch_bridge_for_tree_training, end to end (CPU, fp32).

- log-probs of tree micro-batches == Hugging Face run on each sequence alone;
- gradients of a weighted sum of them == the same weights through the upstream (flat) model
  run on each sequence alone, with full and selective recompute;
- a regression check that fails if RoPE rotates by packed index again;
- any forest (hypothesis) through the schedule equals each sequence alone, log-probs and gradients;
- TP=2 and EP=2 over gloo (tests/scripts/parity_dist.py).

The forests (``branching_forest``) put long branches after a sibling, where packed-index RoPE
is wrong.
"""

from __future__ import annotations

import re

import pytest
import torch
from dist_utils import TorchrunCases
from forests import any_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from scripts.parity_common import (
    branching_forest,
    build_model,
    chunked_step,
    flat_logprobs,
    hf_logprobs,
    max_diff,
    micro_batches,
    param_grads,
    relative_grad_error,
    save_tiny_mimo_checkpoint,
    tree_and_flat_backward,
    tree_logprobs,
    weighted_sum,
)

from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.attention import dispatch as tree_attention_module
from megatron_tree.mcore.bridge import build_tree_model
from megatron_tree.mcore.core_attention import TreeCoreAttention
from megatron_tree.mcore.forward_only import tree_forward_only
from megatron_tree.mcore.model_check import check_tree_model
from megatron_tree.mcore.rope import TreeRotaryEmbedding
from megatron_tree.runtime import (
    TINY_ARCHS,
    save_hf_config,
    save_tiny_hf_checkpoint,
)

LOGPROB_TOL = 1e-5
GRAD_TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {arch: save_tiny_hf_checkpoint(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="module")
def forest():
    seqs = branching_forest()
    mbs = micro_batches(seqs)
    assert len(mbs) > 1
    # The layout must be able to expose packed-index RoPE: some slot's depth != its index.
    assert any(
        (mb.position_ids[0, : mb.num_tokens] != torch.arange(mb.num_tokens)).any() for mb in mbs
    )
    return seqs, mbs


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tree_logprobs_match_hf_per_sequence(arch, checkpoints, forest):
    seqs, mbs = forest
    model = build_model(checkpoints[arch], tree=True)[0].eval()
    with torch.no_grad():
        got = tree_logprobs(model, mbs)
    err = max_diff(got, hf_logprobs(checkpoints[arch], seqs))
    print(f"{arch}: tree vs HF max |dlogprob| = {err:.3g}")
    assert err < LOGPROB_TOL


def test_packed_index_rope_is_detected(checkpoints, forest):
    """Fails if the model goes back to rotating slot i as position i."""
    seqs, mbs = forest
    model = build_model(checkpoints["qwen3"], tree=True)[0].eval()
    want = hf_logprobs(checkpoints["qwen3"], seqs)
    with torch.no_grad():
        good = max_diff(tree_logprobs(model, mbs), want)
        assert isinstance(model.rotary_pos_emb, TreeRotaryEmbedding)
        model.rotary_pos_emb = model.rotary_pos_emb.inner  # upstream RoPE: packed index
        bad = max_diff(tree_logprobs(model, mbs), want)
    print(f"tree RoPE: {good:.3g}; packed-index RoPE: {bad:.3g}")
    assert good < LOGPROB_TOL
    assert bad > 1e-3


def test_mla_packed_index_rope_is_detected(checkpoints, forest):
    """Fails if multi-latent attention (DeepSeek-V3) goes back to rotating slot i as position i: its RoPE is
    computed inside each attention layer, not from the model's table."""
    seqs, mbs = forest
    model = build_model(checkpoints["deepseek_v3"], tree=True)[0].eval()
    want = hf_logprobs(checkpoints["deepseek_v3"], seqs)
    layers = [m for m in model.modules() if isinstance(m, MLASelfAttention)]
    assert len(layers) == 2 and all(isinstance(m.rotary_pos_emb, TreeRotaryEmbedding) for m in layers)
    with torch.no_grad():
        good = max_diff(tree_logprobs(model, mbs), want)
        for layer in layers:
            layer.rotary_pos_emb = layer.rotary_pos_emb.inner  # upstream: packed index
        bad = max_diff(tree_logprobs(model, mbs), want)
    print(f"MLA tree RoPE: {good:.3g}; packed-index RoPE: {bad:.3g}")
    assert good < LOGPROB_TOL
    assert bad > 1e-3
    with pytest.raises(ValueError, match="MLASelfAttention layer.s own RoPE rotates slot i as position i"):
        check_tree_model(model)


MLA_VARIANTS = {
    "rope_default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, max_position_embeddings=512),
    "no_q_lora": dict(q_lora_rank=None),
}


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_deepseek_v3_variants_match_hf(variant, tmp_path, cpu_megatron, forest):
    """DeepSeek-V3 without YaRN (plain RoPE) and without the low-rank query (DeepSeek-V2-Lite's q_proj)."""
    seqs, mbs = forest
    path = save_tiny_hf_checkpoint("deepseek_v3", tmp_path, **MLA_VARIANTS[variant])
    model = build_model(path, tree=True)[0].eval()
    with torch.no_grad():
        err = max_diff(tree_logprobs(model, mbs), hf_logprobs(path, seqs))
    print(f"deepseek_v3/{variant}: tree vs HF max |dlogprob| = {err:.3g}")
    assert err < LOGPROB_TOL


def test_multi_token_prediction_refused_at_build(tmp_path, cpu_megatron):
    path = save_hf_config("deepseek_v3", tmp_path, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=r"multi-token prediction.*extra_args=\{'mtp_num_layers': None\}"):
        build_tree_model(path, load_weights=False)
    _, chunks = build_tree_model(path, load_weights=False, extra_args={"mtp_num_layers": None})
    assert not chunks[0].mtp_process


def test_mimo_matches_hf_without_its_mtp_layers(checkpoints, forest, tmp_path):
    """MiMo (mbridge's ``mimo``: Qwen2 layers with multi-token prediction layers beside them) as its checkpoints
    ship it: a config class of its own (``configuration_mimo.py`` through ``auto_map``, read with
    ``trust_remote_code=True``; transformers has no ``mimo``). Its MTP layers are refused with the way out; built
    without them the tree model's log-probs equal HF's Qwen2 on the same weights (MiMo's main model), per sequence."""
    seqs, mbs = forest
    path = save_tiny_mimo_checkpoint(checkpoints["qwen2"], tmp_path / "mimo")
    with pytest.raises(ValueError, match="pass the argument `trust_remote_code=True`"):
        build_tree_model(path, load_weights=False)
    with pytest.raises(ValueError, match=r"multi-token prediction.*extra_args=\{'mtp_num_layers': None\}"):
        build_tree_model(path, load_weights=False, trust_remote_code=True)
    _, chunks = build_tree_model(path, trust_remote_code=True, extra_args={"mtp_num_layers": None})
    with torch.no_grad():
        err = max_diff(tree_logprobs(chunks[0].eval(), mbs), hf_logprobs(checkpoints["qwen2"], seqs))
    print(f"mimo: tree vs HF (Qwen2, same weights) max |dlogprob| = {err:.3g}")
    assert err < LOGPROB_TOL


def test_bf16_error_is_a_small_multiple_of_flat(checkpoints, forest):
    """bf16 tree log-probs are as close to fp32 HF as bf16 per-sequence runs are (k = 4)."""
    seqs, mbs = forest
    path = checkpoints["qwen3"]
    want = hf_logprobs(path, seqs)
    with torch.no_grad():
        tree_err = max_diff(tree_logprobs(build_model(path, tree=True, bf16=True)[0].eval(), mbs), want)
        flat_err = max_diff(flat_logprobs(build_model(path, tree=False, bf16=True)[0].eval(), seqs), want)
    print(f"bf16: tree {tree_err:.3g}, flat {flat_err:.3g}")
    assert tree_err <= 4 * flat_err


def test_tree_model_needs_position_ids(checkpoints, forest):
    _, mbs = forest
    model = build_model(checkpoints["qwen3"], tree=True)[0].eval()
    mb = mbs[0]
    with torch.no_grad(), pytest.raises(ValueError, match="position_ids=None"):
        model(mb.input_ids, None, mb.attention_mask)


GRAD_CASES = [("qwen3", "none"), ("qwen3", "full"), ("qwen3", "selective"), ("llama", "full"), ("qwen3_moe", "selective"),
              ("qwen3_moe", "full"), ("qwen2_moe", "none"), ("qwen2_moe", "full"),
              ("mixtral", "none"), ("mixtral", "full"), ("glm4_moe", "none"), ("glm4_moe", "full"),
              ("deepseek_v3", "none"), ("deepseek_v3", "full")]


@pytest.mark.parametrize("arch,recompute", GRAD_CASES)
def test_gradients_match_flat_per_sequence(arch, recompute, checkpoints, forest, monkeypatch):
    seqs, mbs = forest
    path = checkpoints[arch]
    tree = build_model(path, tree=True, recompute=recompute)[0].train()
    flat = build_model(path, tree=False)[0].train()

    builds = []  # backend-agnostic: every prepared-mask cache miss validates the mask once
    real = tree_attention_module.check_subtree_end_values
    monkeypatch.setattr(tree_attention_module, "check_subtree_end_values", lambda e: builds.append(1) or real(e))
    tree_attention_module.PREPARED_MASKS.clear()
    tree_lp, flat_lp = tree_and_flat_backward(tree, flat, seqs, mbs)
    # One prepared mask per micro-batch: shared by all layers and by the recomputation (the flat model prepares none).
    assert len(builds) == len(mbs)
    lp_err = max_diff(tree_lp, flat_lp)
    grad_err = relative_grad_error(param_grads(tree), param_grads(flat))
    print(f"{arch}/{recompute}: logprob {lp_err:.3g}, relative grad {grad_err:.3g}")
    assert lp_err < LOGPROB_TOL
    assert grad_err < GRAD_TOL


ANY_FOREST_ARCHS = ("qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5")
"""qk-norm and GQA; MoE (softmax top-k, router statistics weighted per sequence); multi-latent attention with YaRN;
Gated DeltaNet layers (conv window and recurrent state along each slot's root path) with a full attention layer."""

ANY_FOREST_GDN_TOL = (5e-5, 2e-4)
"""Qwen3.5's log-prob and gradient tolerances on any forest: its recurrent layers' fp32 rounding (the tree's scan and
each sequence's cut at other points) reached 9.1e-6 / 4.0e-5 over 100 draws (the fixed forests' ~1e-5, see
tests/mcore/test_gated_delta_net_parity.py)."""


@pytest.fixture(scope="module")
def model_pairs(checkpoints):
    """Per arch of :data:`ANY_FOREST_ARCHS` (built on first use): the tiny model as a tree model and as the upstream
    (flat) model, the same weights."""
    pairs = {}

    def get(arch):
        if arch not in pairs:
            pairs[arch] = (build_model(checkpoints[arch], tree=True)[0].train(),
                           build_model(checkpoints[arch], tree=False)[0].train())
        return pairs[arch]

    return get


ANY_FOREST_GRAD_TOL = 1e-4
"""Gradients on random tiny forests, relative per parameter against at least a tenth of the largest gradient
(:func:`relative_grad_error`, ``floor=0.1``): a forest of one repeated token adds every slot's gradient into one
embedding row and two norms' weights with cancellation, and the tree (shared slots once) and each sequence alone sum
in other orders: fp32 noise up to 1.3e-5 relative there (``[[1] * 9, [1] * 9]``), 2e-6 over 200 other draws; RoPE by
packed index instead of depth is 0.37 off or more on 43 of 100 draws."""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ANY_FOREST_ARCHS)
@settings(max_examples=10, deadline=None)
@given(seqs=any_batch, spare=st.integers(0, 12), algorithm=st.sampled_from(["ffd", "kk"]))
def test_any_forest_equals_each_sequence_alone(model_pairs, arch, seqs, spare, algorithm):
    """Any forest (GRPO prompts and samples, forking conversations, random token lists with accidental sharing and
    duplicates), packed into micro-batches of the longest sequence plus 0-12 slots (trees split at branch points where
    larger), through the schedule: log-probs and parameter gradients equal the upstream model run on each sequence
    alone (gradients: :data:`ANY_FOREST_GRAD_TOL`)."""
    tree, flat = model_pairs(arch)
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=max(map(len, seqs)) + spare, packing_algorithm=algorithm))
    with torch.no_grad():
        lp = dict(enumerate(tree_forward_only([tree], mbs)))
    want = flat_logprobs(flat, seqs)
    lp_err = max_diff(lp, want)
    weighted_sum(want).backward()
    grad_err = relative_grad_error(chunked_step(tree, mbs, seqs), param_grads(flat), floor=0.1)
    lp_tol, grad_tol = ANY_FOREST_GDN_TOL if arch == "qwen3_5" else (LOGPROB_TOL, ANY_FOREST_GRAD_TOL)
    assert lp_err < lp_tol and grad_err < grad_tol, (len(mbs), lp_err, grad_err)


# EP=2 checks log-probs only: expert-parallel backward needs CUDA buffers the CPU shim cannot
# map inside backward (see tests/scripts/parity_dist.py). DeepSeek-V3 (MLA) at TP=2: log-probs only, as megatron-core
# refuses to train an MoE under TP without sequence parallel, which needs the TE spec.
DIST_CASES = ["tp2:qwen3:full", "tp2:qwen2_swa:full", "tp2:qwen2_5_vl:full", "ep2:mixtral_swa:forward", "ep2:qwen3_moe:forward", "ep2:qwen2_moe:forward", "ep2:mixtral:forward",
              "ep2:glm4_moe:forward", "ep2:deepseek_v3:forward", "tp2:deepseek_v3:forward", "ep2:glm4v_moe:forward"]


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    """scripts/parity_dist.py's cases in one torchrun job (dist_utils.TorchrunCases)."""
    cases = {case: ("test_tensor_and_expert_parallel", 2, "scripts/parity_dist.py", ["{tmp}", case]) for case in DIST_CASES}
    return TorchrunCases(cases, tmp_path_factory.mktemp("parity_dist"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", DIST_CASES)
def test_tensor_and_expert_parallel(dist_runs, request, case):
    out = dist_runs.output(request, case)  # the script exits non-zero on a mismatch
    print(re.search(rf"{re.escape(case)} logprob=\S+ grad=\S+", out).group(0))


def test_patch_leaves_nothing_behind(checkpoints):
    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge

    from megatron_tree.mcore.bridge import patch_bridge_for_tree_training

    originals = (LLMBridge._get_transformer_layer_spec, Bridge.get_model)
    with patch_bridge_for_tree_training(enable=False):
        assert (LLMBridge._get_transformer_layer_spec, Bridge.get_model) == originals
    with patch_bridge_for_tree_training():
        assert (LLMBridge._get_transformer_layer_spec, Bridge.get_model) != originals
    assert (LLMBridge._get_transformer_layer_spec, Bridge.get_model) == originals
    flat = build_model(checkpoints["qwen3"], tree=False)[0]
    assert not any(isinstance(m, TreeCoreAttention) for m in flat.modules())
    assert not isinstance(flat.rotary_pos_emb, TreeRotaryEmbedding)
    tree = build_model(checkpoints["qwen3"], tree=True)[0]
    assert sum(isinstance(m, TreeCoreAttention) for m in tree.modules()) == 2


@pytest.mark.gpu  # the TE spec needs CUDA
def test_te_checkpoints_move_between_tree_and_upstream(checkpoints):
    """On the TE spec a tree model's state dict (torch and megatron dist checkpointing) has the
    upstream model's keys, TE's ``core_attention._extra_state`` included: strict loads both ways."""
    from megatron_tree.core.platform import have_transformer_engine

    if not have_transformer_engine():
        pytest.skip("needs Transformer Engine (the TE spec)")
    tree = build_model(checkpoints["qwen3"], tree=True)[0]
    flat = build_model(checkpoints["qwen3"], tree=False)[0]
    assert any(k.endswith("core_attention._extra_state") for k in flat.state_dict())
    assert tree.state_dict().keys() == flat.state_dict().keys()
    assert tree.sharded_state_dict().keys() == flat.sharded_state_dict().keys()
    tree.load_state_dict(flat.state_dict(), strict=True)
    flat.load_state_dict(tree.state_dict(), strict=True)

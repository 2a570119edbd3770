"""Gemma 3 text (``gemma3_text``) built by our mbridge bridge, tree-packed, against Hugging Face (CPU, fp32).

The tiny model (``save_tiny_hf_checkpoint("gemma3_text")``): 6 layers, every 3rd global (RoPE base 1M, linear
scaling 8), the others local (sliding window 4, RoPE base 10k), attention scale ``24 ** -0.5``, four perturbed
zero-centred norms per layer, q/k norms, tanh GeGLU, tied embeddings scaled by ``sqrt(hidden)``; and a 3-layer
variant at head dim 256. On :func:`branching_forest` (branches up to 12 tokens after a shared prompt, longer than
the window): tree log-probs vs HF per sequence, the upstream model vs HF, gradients of the tree vs the upstream
model per sequence (full recompute), chunks of trees larger than a micro-batch, weights exported as HF holds them;
and what the checks catch (one RoPE base for all layers, local RoPE by packed index, no window). The published Gemma 3
(``gemma3``, ``Gemma3ForConditionalGeneration``) builds its language model; InternVL is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from scripts.parity_common import (
    branching_forest,
    build_model,
    flat_logprobs,
    hf_logprobs,
    max_diff,
    micro_batches,
    param_grads,
    relative_grad_error,
    tree_and_flat_backward,
    tree_logprobs,
)

from megatron_tree import MicroBatchSpec, build_tree_model, check_tree_model, pack_trees, tree_forward_only
from megatron_tree.attention import PREPARED_MASKS
from megatron_tree.mcore.layer_rope import LayerRopeSelfAttention
from megatron_tree.mcore.rope import TreeRotaryEmbedding
from megatron_tree.runtime import save_hf_config, save_tiny_hf_checkpoint

TOL = 1e-5
CASES = {"gemma3": {}, "gemma3_hd256": dict(num_hidden_layers=3, head_dim=256, query_pre_attn_scalar=256)}
LOCAL = [True, True, False, True, True, False]  # the tiny model's layer_types: every 3rd layer global


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("tiny_gemma3")
    return {name: save_tiny_hf_checkpoint("gemma3_text", root / name, **overrides) for name, overrides in CASES.items()}


@pytest.fixture(scope="module")
def forest():
    seqs = branching_forest()
    return seqs, micro_batches(seqs)


def test_bridge_builds_gemma3_layers_and_exports_hf_weights(checkpoints):
    path = checkpoints["gemma3"]
    bridge, chunks = build_tree_model(path, wrap_with_ddp=False)
    model = chunks[0]
    attns = [layer.self_attention for layer in model.decoder.layers]
    assert [isinstance(a, LayerRopeSelfAttention) for a in attns] == LOCAL
    assert [a.core_attention.window for a in attns] == [4 if local else None for local in LOCAL]
    assert all(a.core_attention.softmax_scale == 24**-0.5 for a in attns)
    local_rope = attns[0].rotary_pos_emb
    assert isinstance(local_rope, TreeRotaryEmbedding) and isinstance(model.rotary_pos_emb, TreeRotaryEmbedding)
    dim = torch.arange(0, 16, 2, dtype=torch.float32) / 16
    torch.testing.assert_close(local_rope.inner.inv_freq, 1.0 / 10_000.0**dim, rtol=0, atol=0)
    torch.testing.assert_close(model.rotary_pos_emb.inner.inv_freq, 1.0 / 1_000_000.0**dim, rtol=0, atol=0)
    assert model.rotary_pos_emb.inner.seq_len_interpolation_factor == 8.0
    assert local_rope.inner.seq_len_interpolation_factor is None
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None
    hf = load_file(Path(path) / "model.safetensors")
    exported = dict(bridge.export_weights(chunks))
    assert exported.keys() == hf.keys()
    assert all(torch.equal(exported[k], hf[k]) for k in hf)


def test_published_gemma3_builds_its_language_model(tmp_path, forest, cpu_megatron):
    """A published Gemma 3 checkpoint (``gemma3``, 4B-27B: ``Gemma3ForConditionalGeneration``) builds its language
    model: tree log-probs vs HF's whole model run per sequence on text, the language model's tensors exported under the
    checkpoint's names (not the SigLIP tower's)."""
    seqs, mbs = forest
    path = save_tiny_hf_checkpoint("gemma3", tmp_path / "gemma3")
    bridge, chunks = build_tree_model(path, wrap_with_ddp=False)
    with torch.no_grad():
        err = max_diff(tree_logprobs(chunks[0].eval(), mbs), hf_logprobs(path, seqs))
    print(f"published gemma3: tree vs HF {err:.3g}")
    assert err < TOL
    hf = load_file(Path(path) / "model.safetensors")
    language = {k for k in hf if k.startswith("language_model.")}  # the published checkpoints' names
    assert language and any(k.startswith("vision_tower.") for k in hf)
    exported = dict(bridge.export_weights(chunks))
    assert exported.keys() == language and all(torch.equal(exported[k], hf[k]) for k in language)


def test_internvl_is_refused_in_one_line(cpu_megatron):
    from mbridge import AutoBridge
    from transformers import PretrainedConfig

    from megatron_tree.mcore.bridges import register_bridges

    class InternVLChatConfig(PretrainedConfig):  # InternVL checkpoints ship their config class (trust_remote_code)
        model_type = "internvl_chat"

    register_bridges()
    with pytest.raises(ValueError, match=r"InternVL \(model_type internvl_chat\) is not supported for tree training"):
        AutoBridge.from_config(InternVLChatConfig())


def test_transformer_engine_overrides_keep_the_tanh_geglu_unfused(checkpoints):
    """The TE overrides ask for ``bias_activation_fusion``, which megatron-core's config refuses for the tanh GeGLU
    (found on the GPU host): the bridge keeps it off instead of failing the build."""
    from mbridge import AutoBridge

    from megatron_tree.mcore.bridges import register_bridges

    register_bridges()
    bridge = AutoBridge.from_pretrained(checkpoints["gemma3"])
    bridge.set_extra_args(bias_activation_fusion=True, bias_dropout_fusion=True)
    assert bridge.config.bias_activation_fusion is False and bridge.config.bias_dropout_fusion is True


@pytest.mark.parametrize("name", sorted(CASES))
def test_tree_and_upstream_logprobs_match_hf(name, checkpoints, forest):
    seqs, mbs = forest
    path = checkpoints[name]
    want = hf_logprobs(path, seqs)
    tree = build_model(path, tree=True)[0].eval()
    with torch.no_grad():
        tree_err = max_diff(tree_logprobs(tree, mbs), want)
        flat_err = max_diff(flat_logprobs(build_model(path, tree=False)[0].eval(), seqs), want)
    print(f"{name}: tree vs HF {tree_err:.3g}, upstream vs HF {flat_err:.3g}")
    assert tree_err < TOL and flat_err < TOL


def test_checks_catch_wrong_rope_and_window(checkpoints, forest):
    """What the parity checks catch on this forest: each would pass unnoticed on chains shorter than the window."""
    seqs, mbs = forest
    path = checkpoints["gemma3"]
    want = hf_logprobs(path, seqs)
    tree = build_model(path, tree=True)[0].eval()
    local = [layer.self_attention for layer in tree.decoder.layers
             if isinstance(layer.self_attention, LayerRopeSelfAttention)]
    own = [attn.rotary_pos_emb.inner for attn in local]
    with torch.no_grad():
        for attn in local:  # one RoPE (the global layers': base 1M, linear scaling) for every layer
            attn.rotary_pos_emb.inner = tree.rotary_pos_emb.inner
        one_base = max_diff(tree_logprobs(tree, mbs), want)
        for attn, inner in zip(local, own):  # the local layers' own base, but by packed index instead of depth
            attn.rotary_pos_emb = inner
        packed = max_diff(tree_logprobs(tree, mbs), want)
        full = build_model(path, tree=True, extra_args={"window_size": None})[0].eval()
        no_window = max_diff(tree_logprobs(full, mbs), want)
    print(f"one RoPE base: {one_base:.3g}, local RoPE by packed index: {packed:.3g}, no window: {no_window:.3g}")
    assert one_base > 1e-2 and packed > 1e-2 and no_window > 1e-2
    with pytest.raises(ValueError, match="LayerRopeSelfAttention layer's own RoPE rotates slot i as position i"):
        check_tree_model(tree)


def test_gradients_match_upstream_per_sequence(checkpoints, forest):
    seqs, mbs = forest
    path = checkpoints["gemma3"]
    tree = build_model(path, tree=True, recompute="full")[0].train()
    flat = build_model(path, tree=False)[0].train()
    PREPARED_MASKS.clear()
    tree_lp, flat_lp = tree_and_flat_backward(tree, flat, seqs, mbs)
    lp_err = max_diff(tree_lp, flat_lp)
    grad_err = relative_grad_error(param_grads(tree), param_grads(flat))
    print(f"gemma3/full recompute: logprob {lp_err:.3g}, relative grad {grad_err:.3g}")
    assert lp_err < TOL and grad_err < TOL


def test_chunked_trees_match_hf(checkpoints, forest):
    """Trees larger than a micro-batch (8 slots): chunks read their ancestors' keys; local layers' own RoPE tables
    cover the context's depths too."""
    seqs, _ = forest
    path = checkpoints["gemma3"]
    chunks = build_model(path, tree=True)
    got = tree_forward_only(chunks, pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=8, chunk_trees=True)))
    err = max_diff(dict(enumerate(got)), hf_logprobs(path, seqs))
    print(f"gemma3 chunked (8-slot micro-batches) vs HF: {err:.3g}")
    assert err < TOL


@pytest.mark.parametrize("overrides,match", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 .megatron-core has no logit soft-capping"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True .tree attention is causal"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
])
def test_refuses_what_it_cannot_build(overrides, match, tmp_path, cpu_megatron):
    path = save_hf_config("gemma3_text", tmp_path / "cfg", **overrides)
    with pytest.raises(ValueError, match=f"gemma3_text: cannot build .*{match}"):
        build_tree_model(path, load_weights=False, wrap_with_ddp=False)

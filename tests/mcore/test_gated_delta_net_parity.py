"""Hybrid Gated DeltaNet models (Qwen3.5, Qwen3-Next) built by our mbridge bridges, on trees (CPU, fp32).

Archs: the text models ``qwen3_5`` and ``qwen3_next``, and the published multimodal checkpoints ``qwen3_5_vl``
(``qwen3_5``'s language model, weight for weight) and ``qwen3_5_moe`` (MoE in every layer), whose language model is
built (Hugging Face reference: ``…ForConditionalGeneration`` on text-only input ids).

- tree log-probs == Hugging Face run on each sequence alone (and so are the flat model's);
- gradients of a weighted sum of them == the flat model run on each sequence alone, recompute none / full /
  selective;
- ``export_weights`` gives back the checkpoint's tensors under its names (GDN in_proj / conv layouts, the gated
  q_proj, out_norm's ``w - 1``; of a multimodal checkpoint exactly its language model's), and a model that ignores
  the tree in its GDN layers is caught;
- TP=2, PP=2 and EP=2 over gloo (tests/scripts/gdn_parity_dist.py), and TP=2 on trees larger than a micro-batch
  (chunks carrying the recurrent states); context parallel is refused.

The forest (``recurrent_forest``) has siblings, strict prefixes, a branch at every depth of a chain and a
chain longer than one 64-token chunk of the scan.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from dist_utils import TorchrunCases
from scripts.parity_common import (
    build_model,
    flat_logprobs,
    hf_logprobs,
    hf_logprobs_fp64,
    max_diff,
    micro_batches,
    param_grads,
    recurrent_forest,
    relative_grad_error,
    tree_and_flat_backward,
    tree_logprobs,
)

from megatron_tree.mcore import bridge as bridge_module
from megatron_tree.mcore.gated_delta_net import TreeGatedDeltaNet
from megatron_tree.mcore.model_check import check_tree_model
from megatron_tree.runtime import save_tiny_hf_checkpoint, tiny_hf_config

ARCHS = ("qwen3_5", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe")
MULTIMODAL = ("qwen3_5_vl", "qwen3_5_moe")
TOL = 1e-5
NOISE = {"qwen3_5_moe": 4}
"""Log-prob tolerance factors. Qwen3.5-MoE's tiny model (an MoE in every layer) rounds further from the exact values
in fp32: at seed 0 its tree log-probs are 1.2e-5 off HF in fp64 (the flat model 9.0e-6, HF's fp32 run 6.6e-6)."""


EXACT64 = 1e-6
"""Tree vs flat model both in fp64 (the log-prob op stays fp32): measured 1.4e-7 - 2.0e-7 (qwen3_5_moe, seeds 0-3)."""
ROUNDING = 4
"""The tree's fp32 gradients vs the fp64 truth, at most this times the flat model's: qwen3_5_moe seeds 0-3 measured
6.1e-5 / 2.1e-5 (2.9x), 4.7e-5 / 5.7e-5, 1.5e-5 / 1.7e-5, 1.7e-5 / 1.4e-5: the same rounding, ahead by chance."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("tiny_gdn")
    return {arch: save_tiny_hf_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def forest():
    seqs = recurrent_forest()
    mbs = micro_batches(seqs, max_tokens=96)
    assert len(mbs) > 1 and max(len(s) for s in seqs) > 64
    return seqs, mbs


@pytest.fixture(scope="module")
def hf(checkpoints, forest):
    return {arch: hf_logprobs(path, forest[0]) for arch, path in checkpoints.items()}


@pytest.fixture(scope="module")
def hf64(checkpoints, forest):
    return {arch: hf_logprobs_fp64(path, forest[0]) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_and_flat_logprobs_match_hf(arch, checkpoints, forest, hf, hf64):
    """Against Hugging Face in fp64 (the values fp32 runs round) within 1e-5, as close as HF's own fp32 run is
    (~6e-6 on the 72-token sequences: the recurrent layers' fp32 rounding); against HF fp32, two such roundings."""
    seqs, mbs = forest
    tree = build_model(checkpoints[arch], tree=True)[0].eval()
    flat = build_model(checkpoints[arch], tree=False)[0].eval()
    assert sum(isinstance(m, TreeGatedDeltaNet) for m in tree.modules()) == 3
    check_tree_model(tree)
    with torch.no_grad():
        tree_lp, flat_lp = tree_logprobs(tree, mbs), flat_logprobs(flat, seqs)
    hf_err = max_diff(hf[arch], hf64[arch])
    tree_err, flat_err = max_diff(tree_lp, hf64[arch]), max_diff(flat_lp, hf64[arch])
    print(f"{arch}: vs HF fp64: tree {tree_err:.3g}, flat {flat_err:.3g}, HF fp32 {hf_err:.3g}; "
          f"tree vs HF fp32 {max_diff(tree_lp, hf[arch]):.3g}")
    tol = TOL * NOISE.get(arch, 1)
    assert tree_err < tol and flat_err < tol and hf_err < TOL
    assert max_diff(tree_lp, hf[arch]) < 2 * tol


GRAD_CASES = [(a, r) for a in ("qwen3_5", "qwen3_next") for r in ("none", "full", "selective")] + [("qwen3_5_moe", "full")]


@pytest.mark.parametrize("arch,recompute", GRAD_CASES)
def test_gradients_match_flat_per_sequence(arch, recompute, checkpoints, forest):
    seqs, mbs = forest
    tree = build_model(checkpoints[arch], tree=True, recompute=recompute)[0].train()
    flat = build_model(checkpoints[arch], tree=False)[0].train()
    tree_lp, flat_lp = tree_and_flat_backward(tree, flat, seqs, mbs)
    lp_err = max_diff(tree_lp, flat_lp)
    tree_grads, flat_grads = param_grads(tree), param_grads(flat)
    decay = {n for n in flat_grads if n.endswith(("self_attention.A_log", "self_attention.dt_bias"))}
    grad_err = relative_grad_error({n: tree_grads[n] for n in flat_grads.keys() - decay},
                                   {n: flat_grads[n] for n in flat_grads.keys() - decay})
    decay_err = relative_grad_error({n: tree_grads[n] for n in decay}, {n: flat_grads[n] for n in decay})
    print(f"{arch}/{recompute}: logprob {lp_err:.3g}, relative grad {grad_err:.3g}, A_log/dt_bias {decay_err:.3g}")
    assert lp_err < TOL * NOISE.get(arch, 1)
    # A_log / dt_bias: one number per head, summed over every slot's decay gradient (fp32 cancellation, whatever
    # the packing): 1.4e-5 measured on qwen3_next.
    if grad_err < TOL and decay_err < 3 * TOL:
        return
    # Further apart than fp32 rounding usually is (Qwen3.5-MoE's tiny model: 4.1e-5, layer 0's GDN through four
    # layers of backward): the same in fp64 must agree (the algorithm), and both fp32 runs round alike off it.
    tree64 = build_model(checkpoints[arch], tree=True, recompute=recompute)[0].double().train()
    flat64 = build_model(checkpoints[arch], tree=False)[0].double().train()
    tree_and_flat_backward(tree64, flat64, seqs, mbs)
    truth = param_grads(flat64)
    exact = relative_grad_error(param_grads(tree64), truth)
    tree_err, flat_err = (relative_grad_error(g, truth) for g in (tree_grads, flat_grads))
    print(f"{arch}/{recompute}: fp64 tree vs flat {exact:.3g}; fp32 vs fp64: tree {tree_err:.3g}, flat {flat_err:.3g}")
    assert exact < EXACT64 and tree_err < max(TOL, ROUNDING * flat_err)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_weights_gives_back_the_checkpoint(arch, checkpoints, tmp_path):
    """``export_weights`` (and, of a multimodal checkpoint, ``save_weights``: its config) give back exactly the
    checkpoint's tensors, of a multimodal one exactly its language model's."""
    import json

    from safetensors.torch import load_file

    path = checkpoints[arch]
    want = load_file(f"{path}/model.safetensors")
    vision = {k for k in want if k.startswith("model.visual.")}
    assert bool(vision) == (arch in MULTIMODAL)
    bridge, chunks = bridge_module.build_tree_model(path)
    got = dict(bridge.export_weights(chunks))
    assert got.keys() == want.keys() - vision, sorted(set(got) ^ (want.keys() - vision))
    assert [k for k in got if not torch.equal(got[k].cpu(), want[k])] == []
    if arch in MULTIMODAL:  # a saved copy builds the same bridge again
        bridge.save_weights(chunks, str(tmp_path))
        saved = load_file(tmp_path / "model.safetensors")
        assert saved.keys() == got.keys() and all(torch.equal(saved[k], want[k]) for k in saved)
        assert json.loads((tmp_path / "config.json").read_text())["model_type"] == bridge.multimodal_config.model_type


def test_published_checkpoint_builds_its_language_model(checkpoints, forest):
    """A ``qwen3_5`` checkpoint's model is its language model: the same log-probs, bit for bit, as the text
    checkpoint holding the same weights (``qwen3_5_vl`` vs ``qwen3_5``), and the same parameter names."""
    _, mbs = forest
    text = build_model(checkpoints["qwen3_5"], tree=True)[0].eval()
    wrapped = build_model(checkpoints["qwen3_5_vl"], tree=True)[0].eval()
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in text.named_parameters()]
    with torch.no_grad():
        want, got = tree_logprobs(text, mbs), tree_logprobs(wrapped, mbs)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_qwen3_5_moe_weight_names(cpu_megatron):
    """Qwen3.5-MoE's expert, router and shared-expert names: the text model's (``qwen3_5_moe_text``) and, under
    ``model.language_model.``, the published checkpoint's (``qwen3_5_moe``; ``lm_head`` unchanged)."""
    from mbridge import AutoBridge

    from megatron_tree.mcore.bridges import register_bridges

    register_bridges()
    config = tiny_hf_config("qwen3_5_moe")
    text = AutoBridge.from_config(config.text_config, dtype=torch.float32)
    wrapped = AutoBridge.from_config(config, dtype=torch.float32)
    layer = "model.layers.2.mlp"
    names = {
        "decoder.layers.2.mlp.experts.linear_fc1.weight3": [f"{layer}.experts.3.gate_proj.weight",
                                                            f"{layer}.experts.3.up_proj.weight"],
        "decoder.layers.2.mlp.experts.linear_fc2.weight3": [f"{layer}.experts.3.down_proj.weight"],
        "decoder.layers.2.mlp.router.weight": [f"{layer}.gate.weight"],
        "decoder.layers.2.mlp.shared_experts.gate_weight": [f"{layer}.shared_expert_gate.weight"],
        "decoder.layers.2.mlp.shared_experts.linear_fc2.weight": [f"{layer}.shared_expert.down_proj.weight"],
        "decoder.layers.2.pre_mlp_layernorm.weight": ["model.layers.2.post_attention_layernorm.weight"],
        "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
        "output_layer.weight": ["lm_head.weight"],
    }
    for mcore, hf in names.items():
        assert text._weight_name_mapping_mcore_to_hf(mcore) == hf
        assert wrapped._weight_name_mapping_mcore_to_hf(mcore) == [n.replace("model.", "model.language_model.")
                                                                   for n in hf]
    assert text.config.moe_layer_freq == [1] * 4 and text.config.moe_shared_expert_gate
    assert not text.config.moe_router_pre_softmax  # HF normalises the top-k probabilities


def test_multimodal_config_without_text_config_is_refused(cpu_megatron):
    from megatron_tree.mcore.bridges import Qwen35VLBridge

    with pytest.raises(ValueError, match="qwen3_5_text config has no text_config"):
        Qwen35VLBridge(tiny_hf_config("qwen3_5"), dtype=torch.float32)


def test_tree_blind_gated_delta_net_is_caught(checkpoints, forest, hf):
    """Fails if the GDN layers went back to packed order: each conv window and state must follow the root path."""
    _, mbs = forest
    model = build_model(checkpoints["qwen3_5"], tree=True)[0].eval()
    layers = [m for m in model.modules() if isinstance(m, TreeGatedDeltaNet)]
    forward = TreeGatedDeltaNet.forward
    for layer in layers:  # each row causal in packed order
        layer.forward = lambda h, attention_mask, *a, _f=forward, _m=layer, **k: _f(_m, h, None, *a, **k)
    with torch.no_grad():
        bad = max_diff(tree_logprobs(model, mbs), hf["qwen3_5"])
    print(f"GDN in packed order: {bad:.3g}")
    assert bad > 1e-3


def test_tree_mask_of_another_length_is_refused(checkpoints):
    """The mask must cover the hidden states' slots (behind a chunk's context, which a plain call has none of)."""
    model = build_model(checkpoints["qwen3_5"], tree=True)[0]
    layer = next(m for m in model.modules() if isinstance(m, TreeGatedDeltaNet))
    hidden = torch.zeros(5, 1, model.config.hidden_size)
    with pytest.raises(ValueError, match=r"must be \[1, C \+ s\] = \[1, 5\] \(C = 0 context slots of a chunk\).*"
                                         r"got mask \(1, 4\)"):
        layer(hidden, torch.arange(1, 5, dtype=torch.int32)[None])


def test_megatron_gated_delta_net_is_refused(checkpoints):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    model = build_model(checkpoints["qwen3_5"], tree=True)[0]
    next(m for m in model.modules() if isinstance(m, TreeGatedDeltaNet)).__class__ = GatedDeltaNet
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention' is megatron\.core\.ssm.*packed order"):
        check_tree_model(model)


def test_tree_layer_spec_swaps_megatron_gated_delta_net(checkpoints):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_tree import tree_layer_spec
    from megatron_tree.mcore.hybrid_spec import hybrid_block_spec

    bridge = bridge_module.build_tree_model(checkpoints["qwen3_5"], load_weights=False)[0]
    block = hybrid_block_spec(bridge.config, use_transformer_engine=False)
    def upstream_layer(layer):
        attn = layer.submodules.self_attention
        if attn.module is not TreeGatedDeltaNet:
            return layer
        attn = dataclasses.replace(attn, module=GatedDeltaNet)
        return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))

    upstream = dataclasses.replace(block, layer_specs=[upstream_layer(layer) for layer in block.layer_specs])
    converted = tree_layer_spec(upstream, config=bridge.config)
    mixers = [layer.submodules.self_attention.module.__name__ for layer in converted.layer_specs]
    assert mixers == ["TreeGatedDeltaNet"] * 3 + ["SelfAttention"]


def test_context_parallel_is_refused(cpu_megatron):
    from mbridge import AutoBridge
    from mbridge.core.parallel_states import ParallelStates

    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.mcore.bridges import register_bridges

    register_bridges()
    states = dataclasses.replace(ParallelStates.get_default_parallel_states(), cp_size=2)
    refusal = "context parallel size 2.*use context_parallel_size=1"
    with apply_compat_patches(), pytest.raises(ValueError, match=refusal):
        AutoBridge.from_config(tiny_hf_config("qwen3_5"), dtype=torch.float32, parallel_states=states)


DIST_CASES = ["tp2:qwen3_5:full", "tp2:qwen3_5:selective", "tp2:qwen3_5:chunks", "ep2:qwen3_next:forward",
              "pp2:qwen3_5:full", "pp2:qwen3_next:none"]


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    cases = {case: ("test_parallel_layouts", 2, "scripts/gdn_parity_dist.py", ["{tmp}", case]) for case in DIST_CASES}
    return TorchrunCases(cases, tmp_path_factory.mktemp("gdn_dist"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", DIST_CASES)
def test_parallel_layouts(dist_runs, request, case):
    out = dist_runs.output(request, case)  # the script exits non-zero on a mismatch
    print(re.search(rf"{re.escape(case)} logprob=\S+ grad=\S+", out).group(0))

"""Sliding-window families built by mbridge, tree-packed, against Hugging Face (CPU, fp32).

Qwen2 with ``use_sliding_window`` and ``max_window_layers`` (one full, one sliding layer), Qwen3 (every layer
sliding) and Mixtral (``sliding_window``), windows of 4-5 tokens on :func:`branching_forest` (branches up to 12
tokens after a shared prompt): tree log-probs vs HF per sequence, the upstream model (mbridge + the compat fix
:func:`megatron_tree.compat.mbridge.hf_sliding_window`) vs HF, and gradients of the tree vs the upstream model
per sequence with recompute.
"""

from __future__ import annotations

import pytest
import torch
from scripts.parity_common import (
    SLIDING_WINDOW_CASES,
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

from megatron_tree.attention import PREPARED_MASKS
from megatron_tree.compat.mbridge import hf_window_args
from megatron_tree.runtime import save_tiny_hf_checkpoint, tiny_hf_config

TOL = 1e-5
LAYER_WINDOWS = {"qwen2_swa": [None, 4], "qwen3_swa": [5, 5], "mixtral_swa": [4, 4]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("tiny_swa")
    return {name: save_tiny_hf_checkpoint(arch, root / name, **overrides)
            for name, (arch, overrides) in SLIDING_WINDOW_CASES.items()}


@pytest.fixture(scope="module")
def forest():
    seqs = branching_forest()
    return seqs, micro_batches(seqs)


def test_hf_window_args_follow_hf_layer_types():
    qwen2 = tiny_hf_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert hf_window_args(qwen2) == {"window_size": (3, 0), "window_attn_skip_freq": [0, 1]}
    assert hf_window_args(tiny_hf_config("qwen2", sliding_window=4)) == {}  # use_sliding_window=False
    assert hf_window_args(tiny_hf_config("qwen2", use_sliding_window=True, max_window_layers=2)) == {}  # no layer slides
    assert hf_window_args(tiny_hf_config("mixtral", sliding_window=7)) == {"window_size": (6, 0), "window_attn_skip_freq": None}
    assert hf_window_args(tiny_hf_config("llama")) == {}
    odd = tiny_hf_config("qwen2", use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(ValueError, match=r"layer_types has \[.chunked_attention.\]"):
        hf_window_args(odd)
    with pytest.raises(ValueError, match=r"sliding_window=-3: a sliding window is a number of tokens, an int >= 1"):
        hf_window_args(tiny_hf_config("mixtral", sliding_window=-3))


@pytest.mark.parametrize("name", sorted(SLIDING_WINDOW_CASES))
def test_tree_and_upstream_logprobs_match_hf(name, checkpoints, forest):
    seqs, mbs = forest
    path = checkpoints[name]
    want = hf_logprobs(path, seqs)
    tree = build_model(path, tree=True)[0].eval()
    assert [layer.self_attention.core_attention.window for layer in tree.decoder.layers] == LAYER_WINDOWS[name]
    with torch.no_grad():
        tree_err = max_diff(tree_logprobs(tree, mbs), want)
        flat_err = max_diff(flat_logprobs(build_model(path, tree=False)[0].eval(), seqs), want)
        # what mbridge builds without the compat fix: full attention in every layer
        unfixed = build_model(path, tree=False, extra_args={"window_size": None})[0].eval()
        unfixed_err = max_diff(flat_logprobs(unfixed, seqs), want)
    print(f"{name}: tree vs HF {tree_err:.3g}, upstream vs HF {flat_err:.3g} (without the window: {unfixed_err:.3g})")
    assert tree_err < TOL and flat_err < TOL
    assert unfixed_err > 1e-2  # the window matters on this forest


@pytest.mark.parametrize("name,recompute", [("qwen2_swa", "full"), ("qwen2_swa", "selective"), ("qwen3_swa", "none"),
                                            ("mixtral_swa", "full")])
def test_gradients_match_upstream_per_sequence(name, recompute, checkpoints, forest):
    seqs, mbs = forest
    path = checkpoints[name]
    tree = build_model(path, tree=True, recompute=recompute)[0].train()
    flat = build_model(path, tree=False)[0].train()
    PREPARED_MASKS.clear()
    tree_lp, flat_lp = tree_and_flat_backward(tree, flat, seqs, mbs)
    lp_err = max_diff(tree_lp, flat_lp)
    grad_err = relative_grad_error(param_grads(tree), param_grads(flat))
    print(f"{name}/{recompute}: logprob {lp_err:.3g}, relative grad {grad_err:.3g}")
    assert lp_err < TOL and grad_err < TOL

"""Vision-language models built by our mbridge bridges, image prompts tree-packed, against Hugging Face (CPU, fp32).

The tiny models (``save_tiny_hf_checkpoint(arch)``), the same special tokens: Qwen2.5-VL (``qwen2_5_vl``: Qwen2
layers with mRoPE sections (2, 3, 3), a two-block vision tower (windowed, then full) merging 2 x 2 patches) and
GLM-4V (``glm4v``: GLM-4 layers with four norms each, interleaved mRoPE sections (1, 1, 2) on half of each head, a
two-block vision tower with interpolated position embeddings merging 2 x 2 patches by a convolution). The forest:
GRPO-like samples of image prompts, short branches laid out before long ones; two different images of one grid (the same placeholder ids) under the same text;
an image under two different text prefixes; a prompt with text before its image and a wide image; a sequence with two
images. Tree log-probs vs HF per sequence, gradients (vision tower included) vs each sequence alone, and what the
check catches (depths instead of (t, h, w) positions); on a GPU (``-m gpu``) the same checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import gpu_env
from safetensors.torch import load_file
from scripts.parity_common import (
    IMG,
    VOCAB,
    branching_forest,
    build_model,
    hf_logprobs,
    hf_vision_logprobs,
    max_diff,
    micro_batches,
    param_grads,
    relative_grad_error,
    tree_and_alone_backward,
    tree_logprobs,
    vision_forest,
    vision_micro_batches,
)

from megatron_tree import MicroBatchSpec, build_tree_model, pack_vision_trees, tree_forward_only
from megatron_tree.mcore.vision_language import InterleavedMultimodalRotaryEmbedding, VisionLanguageModel
from megatron_tree.runtime import save_tiny_hf_checkpoint, tiny_hf_config

TOL = 1e-5


MROPE_SECTION = {"qwen2_5_vl": [2, 3, 3], "glm4v": [1, 1, 2], "glm4v_moe": [1, 1, 2]}


@pytest.fixture(scope="module", params=sorted(MROPE_SECTION))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, tmp_path_factory, cpu_megatron):
    return save_tiny_hf_checkpoint(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))


@pytest.fixture(scope="module")
def forest():
    seqs, images = vision_forest()
    return seqs, images, vision_micro_batches(seqs, images)


def test_packing_shares_equal_images_only(forest):
    seqs, images, mbs = forest
    assert max(s for s in seqs for s in s) < VOCAB
    held = sum(mb.num_tokens for mb in mbs)
    assert held < sum(map(len, seqs))
    for mb in mbs:  # every image slot holds the placeholder; each unique image once per micro-batch
        assert (mb.input_ids[0, mb.image_slots] == IMG).all()
        assert int((mb.input_ids[0, : mb.num_tokens] == IMG).sum()) == mb.image_slots.numel()
        assert mb.image_grid_thw.shape[0] == len({img.key() for i in mb.sequence_ids for img in images[i]})


def test_bridge_builds_vision_language_model_and_exports_hf_weights(arch, checkpoint):
    bridge, chunks = build_tree_model(checkpoint, wrap_with_ddp=False)
    model = chunks[0]
    assert isinstance(model, VisionLanguageModel) and model.position_embedding_type == "mrope"
    assert model.config.mrope_section == MROPE_SECTION[arch]
    hf = load_file(Path(checkpoint) / "model.safetensors")
    exported = dict(bridge.export_weights(chunks))
    assert exported.keys() == hf.keys()
    assert all(torch.equal(exported[k], hf[k]) for k in hf)
    video = {"qwen2_5_vl": "video_token_id"}.get(arch, "video_start_token_id")  # GLM-4V(-MoE): frames of image tokens
    args = bridge.packing_args()
    assert args == dict(image_token_id=IMG, spatial_merge_size=2,
                        video_token_id=getattr(bridge.multimodal_config, video))
    with pytest.raises(ValueError, match="video inputs are not supported"):
        pack_vision_trees([[1, args["video_token_id"], IMG, 2]], [[]], MicroBatchSpec(max_tokens_per_mb=64), **args)


def test_interleaved_mrope_is_hf_glm4v_rope(cpu_megatron):
    """GLM-4V's RoPE: frequency i from t, h or w by mrope_section, rotating channels 2i and 2i + 1 (HF's cos / sin)."""
    from transformers.models.glm4v.modeling_glm4v import Glm4vTextRotaryEmbedding

    config = tiny_hf_config("glm4v").text_config
    positions = torch.randint(0, 40, (3, 1, 24), generator=torch.Generator().manual_seed(0))
    ours = InterleavedMultimodalRotaryEmbedding(kv_channels=16, rotary_percent=0.5, rotary_base=10_000)
    angles = ours(positions, MROPE_SECTION["glm4v"])[:, 0, 0]
    cos, sin = Glm4vTextRotaryEmbedding(config)(torch.zeros(1), positions)
    torch.testing.assert_close(angles.cos(), cos[0])
    torch.testing.assert_close(angles.sin(), sin[0])
    with pytest.raises(ValueError, match="must be three ints summing to the 4 rotated frequencies"):
        ours(positions, [2, 2, 2])


def test_a_checkpoint_whose_mrope_section_does_not_fit_its_head_is_refused(tmp_path, cpu_megatron):
    import json

    path = save_tiny_hf_checkpoint("qwen2_5_vl", tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 4]  # head dim 16: 8 frequencies, not 9
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mrope_section=\[2, 3, 4\] must be three ints summing to the rotated "
                                         r"frequencies per head, 8 \(head_dim 16 x partial_rotary_factor 1.0 / 2\)"):
        build_tree_model(path, wrap_with_ddp=False)


def test_tree_logprobs_match_hf_and_depths_do_not(arch, checkpoint, forest):
    seqs, images, mbs = forest
    want = hf_vision_logprobs(checkpoint, seqs, images)
    model = build_model(checkpoint, tree=True)[0].eval()
    with torch.no_grad():
        tree_err = max_diff(tree_logprobs(model, mbs), want)
        schedule_err = max_diff(dict(enumerate(tree_forward_only([model], mbs))), want)
        depth_mbs = [mb.__class__(**{**vars(mb), "mrope_position_ids": mb.position_ids.expand(3, 1, -1)})
                     for mb in mbs]
        depth_err = max_diff(tree_logprobs(model, depth_mbs), want)
    print(f"{arch}: tree vs HF {tree_err:.3g} (through tree_forward_only {schedule_err:.3g}); depths instead of "
          f"(t, h, w) positions {depth_err:.3g}")
    assert tree_err < TOL and schedule_err < TOL and depth_err > 1e-2
    mb = mbs[0]
    with pytest.raises(ValueError, match=r"with images rotates by \(t, h, w\) positions \[3, b, S\]"):
        model(mb.input_ids, mb.position_ids, mb.attention_mask, **{**mb.model_inputs(), "mrope_position_ids": None})


def test_text_only_trees_match_hf(arch, checkpoint):
    """Plain tree micro-batches (depths): a text token's (t, h, w) position is (d, d, d)."""
    seqs = branching_forest()
    model = build_model(checkpoint, tree=True)[0].eval()
    with torch.no_grad():
        err = max_diff(dict(enumerate(tree_forward_only([model], micro_batches(seqs)))), hf_logprobs(checkpoint, seqs))
    print(f"{arch} text only: tree vs HF {err:.3g}")
    assert err < TOL


def test_gradients_match_each_sequence_alone(arch, checkpoint, forest):
    """Tree backward (one micro-batch at a time) vs each sequence alone as its own micro-batch, same model: every
    parameter, the vision tower's included."""
    seqs, images, mbs = forest
    model = build_model(checkpoint, tree=True)[0].train()
    tree_grads, tree_lp, alone = tree_and_alone_backward(model, seqs, images, mbs)
    lp_err = max_diff(tree_lp, alone)
    grads = param_grads(model)
    assert any(n.startswith("visual.") for n in grads)
    grad_err = relative_grad_error(tree_grads, grads)
    print(f"{arch}: logprob {lp_err:.3g}, relative grad {grad_err:.3g}")
    assert lp_err < TOL and grad_err < TOL


@pytest.mark.gpu
def test_gpu_vision_trees_match_hf_and_each_sequence_alone(arch, request):
    """The same checks on a GPU (fp32, TF32 off), its kernels and Transformer Engine's spec where TE runs; Hugging
    Face's reference on the CPU. TE's fp32 GEMMs use TF32 unless ``NVIDIA_TF32_OVERRIDE=0`` is set before cuBLAS
    loads (torch's flags do not reach them: 1.7e-3 off HF on an H100 without it), so a process started without it
    (the README's test command) runs this test again in a pytest of its own that starts with it."""
    if os.environ.get("NVIDIA_TF32_OVERRIDE") != "0":
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", request.node.nodeid],
            env=gpu_env(NVIDIA_TF32_OVERRIDE="0", MEGATRON_TREE_GPU_PASS="1"), cwd=request.config.rootpath,
            capture_output=True, text=True, timeout=600)
        print("\n".join(line for line in proc.stdout.splitlines() if " on " in line and "tree vs HF" in line))
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
        return
    checkpoint, forest = (request.getfixturevalue(name) for name in ("checkpoint", "forest"))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    seqs, images, mbs = forest
    model = build_model(checkpoint, tree=True)[0]
    assert next(model.parameters()).is_cuda
    with torch.no_grad():
        err = max_diff(tree_logprobs(model.eval(), mbs), hf_vision_logprobs(checkpoint, seqs, images))
    tree_grads, tree_lp, alone = tree_and_alone_backward(model.train(), seqs, images, mbs)
    grad_err = relative_grad_error(tree_grads, param_grads(model))
    print(f"{arch} on {torch.cuda.get_device_name()}: tree vs HF {err:.3g}; vs alone logprob "
          f"{max_diff(tree_lp, alone):.3g}, relative grad {grad_err:.3g}")
    assert err < TOL and grad_err < TOL

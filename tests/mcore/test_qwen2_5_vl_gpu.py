"""On a GPU (fp32, TF32 off: ``NVIDIA_TF32_OVERRIDE=0``): Qwen2.5-VL image prompts on trees, with the GPU's kernels
and Transformer Engine's spec where TE runs: tree log-probs vs Hugging Face per sequence (on the CPU) and gradients,
vision tower included, vs each sequence alone (``tests/mcore/test_qwen2_5_vl_parity.py`` on the CPU)."""

from __future__ import annotations

import pytest
import torch
from scripts.parity_common import (
    build_model,
    hf_vision_logprobs,
    max_diff,
    param_grads,
    relative_grad_error,
    tree_and_alone_backward,
    tree_logprobs,
    vision_forest,
    vision_micro_batches,
)

from megatron_tree.compat import apply_compat_patches
from megatron_tree.runtime import destroy_distributed, init_cpu_distributed, save_tiny_hf_checkpoint

pytestmark = pytest.mark.gpu  # needs CUDA

TOL = 1e-5


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    """The tiny Qwen2.5-VL checkpoint, with one process's parallel state and the compat patches, CUDA visible."""
    with apply_compat_patches():
        init_cpu_distributed(tp=1)
        yield save_tiny_hf_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("tiny_hf") / "qwen2_5_vl")
        destroy_distributed()


def test_gpu_vision_trees_match_hf_and_each_sequence_alone(gpu_checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    seqs, images = vision_forest()
    mbs = vision_micro_batches(seqs, images)
    model = build_model(gpu_checkpoint, tree=True)[0]
    assert next(model.parameters()).is_cuda
    with torch.no_grad():
        err = max_diff(tree_logprobs(model.eval(), mbs), hf_vision_logprobs(gpu_checkpoint, seqs, images))
    tree_grads, tree_lp, alone = tree_and_alone_backward(model.train(), seqs, images, mbs)
    grad_err = relative_grad_error(tree_grads, param_grads(model))
    print(f"qwen2_5_vl on {torch.cuda.get_device_name()}: tree vs HF {err:.3g}; vs alone logprob "
          f"{max_diff(tree_lp, alone):.3g}, relative grad {grad_err:.3g}")
    assert err < TOL and grad_err < TOL

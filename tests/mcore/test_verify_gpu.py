"""On a GPU: the upstream model's attention is named (Transformer Engine's ``TEDotProductAttention``
where TE runs) and ``verify_tree_model`` passes the tree model, fp32 and bf16, on the GPU's kernels."""

from __future__ import annotations

import pytest

from megatron_tree.compat import apply_compat_patches
from megatron_tree.core.platform import have_transformer_engine
from megatron_tree.mcore.bridge import build_model
from megatron_tree.mcore.model_check import check_tree_model
from megatron_tree.mcore.verify import verify_tree_model
from megatron_tree.runtime import destroy_distributed, init_cpu_distributed, save_tiny_hf_checkpoint

pytestmark = pytest.mark.gpu  # needs CUDA (Transformer Engine spec, GPU kernels)


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    """A tiny Qwen3 checkpoint, with one process's parallel state and the compat patches, CUDA visible."""
    with apply_compat_patches():
        init_cpu_distributed(tp=1)
        yield save_tiny_hf_checkpoint("qwen3", tmp_path_factory.mktemp("tiny_hf") / "qwen3")
        destroy_distributed()


def build(path, *, tree: bool = True, bf16: bool = False):
    return build_model(path, tree=tree, bf16=bf16, wrap_with_ddp=False)[1][0]


def test_gpu_upstream_model_is_named_and_tree_model_verifies(gpu_checkpoint):
    upstream = build(gpu_checkpoint, tree=False)
    core = upstream.decoder.layers[0].self_attention.core_attention
    assert next(upstream.parameters()).is_cuda
    with pytest.raises(ValueError) as e:
        check_tree_model(upstream)
    print(e.value)
    assert f"'decoder.layers.0.self_attention.core_attention' is {type(core).__module__}.{type(core).__qualname__}" in str(e.value)
    if have_transformer_engine():  # mbridge builds the TE spec whenever TE runs
        assert "TEDotProductAttention" in str(e.value)
    for bf16 in (False, True):
        print(verify_tree_model(build(gpu_checkpoint, bf16=bf16)))

"""The 0.1 names keep working for a release, each with a DeprecationWarning naming the new one."""

import importlib
import sys

import numpy as np
import pytest

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_import_as_the_new_modules(old):
    if MOVED[old].endswith("fa4_kernels"):
        pytest.importorskip("cutlass", reason="the FA4 kernels need flash-attn-4's CuTe DSL")
    sys.modules.pop(old, None)
    with pytest.deprecated_call(match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_old_names_in_moved_namespaces():
    import megatron_tree.attention
    import megatron_tree.testing
    from megatron_tree.mcore.core_attention import TreeCoreAttention
    from megatron_tree.runtime import cpu_mode

    with pytest.deprecated_call(match="megatron_tree.testing.cpu_mode moved to megatron_tree.runtime.cpu_mode"):
        assert megatron_tree.testing.cpu_mode is cpu_mode
    with pytest.deprecated_call(match="moved to megatron_tree.mcore.core_attention.TreeCoreAttention"):
        assert megatron_tree.attention.TreeCoreAttention is TreeCoreAttention


def test_micro_batch_cu_seqlens_is_cu_targets():
    mb = pack_trees([np.array([1, 2, 3]), np.array([1, 2, 4, 5])], MicroBatchSpec(max_tokens_per_mb=16))[0]
    assert mb.cu_targets.tolist() == [0, 2, 5]
    with pytest.deprecated_call(match="cu_seqlens is now TreeMicroBatch.cu_targets"):
        assert mb.cu_seqlens is mb.cu_targets


def test_build_tree_model_tree_false_is_build_flat_model(cpu_megatron, tmp_path):
    from megatron_tree import build_tree_model, save_tiny_hf_checkpoint
    from megatron_tree.mcore.model_check import check_tree_model

    path = save_tiny_hf_checkpoint("qwen3", tmp_path / "qwen3")
    with pytest.deprecated_call(match=r"build_tree_model\(tree=False\) is now build_flat_model"):
        _, chunks = build_tree_model(path, tree=False, wrap_with_ddp=False)
    with pytest.raises(ValueError, match="DotProductAttention"):  # the upstream model, as before
        check_tree_model(chunks)

"""build_tree_model / build_flat_model: a mistyped local checkpoint path is named, not sent to the Hub as a repo
id; a tree-only keyword given to the flat build is refused."""

import pytest

pytest.importorskip("mbridge")

from megatron_tree.mcore.bridge import build_flat_model, build_tree_model  # noqa: E402


@pytest.mark.parametrize("build", [build_tree_model, build_flat_model])
@pytest.mark.parametrize("path", ["/nonexistent/qwen3", "./no_such_dir"])
def test_missing_local_checkpoint_is_named(build, path):
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint directory"):
        build(path)


def test_flat_model_takes_no_attention_backend():
    with pytest.raises(TypeError, match="backend= is build_tree_model's"):
        build_flat_model("/nonexistent/qwen3", backend="flex")

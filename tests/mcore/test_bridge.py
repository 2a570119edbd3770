"""build_tree_model: a mistyped local checkpoint path is named, not sent to the Hub as a repo id."""

import pytest

pytest.importorskip("mbridge")

from megatron_tree.mcore.bridge import build_tree_model  # noqa: E402


@pytest.mark.parametrize("path", ["/nonexistent/qwen3", "./no_such_dir"])
def test_missing_local_checkpoint_is_named(path):
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint directory"):
        build_tree_model(path)

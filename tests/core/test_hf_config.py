"""attention_head_dim: a config's own head_dim where it sets one (it need not be hidden / heads), else hidden / heads;
attention_kv_heads: num_key_value_heads where set, else the query heads."""

from megatron_tree.core.hf_config import attention_head_dim, attention_kv_heads
from megatron_tree.runtime.tiny_models import tiny_hf_config


def test_head_dim_set_or_derived():
    assert attention_head_dim(tiny_hf_config("qwen3", head_dim=32)) == 32  # hidden 64 / 4 heads would say 16
    qwen2 = tiny_hf_config("qwen2")
    assert getattr(qwen2, "head_dim", None) is None
    assert attention_head_dim(qwen2) == qwen2.hidden_size // qwen2.num_attention_heads


def test_kv_heads_set_or_the_query_heads():
    assert attention_kv_heads(tiny_hf_config("qwen3", num_attention_heads=4, num_key_value_heads=2)) == 2
    mha = tiny_hf_config("qwen3", num_attention_heads=4, num_key_value_heads=None)
    assert attention_kv_heads(mha) == 4

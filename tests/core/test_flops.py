"""Model FLOPs: the per-token / per-pair counts of a model, the work a packing computes, the launcher's per-step sum."""

import numpy as np
import pytest
from transformers import Qwen3Config, Qwen3MoeConfig

from megatron_tree import MicroBatchSpec, build_forest, pack_trees
from megatron_tree.core.flops import ModelFlops, micro_batch_work, packed_work
from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch
from megatron_tree.core.tree import as_sequences
from megatron_tree.train.trainer import update_flops


def test_a_dense_model_by_hand():
    cfg = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    f = ModelFlops.of(cfg)
    attention = 64 * 4 * 32 + 2 * 64 * 2 * 32 + 4 * 32 * 64  # q, k and v, output projections
    mlp = 3 * 64 * 160  # gate, up, down
    assert f.per_token == 2 * 3 * (attention + mlp)
    assert f.per_pair == 2 * 3 * 4 * (32 + 32)  # QK^T and PV per query head and layer
    assert f.output_per_token == 2 * 64 * 1000 and f.value_head_per_token == 2 * 64
    assert f.forward(10, 55) == (f.per_token + f.output_per_token) * 10 + f.per_pair * 55
    assert f.forward(10, 55, value_head=True) == (f.per_token + 2 * 64) * 10 + f.per_pair * 55


def test_a_multimodal_config_counts_its_language_model_and_other_objects_are_refused():
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2)
    vl = Qwen2_5_VLConfig(text_config=text)
    assert ModelFlops.of(vl) == ModelFlops.of(vl.get_text_config()) and ModelFlops.of(vl).output_per_token == 2 * 64 * 1000
    with pytest.raises(TypeError, match="takes a Hugging Face model config.*got dict"):
        ModelFlops.of(text)


def test_moe_counts_the_chosen_experts_and_the_router():
    kw = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, moe_intermediate_size=24, num_experts=8)
    top2, top4 = (ModelFlops.of(Qwen3MoeConfig(**kw, num_experts_per_tok=k)) for k in (2, 4))
    assert top4.per_token - top2.per_token == 2 * 2 * 2 * 3 * 32 * 24  # 2 layers x 2 more experts x 3 matrices
    dense_first = ModelFlops.of(Qwen3MoeConfig(**kw, num_experts_per_tok=2, mlp_only_layers=[0], intermediate_size=40))
    assert top2.per_token - dense_first.per_token == 2 * (2 * 3 * 32 * 24 + 32 * 8 - 3 * 32 * 40)


@pytest.mark.parametrize("chunk", [False, True])
def test_a_packing_computes_each_unique_token_and_its_root_path_once(chunk):
    """Tokens: the forest's unique tokens; pairs: each token attends to its root path (depth + 1 keys), whether the
    trees are whole or cut into chunks that read their ancestors' keys as context."""
    rng = np.random.default_rng(0)
    seqs = grpo_batch(rng, n_prompts=3, samples=(2, 4), prompt_len=(20, 60), response_len=(5, 30), vocab=50)
    seqs += multi_turn_batch(rng, n_conversations=2, turns=(3, 5), turn_len=(5, 20), fork_prob=0.5, system_len=15,
                             vocab=50)
    forest = build_forest(as_sequences(seqs))
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=48 if chunk else 512, chunk_trees=chunk))
    assert any(mb.chunk is not None for mb in mbs) == chunk
    assert packed_work(mbs) == (forest.num_tokens, int((forest.depth + 1).sum()))
    assert sum(micro_batch_work(mb)[0] for mb in mbs) == forest.num_tokens


def test_flat_chains_compute_every_sequence_causally():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [7]]
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=64), share_prefixes=False)
    assert packed_work(mbs) == (10, 4 * 5 // 2 + 5 * 6 // 2 + 1)


def test_the_launcher_counts_every_pass_of_a_step():
    f = ModelFlops(per_token=10.0, per_pair=1.0, output_per_token=5.0, value_head_per_token=0.5)
    reward = Qwen3Config(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=2)
    part = {"work": (100, 1000), "forward_work": (100, 1000)}
    actor, critic = 15 * 100 + 1000, 10.5 * 100 + 1000  # one forward each
    assert update_flops(f, None, {"work": (100, 1000)}, True) == 3 * actor
    assert update_flops(f, None, part, True) == 4 * actor  # grpo: the old log-probs first
    assert update_flops(f, None, part, False) == 3 * actor  # a later epoch reuses them
    scores = ModelFlops.of(reward).forward(100, 1000, value_head=True)
    assert update_flops(f, ModelFlops.of(reward), part, True) == 3 * actor + 3 * critic + 2 * actor + critic + scores
    assert update_flops(f, ModelFlops.of(reward), part, False) == 3 * actor + 3 * critic

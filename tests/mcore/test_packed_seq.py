"""thd_packed_seq_params: a flat micro-batch as Megatron's packed THD sequences (segments in slot
order, padding as its own segment); micro-batches that share prefixes are refused."""

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_tree import MicroBatchSpec, pack_trees  # noqa: E402
from megatron_tree.mcore.packed_seq import thd_packed_seq_params  # noqa: E402


def test_segments_follow_the_slots_and_padding_is_one_more():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 100, 6)
    seqs = [np.concatenate([prompt, rng.integers(0, 100, n)]) for n in (3, 9, 1)] + [rng.integers(0, 100, 5)]
    (mb,) = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=64), share_prefixes=False, pad_to_multiple_of=16)
    params = thd_packed_seq_params(mb)
    cu = params.cu_seqlens_q
    assert params.qkv_format == "thd" and cu.dtype == torch.int32 and cu is params.cu_seqlens_kv
    assert cu[0] == 0 and cu[-2] == mb.num_tokens and cu[-1] == mb.num_slots == 48
    lengths = (cu[1:-1] - cu[:-2]).tolist()
    assert sorted(lengths) == sorted(len(s) for s in seqs)
    # every segment is one sequence: depth restarts at its first slot and counts up to its end
    for start, end in zip(cu[:-2].tolist(), cu[1:-1].tolist()):
        assert mb.position_ids[0, start:end].tolist() == list(range(end - start))
        assert int(mb.attention_mask[0, start]) == end
    assert params.max_seqlen_q == params.max_seqlen_kv == max(max(lengths), mb.num_slots - mb.num_tokens)


def test_unpadded_micro_batch_has_no_padding_segment():
    seqs = [np.arange(5), np.arange(10, 17)]
    (mb,) = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=64), share_prefixes=False)
    assert thd_packed_seq_params(mb).cu_seqlens_q.tolist() in ([0, 5, 12], [0, 7, 12])


def test_shared_prefixes_are_refused():
    seqs = [np.arange(8), np.concatenate([np.arange(6), [50, 51]])]
    (mb,) = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=64))
    with pytest.raises(ValueError, match="share_prefixes=False"):
        thd_packed_seq_params(mb)

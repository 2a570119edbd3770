"""Sequence-normalised losses over the parts of sequences split into chunks (``chunk_trees=True``) add up to the
losses of the whole sequences; without the whole-sequence counts they do not."""

import numpy as np
import torch

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.ops.losses import ppo_clip_loss, sft_loss, value_loss


def test_sequence_normalisation_is_exact_over_chunk_parts():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 12).tolist()
    seqs = [prompt + rng.integers(0, 50, n).tolist() for n in (3, 20, 9, 31)] + [rng.integers(0, 50, 17).tolist()]
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=6, chunk_trees=True))
    assert max(len(mb.sequence_ids) for mb in mbs) > 1 and all(mb.chunk for mb in mbs)
    gen = torch.Generator().manual_seed(0)
    per_seq = {name: [torch.randn(len(s) - 1, generator=gen, dtype=torch.float64) for s in seqs]
               for name in ("lp", "old", "adv", "v", "ret")}
    per_seq["mask"] = [torch.rand(len(s) - 1, generator=gen) < 0.7 for s in seqs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum([len(s) - 1 for s in seqs])]))
    whole = {k: torch.cat(v) for k, v in per_seq.items()}

    def losses(x, cu, **kw):
        return {
            "ppo": ppo_clip_loss(x["lp"], x["old"], x["adv"], cu, loss_mask=x["mask"], normalization="sequence",
                                 reduction="sum", **kw),
            "sft": sft_loss(x["lp"], cu, loss_mask=x["mask"], normalization="sequence", reduction="sum", **kw),
            "value": value_loss(x["v"], x["old"], x["ret"], cu, loss_mask=x["mask"], normalization="sequence",
                                reduction="sum", **kw),
        }

    want = {k: float(loss / m["normalizer"]) for k, (loss, m) in losses(whole, cu).items()}
    loss_tokens = torch.tensor([int(m.sum()) for m in per_seq["mask"]])
    sums = {k: [0.0, 0, 0.0, 0] for k in want}
    for mb in mbs:
        part = {k: mb.gather_targets(v) for k, v in per_seq.items()}
        ids = torch.tensor(mb.sequence_ids)
        exact = losses(part, mb.cu_targets, sequence_loss_tokens=loss_tokens[ids],
                       counts_sequence=torch.tensor(mb.sequence_ends))
        naive = losses(part, mb.cu_targets)
        for k in want:
            sums[k][0] += float(exact[k][0])
            sums[k][1] += int(exact[k][1]["normalizer"])
            sums[k][2] += float(naive[k][0])
            sums[k][3] += int(naive[k][1]["normalizer"])
    for k, (num, den, naive_num, naive_den) in sums.items():
        assert abs(num / den - want[k]) <= 1e-12 * abs(want[k]), (k, num / den, want[k])
        assert abs(naive_num / naive_den - want[k]) > 1e-3 * abs(want[k]), k  # parts counted as sequences: wrong


def test_sequence_normalisation_on_parts_without_whole_counts_is_refused():
    """While a loss runs on sequence parts (``sequence_parts``, which the schedule sets for such chunks), a
    sequence-normalised loss without ``sequence_loss_tokens`` / ``counts_sequence`` raises instead of dividing each part
    by its own count; token normalisation, and sequence normalisation with both, run."""
    import pytest

    from megatron_tree.ops.losses import sequence_parts

    lp, cu = torch.randn(7, dtype=torch.float64), torch.tensor([0, 3, 7])
    with sequence_parts(True):
        with pytest.raises(ValueError, match="holds parts of sequences"):
            sft_loss(lp, cu, normalization="sequence", reduction="sum")
        sft_loss(lp, cu, normalization="token", reduction="sum")
        sft_loss(lp, cu, normalization="sequence", reduction="sum", sequence_loss_tokens=torch.tensor([5, 4]),
                 counts_sequence=torch.tensor([False, True]))
    sft_loss(lp, cu, normalization="sequence", reduction="sum")  # whole sequences: as before

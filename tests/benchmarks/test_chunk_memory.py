"""benchmarks/chunk_memory.py counts the slots a chunked step keeps alive at once: on batches whose count follows from
the chunk schedule's rule (a chunk stays until the chunks reading it have run their backwards; beyond
``max_kept_tokens`` without its graph)."""

import numpy as np
from dist_utils import REPO_ROOT as REPO

from megatron_tree import MicroBatchSpec, pack_trees


def kept(seqs, cap, monkeypatch, max_kept=10**6):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from chunk_memory import kept_slots

    chunks = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=cap, chunk_trees=True, max_kept_tokens=max_kept))
    assert all(mb.chunk for mb in chunks)
    return len(chunks), kept_slots(chunks)


def test_a_prompt_keeps_its_chunks_and_one_sample(monkeypatch):
    """A 32-token prompt and 6 samples of 16 hanging from it, 16 slots a chunk: the prompt's 2 chunks wait for every
    sample; each sample's chunk goes as soon as its forward is done."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 32).tolist()
    seqs = [prompt + [100 + i] + rng.integers(0, 50, 15).tolist() for i in range(6)]
    assert kept(seqs, 16, monkeypatch) == (8, 32 + 16)
    assert kept(seqs, 16, monkeypatch, max_kept=16) == (8, 16 + 16)
    assert kept(seqs, 16, monkeypatch, max_kept=0) == (8, 16)


def test_a_chain_keeps_all_its_chunks(monkeypatch):
    """One 40-token sequence: every chunk is read by the next, so all 3 stay until the last forward; with 0 kept
    slots only the chunk in flight has a graph."""
    assert kept([np.arange(40) + 1], 16, monkeypatch) == (3, 40)
    assert kept([np.arange(40) + 1], 16, monkeypatch, max_kept=0) == (3, 16)


def test_the_fewest_extra_forward_flops_are_found_by_trying_every_choice(monkeypatch):
    """A 40-token chain in 3 chunks of 16 slots: at the last forward chunks 0 and 1 wait (32 slots); a budget of 16
    needs one of them run again, the cheaper whichever it is (the plan itself always takes chunk 0, released last);
    a budget of 0 needs both; 32 neither."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from chunk_memory import fewest_extra_flops

    chunks = pack_trees([np.arange(40) + 1], MicroBatchSpec(max_tokens_per_mb=16, chunk_trees=True))
    assert [mb.chunk.recompute for mb in chunks] == [True, False, False]
    assert fewest_extra_flops(chunks, np.array([1.0, 5.0, 7.0]), 16) == 1.0
    assert fewest_extra_flops(chunks, np.array([5.0, 2.0, 7.0]), 16) == 2.0
    assert fewest_extra_flops(chunks, np.array([5.0, 2.0, 7.0]), 0) == 7.0
    assert fewest_extra_flops(chunks, np.array([5.0, 2.0, 7.0]), 32) == 0.0

"""The chunk driver's order and memory (megatron_tree.mcore.chunk_schedule), with a stand-in model: every chunk's
backward runs after the backwards of the chunks that read its keys and values, only the chunks whose readers are
still to come are kept, and those beyond ``max_kept_tokens`` keep no graph: they run their forward again (from the
same random-number states) right before their backward."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forests import any_batch
from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.mcore import chunk_context
from megatron_tree.mcore.chunk_schedule import ChunkedTree, release_chunks, run_chunked_tree, schedule_steps

CONFIG = SimpleNamespace(num_moe_experts=None, grad_scale_func=None, no_sync_func=None)
CAPACITY = 16


def prompt_and_samples() -> list[list[int]]:
    """A prompt (3 chunks), 6 samples (2 chunks each) that share nothing but the prompt."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 40).tolist()
    return [prompt + [100 + i] + rng.integers(0, 50, 29).tolist() for i in range(6)]


def run(chunks, uniform=False, recompute=None):
    """One step of ``chunks``: (order of the chunks' backwards, most chunks kept at once, most slots of graphs
    kept by waiting chunks during a forward, forwards per chunk)."""
    weight = torch.ones((), requires_grad=True)
    order, live, graphs, kept, forwards, draws = [], [], {}, [], {}, {}

    def forward(mb, mask):
        c = mb.chunk.index
        live.append(len(chunk_context._LINKS))
        kept.append(sum(graphs.values()))
        forwards[c] = forwards.get(c, 0) + 1
        draw = float(torch.rand(()))  # dropout's draw: the same in both forwards of a chunk
        assert draws.setdefault(c, draw) == draw
        out = weight * mb.input_ids.float().sum() * draw
        if out.requires_grad:
            graphs[c] = mb.num_tokens
            out.register_hook(lambda g: (order.append(c), graphs.pop(c)) and None)
        return out

    def loss_func_for(mb):
        return lambda out, non_loss_data=False: (out, torch.tensor(1), {"loss": out.detach()[None]})

    item = ChunkedTree(chunks, uniform, recompute=recompute)
    output, loss_func = run_chunked_tree(item, forward, loss_func_for, CONFIG, train=True)
    loss, count, _ = loss_func(output)
    loss.backward()  # megatron-core's backward of the first chunk
    release_chunks()
    assert int(count) == len(chunks) and not chunk_context._LINKS
    assert float(weight.grad) == pytest.approx(sum(float(mb.input_ids.sum()) * draws[mb.chunk.index] for mb in chunks))
    return order, max(live), max(kept), forwards


def check_order(chunks, order):
    position = {c: i for i, c in enumerate(order)}
    assert sorted(order) == list(range(len(chunks))) and order[-1] == 0
    for mb in chunks:
        for src, _ in mb.chunk.sources:
            assert position[src] > position[mb.chunk.index]  # a reader's backward comes first


def test_backwards_follow_their_readers_and_only_pending_chunks_are_kept():
    chunks = pack_trees(prompt_and_samples(), MicroBatchSpec(max_tokens_per_mb=CAPACITY, chunk_trees=True,
                                                             max_kept_tokens=10**6))
    assert len(chunks) > 10 and not any(mb.chunk.recompute for mb in chunks)
    order, links, kept, forwards = run(chunks)
    check_order(chunks, order)
    assert links <= 3 + 2  # the prompt's chunks and one sample's (the chunk in flight included)
    assert set(forwards.values()) == {1} and kept > CAPACITY
    uniform_order, uniform_links, _, _ = run(chunks, uniform=True)  # expert parallel: all forwards, then all backwards
    assert uniform_order == list(range(len(chunks)))[::-1] and uniform_links == len(chunks)


@pytest.mark.parametrize("max_kept", [None, 0, 20])
def test_chunks_beyond_max_kept_tokens_keep_no_graph_and_run_again(max_kept):
    chunks = pack_trees(prompt_and_samples(), MicroBatchSpec(max_tokens_per_mb=CAPACITY, chunk_trees=True,
                                                             max_kept_tokens=max_kept))
    again = {mb.chunk.index for mb in chunks if mb.chunk.recompute}
    readers = {mb.chunk.index for mb in chunks if mb.chunk.last_reader > mb.chunk.index}
    assert again and again <= readers and (max_kept != 0 or again == readers)
    order, _, kept, forwards = run(chunks)
    check_order(chunks, order)
    assert kept <= (CAPACITY if max_kept is None else max_kept)
    assert forwards == {c: 2 if c in again else 1 for c in range(len(chunks))}
    # expert parallel: the flags planned for its order, ORed with another rank's (here: one chunk more)
    own = tuple(mb.chunk.recompute_uniform for mb in chunks)
    assert run(chunks, uniform=True, recompute=own)[2] <= (CAPACITY if max_kept is None else max_kept)
    flags = tuple(flag or c == 1 for c, flag in enumerate(own))
    forwards = run(chunks, uniform=True, recompute=flags)[3]
    assert forwards == {c: 1 + flag for c, flag in enumerate(flags)}


@settings(max_examples=60, deadline=None)
@given(any_batch, st.integers(2, 9), st.one_of(st.none(), st.integers(0, 12)))
def test_the_waiting_chunks_keep_at_most_max_kept_tokens(seqs, cap, max_kept):
    """Any forest, capacity and ``max_kept_tokens``: during every forward the waiting chunks keep graphs of at most
    that many slots, only chunks that later chunks read run again (every one of them with 0), and the backwards
    still follow their readers'; in expert parallel's order (every forward, then the backwards) with the flags
    planned for it, the same budget holds."""
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=cap, chunk_trees=True, max_kept_tokens=max_kept))
    for chunks in (step for step in schedule_steps(mbs) if isinstance(step, list)):
        again = {mb.chunk.index for mb in chunks if mb.chunk.recompute}
        readers = {mb.chunk.index for mb in chunks if mb.chunk.last_reader > mb.chunk.index}
        assert again <= readers and (max_kept != 0 or again == readers)
        order, _, kept, forwards = run(chunks)
        check_order(chunks, order)
        assert kept <= (cap if max_kept is None else max_kept)
        assert forwards == {c: 2 if c in again else 1 for c in range(len(chunks))}
        uniform = tuple(mb.chunk.recompute_uniform for mb in chunks)  # expert parallel's order, the same budget
        assert run(chunks, uniform=True, recompute=uniform)[2] <= (cap if max_kept is None else max_kept)

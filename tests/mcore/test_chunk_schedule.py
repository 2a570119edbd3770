"""The chunk driver's order and memory (megatron_tree.mcore.chunk_schedule), with a stand-in model: every chunk's
backward runs after the backwards of the chunks that read its keys and values, and only the chunks whose readers are
still to come are kept."""

from types import SimpleNamespace

import numpy as np
import torch

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.mcore import chunk_context
from megatron_tree.mcore.chunk_schedule import ChunkedTree, release_chunks, run_chunked_tree

CONFIG = SimpleNamespace(num_moe_experts=None, grad_scale_func=None, no_sync_func=None)


def run(chunks, uniform=False):
    """(order of the chunks' backwards, most chunks kept at once) of one step of ``chunks``."""
    weight = torch.ones((), requires_grad=True)
    order, live = [], []

    def forward(mb, mask):
        live.append(len(chunk_context._LINKS))
        out = weight * mb.input_ids.float().sum()
        out.register_hook(lambda g, i=mb.chunk.index: order.append(i))
        return out

    def loss_func_for(mb):
        return lambda out, non_loss_data=False: (out, torch.tensor(1), {"loss": out.detach()[None]})

    output, loss_func = run_chunked_tree(ChunkedTree(chunks, uniform=uniform), forward, loss_func_for, CONFIG, train=True)
    loss, count, _ = loss_func(output)
    loss.backward()  # megatron-core's backward of the first chunk
    release_chunks()
    assert int(count) == len(chunks) and not chunk_context._LINKS
    return order, max(live)


def test_backwards_follow_their_readers_and_only_pending_chunks_are_kept():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 40).tolist()
    # a prompt (3 chunks), 6 samples (2 chunks each) that share nothing but the prompt
    seqs = [prompt + [100 + i] + rng.integers(0, 50, 29).tolist() for i in range(6)]
    chunks = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=16, chunk_trees=True))
    assert len(chunks) > 10
    order, kept = run(chunks)
    position = {c: i for i, c in enumerate(order)}
    assert sorted(order) == list(range(len(chunks))) and order[-1] == 0
    for mb in chunks:
        for src, _ in mb.chunk.sources:
            assert position[src] > position[mb.chunk.index]  # a reader's backward comes first
    assert kept <= 3 + 2  # the prompt's chunks and one sample's (the chunk in flight included)
    uniform_order, uniform_kept = run(chunks, uniform=True)  # expert parallel: all forwards, then all backwards
    assert uniform_order == list(range(len(chunks)))[::-1] and uniform_kept == len(chunks)

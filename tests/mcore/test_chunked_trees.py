"""Trees larger than a micro-batch (``MicroBatchSpec(chunk_trees=True)``) through the schedule (CPU, fp32).

Micro-batches of 16 slots, every sequence 40-200 tokens: every sequence spans several chunks, every chunk
reads a context from earlier ones. Log-probs (``tree_forward_only``) and parameter gradients
(``tree_forward_backward``) equal each sequence run alone through the upstream model (1e-5); the same with
the injected context gradients dropped is far off (the check can fail). Chunks waiting for their readers keep
their activations up to ``max_kept_tokens`` (16 by default here, 0, or all); the others run their forward again
before their backward: exact either way. Any forest (hypothesis: GRPO, forking conversations, random lists) in chunks
of 2-9 slots equals its whole trees in one micro-batch, with attention layers and with recurrent ones. Hybrid Gated
DeltaNet models (Qwen3.5, Qwen3-Next) the same on a smaller batch, and equal the whole tree in one micro-batch;
zeroed carried recurrent states are far off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from forests import any_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from scripts.parity_common import (
    SLIDING_WINDOW_CASES,
    VOCAB,
    build_model,
    chunked_step,
    flat_logprobs,
    gdn_chunk_batch,
    hf_logprobs_fp64,
    max_diff,
    param_grads,
    relative_grad_error,
    weighted_sum,
)

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.mcore import chunk_context
from megatron_tree.mcore.forward_only import tree_forward_only
from megatron_tree.mcore.schedule import tree_forward_backward
from megatron_tree.runtime import save_tiny_hf_checkpoint

TOL = 1e-5
CAPACITY = 16


def long_branching_batch(seed: int = 0) -> list[list[int]]:
    """Two prompts (30 and 45 tokens): per prompt a short sibling laid out first, then long branches, a branch
    that forks again deep down (a branch at every depth along it), a duplicate; and a 120-token chain."""
    rng = np.random.default_rng(seed)

    def rand(n: int) -> list[int]:
        return rng.integers(10, VOCAB, n).tolist()

    seqs = []
    for plen in (30, 45):
        prompt = rand(plen)
        long_a = prompt + [3] + rand(120)
        seqs += [prompt + [1] + rand(10), prompt + [2] + rand(60), long_a, long_a[:100] + [4] + rand(50),
                 long_a[:70] + [5] + rand(20), list(long_a)]
    seqs.append(rand(120))
    return seqs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("tiny_hf_chunks")
    return {arch: save_tiny_hf_checkpoint(arch, root / arch) for arch in ("qwen3", "qwen3_moe", "deepseek_v3")}


def chunked(seqs, max_kept=None):
    """``seqs`` in chunks of CAPACITY slots; the chunks waiting for their readers keep at most ``max_kept`` slots of
    activations (None: CAPACITY), the others run their forward again before their backward."""
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=CAPACITY, chunk_trees=True, max_kept_tokens=max_kept))
    assert all(mb.num_tokens <= CAPACITY for mb in mbs) and sum(mb.chunk is not None for mb in mbs) == len(mbs)
    assert any(mb.chunk.recompute for mb in mbs) == (max_kept != KEEP_ALL)
    return mbs


KEEP_ALL = 10**6


@pytest.fixture(scope="module")
def batch():
    seqs = long_branching_batch()
    assert min(map(len, seqs)) > 2 * CAPACITY
    return seqs, chunked(seqs)


@pytest.mark.parametrize("arch,recompute,max_kept", [
    ("qwen3", "none", None), ("qwen3", "none", KEEP_ALL),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("qwen3", "full", None), ("qwen3", "selective", 0), ("qwen3_moe", "full", None), ("deepseek_v3", "full", 0)]),
])  # fmt: skip
def test_chunked_tree_equals_each_sequence_alone(arch, recompute, max_kept, checkpoints, batch):
    seqs = batch[0]
    mbs = chunked(seqs, max_kept)
    tree = build_model(checkpoints[arch], tree=True, recompute=recompute)[0].train()
    flat = build_model(checkpoints[arch], tree=False)[0].train()
    with torch.no_grad():
        lp = tree_forward_only([tree], mbs)
    want = flat_logprobs(flat, seqs)
    weighted_sum(want).backward()
    lp_err = max_diff(dict(enumerate(lp)), want)
    grad_err = relative_grad_error(chunked_step(tree, mbs, seqs), param_grads(flat))
    print(f"{arch}/{recompute}/max_kept={max_kept}: {len(mbs)} chunks of <= {CAPACITY} slots, "
          f"{sum(mb.chunk.recompute for mb in mbs)} run again: logprob {lp_err:.3g}, relative grad {grad_err:.3g}")
    assert lp_err < TOL and grad_err < TOL


@pytest.fixture(scope="module")
def qwen3_tree(checkpoints):
    return build_model(checkpoints["qwen3"], tree=True)[0].train()


def chunks_vs_whole(model, seqs, cap, max_kept) -> tuple[int, float, float]:
    """``seqs`` in chunks of ``cap`` slots (``max_kept_tokens=max_kept``) against its whole trees in one micro-batch,
    the same model: (chunks, log-prob error, gradient error: :func:`relative_grad_error`, each parameter against at
    least a tenth of the largest gradient)."""
    whole = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=4096))
    chunks = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=cap, chunk_trees=True, max_kept_tokens=max_kept))
    with torch.no_grad():
        lp_err = max_diff(*(dict(enumerate(tree_forward_only([model], mbs))) for mbs in (chunks, whole)))
    grad_err = relative_grad_error(chunked_step(model, chunks, seqs), chunked_step(model, whole, seqs), floor=0.1)
    return len(chunks), lp_err, grad_err


any_chunking = (any_batch, st.integers(2, 9), st.sampled_from([None, 0, KEEP_ALL]))
"""Any forest (GRPO prompts and samples, forking conversations, random token lists with accidental sharing and
duplicates), chunks of 2-9 slots, waiting chunks keeping the default / 0 / every graph."""

ANY_FOREST_GRAD_TOL = 1e-4
"""Chunks vs whole trees, gradients, on :data:`any_chunking`'s forests: 4e-6 at most over 500 draws (Qwen3), but a
forest of one repeated token (``[[0] * 5, [0] * 4]`` in chunks of 2) sums every slot's gradient into one embedding row
and the norms' weights with cancellation, in another order chunked than whole: 2e-5 (Qwen3 and Qwen3.5). Dropping the
injected dK / dV is 1.08 off."""


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(*any_chunking)
def test_any_forest_in_chunks_equals_its_whole_trees(qwen3_tree, seqs, cap, max_kept):
    """:data:`any_chunking`: log-probs and parameter gradients equal the whole trees' in one micro-batch (themselves
    tested against each sequence alone)."""
    errors = chunks_vs_whole(qwen3_tree, seqs, cap, max_kept)
    assert errors[1] < TOL and errors[2] < ANY_FOREST_GRAD_TOL, errors


@pytest.fixture(scope="module")
def gdn_checkpoints(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("tiny_hf_gdn_chunks")
    return {arch: save_tiny_hf_checkpoint(arch, root / arch) for arch in GDN_SEEDS}


def gdn_micro_batches(seed: int, max_kept: int | None = None):
    """(sequences, their chunks of <= CAPACITY slots (``chunked``), the whole trees in one micro-batch)."""
    seqs = gdn_chunk_batch(seed)
    mbs = chunked(seqs, max_kept)
    assert min(map(len, seqs)) > CAPACITY
    assert any(len(mb.chunk.carried) > 1 for mb in mbs)  # a chunk starting slots from two earlier branch points
    return seqs, mbs, pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=4096))


GDN_DECAY = ("self_attention.A_log", "self_attention.dt_bias")
GDN_SEEDS = {"qwen3_5": 0, "qwen3_next": 3}
GDN_TOL = {"logprob": TOL, "grad": TOL, "decay": 3 * TOL, "vs whole": 2 * TOL}
"""fp32 rounding of the tiny random models' recurrent layers, whatever the packing (see
tests/mcore/test_gated_delta_net_parity.py), is ~1e-5 and depends on the batch (``GDN_SEEDS``: batches where the
whole tree in one micro-batch is itself within 1e-5 of each sequence alone; Qwen3-Next's gradients are 1.7-3.3e-5
off at seeds 0-2, whole tree and chunks alike). Log-probs against Hugging Face run in fp64 (the exact values),
gradients against each sequence alone (A_log / dt_bias: one number per head summed over every slot's decay gradient,
3e-5). Chunked vs the whole tree (the same model): the scans are cut at other points (chunk ends, state exports) and
round differently, as far from each other as each is from each sequence alone (5e-6 - 1.1e-5 measured), so 2e-5."""


def gdn_errors(tree, flat, path, seqs, mbs, whole) -> dict[str, float]:
    """Chunked log-probs vs Hugging Face in fp64, gradients vs each sequence alone (the flat model), and both vs the
    whole tree in one micro-batch (the same model)."""
    with torch.no_grad():
        lp = dict(enumerate(tree_forward_only([tree], mbs)))
        lp_whole = dict(enumerate(tree_forward_only([tree], whole)))
    weighted_sum(flat_logprobs(flat, seqs)).backward()
    grads, grads_whole, flat_grads = chunked_step(tree, mbs, seqs), chunked_step(tree, whole, seqs), param_grads(flat)
    decay = {n for n in flat_grads if n.endswith(GDN_DECAY)}
    rest = flat_grads.keys() - decay
    return {
        "logprob": max_diff(lp, hf_logprobs_fp64(path, seqs)),
        "grad": relative_grad_error({n: grads[n] for n in rest}, {n: flat_grads[n] for n in rest}),
        "decay": relative_grad_error({n: grads[n] for n in decay}, {n: flat_grads[n] for n in decay}),
        "vs whole": max(max_diff(lp, lp_whole), relative_grad_error(grads, grads_whole)),
    }


@pytest.mark.parametrize("arch,recompute,max_kept", [
    ("qwen3_5", "none", None), pytest.param("qwen3_next", "full", KEEP_ALL, marks=pytest.mark.slow),
])  # fmt: skip
def test_gated_delta_net_chunks_equal_each_sequence_alone(arch, recompute, max_kept, gdn_checkpoints):
    """Qwen3.5 (3 GDN layers, 1 attention layer) and Qwen3-Next (its MoE too) in chunks of 16 slots."""
    seqs, mbs, whole = gdn_micro_batches(GDN_SEEDS[arch], max_kept)
    tree = build_model(gdn_checkpoints[arch], tree=True, recompute=recompute)[0].train()
    flat = build_model(gdn_checkpoints[arch], tree=False)[0].train()
    errors = gdn_errors(tree, flat, gdn_checkpoints[arch], seqs, mbs, whole)
    print(f"{arch}/{recompute}/max_kept={max_kept}: {len(mbs)} chunks of <= {CAPACITY} slots: " +
          ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))
    assert all(errors[k] < GDN_TOL[k] for k in GDN_TOL), errors


@pytest.fixture(scope="module")
def qwen3_5_tree(gdn_checkpoints):
    return build_model(gdn_checkpoints["qwen3_5"], tree=True)[0].train()


GDN_ANY_FOREST_TOL = 1e-4
"""Chunks vs whole trees on :data:`any_chunking`'s forests, Qwen3.5, log-probs and gradients: the recurrent layers' fp32
rounding (the scans cut at other points) and :data:`ANY_FOREST_GRAD_TOL`'s summation order, 2e-5 at most measured;
zeroed carried states are 2.2 off."""


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(*any_chunking)
def test_any_forest_in_chunks_equals_its_whole_trees_with_recurrent_layers(qwen3_5_tree, seqs, cap, max_kept):
    """Qwen3.5 (Gated DeltaNet layers carry each chunk's recurrent states and conv windows) on :data:`any_chunking`:
    log-probs and parameter gradients equal the whole trees' in one micro-batch."""
    errors = chunks_vs_whole(qwen3_5_tree, seqs, cap, max_kept)
    assert errors[1] < GDN_ANY_FOREST_TOL and errors[2] < GDN_ANY_FOREST_TOL, errors


@pytest.mark.slow
def test_zeroed_carried_states_are_detected(gdn_checkpoints, monkeypatch):
    """The recurrent states carried from earlier chunks matter: started from zero instead, log-probs are far off."""
    from megatron_tree.mcore.chunk_context import ChunkLink

    seqs, mbs, _ = gdn_micro_batches(GDN_SEEDS["qwen3_5"])
    tree = build_model(gdn_checkpoints["qwen3_5"], tree=True)[0].eval()
    flat = build_model(gdn_checkpoints["qwen3_5"], tree=False)[0].eval()
    carried = ChunkLink.carried_recurrent
    monkeypatch.setattr(ChunkLink, "carried_recurrent", lambda self, layer: None if not self.carried else
                        (lambda w, s: (w, torch.zeros_like(s)))(*carried(self, layer)))
    with torch.no_grad():
        err = max_diff(dict(enumerate(tree_forward_only([tree], mbs))), flat_logprobs(flat, seqs))
    print(f"zeroed carried states: logprob {err:.3g}")
    assert err > 1e-2


@pytest.mark.slow
def test_sliding_window_and_entropy_in_chunks(tmp_path, cpu_megatron, batch):
    """Qwen2 with a sliding window of 4 on its second layer: chunked log-probs and gradients equal each sequence
    alone (the window's depths come from the context mask), and the entropies equal those of whole trees."""
    seqs, mbs = batch
    arch, overrides = SLIDING_WINDOW_CASES["qwen2_swa"]
    path = save_tiny_hf_checkpoint(arch, tmp_path, **overrides)
    tree = build_model(path, tree=True)[0].train()
    flat = build_model(path, tree=False)[0].train()
    whole = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=4096))
    with torch.no_grad():
        lp, ent = tree_forward_only([tree], mbs, with_entropy=True)
        lp_whole, ent_whole = tree_forward_only([tree], whole, with_entropy=True)
    want = flat_logprobs(flat, seqs)
    weighted_sum(want).backward()
    lp_err = max_diff(dict(enumerate(lp)), want)
    ent_err = max_diff(dict(enumerate(ent)), dict(enumerate(ent_whole)))
    grad_err = relative_grad_error(chunked_step(tree, mbs, seqs), param_grads(flat))
    print(f"qwen2_swa: logprob {lp_err:.3g}, entropy vs whole trees {ent_err:.3g}, relative grad {grad_err:.3g}")
    assert lp_err < TOL and ent_err < TOL and grad_err < TOL and max_diff(dict(enumerate(lp_whole)), want) < TOL


@pytest.mark.slow
def test_dropping_the_context_gradients_is_detected(checkpoints, batch, monkeypatch):
    """The ancestors' dK / dV from later chunks matter: without them the gradients are far off."""
    seqs, mbs = batch
    tree = build_model(checkpoints["qwen3"], tree=True)[0].train()
    flat = build_model(checkpoints["qwen3"], tree=False)[0].train()
    weighted_sum(flat_logprobs(flat, seqs)).backward()
    want = param_grads(flat)
    monkeypatch.setattr(chunk_context._AddLeafGrads, "backward",
                        staticmethod(lambda ctx, grad: (grad, *(None for _ in range(2 * len(ctx.leaves))))))
    err = relative_grad_error(chunked_step(tree, mbs, seqs), want)
    print(f"without the context gradients: relative grad {err:.3g}")
    assert err > 1e-2


def piece_rows_step(model, seqs, mbs):
    """The flat step with the chunks' grouping (MoE router statistics' reference): micro-batch c of the upstream
    model holds, per sequence part in chunk c, the sequence up to one token past the part as a row whose tokens
    outside the part are masked as padding (their router statistics do not count; causal attention still reads
    the tokens before the part), and the part's targets as its loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from scripts.router_stats_parity import _step

    from megatron_tree.ops.logprobs import vocab_parallel_logprobs

    def items():
        for mb in mbs:
            rows = []
            for sid, start, n, end in zip(mb.sequence_ids, mb.target_starts, mb.seq_lens, mb.sequence_ends):
                rows.append((seqs[sid][: start + n + (not end)], start, n, n - end))
            width = max(len(r[0]) for r in rows)
            tokens = torch.zeros(len(rows), width, dtype=torch.long)
            pad = torch.ones(len(rows), width, dtype=torch.bool)
            for r, (row, start, n, _) in enumerate(rows):
                tokens[r, : len(row)] = torch.as_tensor(row)
                pad[r, start : start + n] = False
            yield tokens, pad, rows

    def forward_step(data_iterator, chunk):
        tokens, pad, rows = next(data_iterator)
        b, width = tokens.shape
        output = chunk(tokens, torch.arange(width)[None].expand(b, width), None, padding_mask=pad)

        def loss_func(logits):
            slots = torch.cat([r * width + torch.arange(s, s + t) for r, (_, s, _, t) in enumerate(rows)])
            labels = torch.cat([tokens[r, s + 1 : s + t + 1] for r, (_, s, _, t) in enumerate(rows)])
            loss = -vocab_parallel_logprobs(logits.reshape(b * width, -1), slots, labels).sum()
            count = torch.tensor(labels.numel(), dtype=torch.int)
            return loss, count, {"loss": torch.stack([loss.detach(), count.float()])}

        return output, loss_func

    return _step(model, lambda: get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=items(), model=model[0], num_microbatches=len(mbs),
        seq_length=max(map(len, seqs)), micro_batch_size=1, forward_only=False))


def graph_order(mbs):
    """The chunks of ``mbs`` in the order the chunk driver builds their graphs, where the router statistics are
    gathered: in forward order, but a chunk marked ``recompute`` at its second forward, right before its backward
    (when the stack pops it; the first chunk after all others)."""
    order = []
    for start in [i for i, mb in enumerate(mbs) if mb.chunk.index == 0]:
        chunks = mbs[start : start + mbs[start].chunk.size]
        stack = []
        for c, mb in enumerate(chunks):
            order += [] if mb.chunk.recompute else [start + c]
            stack.append(c)
            while len(stack) > 1 and chunks[stack[-1]].chunk.last_reader <= c:
                popped = stack.pop()
                order += [start + popped] if chunks[popped].chunk.recompute else []
        order += [start] if chunks[0].chunk.recompute else []
    return order


@pytest.mark.slow
@pytest.mark.parametrize("arch,case", [("qwen3_moe", "all"), ("qwen3_moe", "z_loss"), ("qwen3_next", "all")])
def test_chunked_router_statistics_equal_the_flat_step_with_the_same_grouping(arch, case, request):
    """MoE aux / seq-aux / global-aux losses and z-loss with large coefficients: the chunked step's loss, gradients,
    logged values and router token counts equal the flat step whose micro-batches hold the chunks' sequence parts,
    in the order the chunks build their graphs (``global_aux_loss`` mixes each micro-batch with the step's running
    counts) (Qwen3-Next: its Gated DeltaNet layers carrying their states across the chunks, on the GDN batch)."""
    from scripts.router_stats_parity import build, compare, tree_step

    if arch in GDN_SEEDS:
        seqs, mbs, _ = gdn_micro_batches(GDN_SEEDS[arch])
        path = request.getfixturevalue("gdn_checkpoints")[arch]
    else:
        seqs, mbs = request.getfixturevalue("batch")
        path = request.getfixturevalue("checkpoints")[arch]
    got = tree_step(build(path, case), mbs)
    assert any(mb.chunk.recompute for mb in mbs) and graph_order(mbs) != list(range(len(mbs)))
    want = piece_rows_step(build(path, case, tree=False), seqs, [mbs[i] for i in graph_order(mbs)])
    errors = compare(got, want)
    print(f"{arch}/{case}: {errors}")
    # Qwen3-Next's gradients: its recurrent layers' fp32 rounding (GDN_TOL; 1.3e-5 measured, the statistics 2e-7)
    tol = dict(loss=TOL, logged=TOL, counts=TOL, grad=GDN_TOL["vs whole"] if arch in GDN_SEEDS else TOL)
    assert all(errors[k] < tol[k] for k in tol), errors


@pytest.mark.parametrize("layout,match", [
    (dict(pp=2, cp=1, thd=False), "pipeline parallel \\(2 stages\\)"),
    (dict(pp=1, cp=2, thd=False), "context parallel \\(2 ranks\\)"),
    (dict(pp=1, cp=1, thd=True), "the flat THD path"),
])
def test_layouts_that_cannot_run_chunks_are_refused(layout, match, batch):
    from megatron_tree.mcore.schedule import _check_chunks_runnable

    with pytest.raises(ValueError, match=f"cannot run here: {match}.*pack with chunk_trees=False"):
        _check_chunks_runnable(batch[1], **layout)


def test_sequence_normalised_loss_without_whole_counts_is_refused_on_chunks(checkpoints, batch):
    """The schedule marks a chunk's loss as running on sequence parts: ``normalization="sequence"`` without the whole
    sequences' counts raises (one line, what to pass) instead of dividing each part by its own count."""
    from megatron_tree.ops.losses import sft_loss

    _, mbs = batch
    model = build_model(checkpoints["qwen3"], tree=True)[0].train()
    model.config.finalize_model_grads_func = lambda *args, **kwargs: None
    try:
        with pytest.raises(ValueError, match="holds parts of sequences"):
            tree_forward_backward([model], mbs, lambda lp, mb: sft_loss(lp, mb.cu_targets, normalization="sequence",
                                                                         reduction="sum"))
    finally:
        model.config.finalize_model_grads_func = None
        from megatron_tree.mcore.chunk_schedule import release_chunks

        release_chunks()


def test_passes_over_one_batch_move_and_prepare_its_micro_batches_once(checkpoints, batch, monkeypatch):
    """An RL step runs several passes over one batch's micro-batches (old and reference log-probs, values, the
    updates): the first moves each micro-batch to the device and prepares its mask, the later passes reuse both, also
    with more chunks than the mask cache keeps for masks nobody holds (without the schedule's hold the second pass
    prepared every chunk's mask again). A host micro-batch edited in place is copied again; a pass over another batch,
    or freeing the micro-batches, releases the copies and their masks."""
    import gc
    from types import SimpleNamespace

    from megatron_tree.attention import PREPARED_MASKS
    from megatron_tree.core.microbatch import TreeMicroBatch

    seqs = batch[0][:6]  # one prompt's group
    mbs = chunked(seqs, 0)  # every chunk also runs its forward again before its backward
    assert len(mbs) > 2 * PREPARED_MASKS.capacity
    model = build_model(checkpoints["qwen3"], tree=True)[0].train()
    moves, prepares = [], []
    to, lookup = TreeMicroBatch.to, PREPARED_MASKS.lookup
    monkeypatch.setattr(TreeMicroBatch, "to", lambda self, *a, **k: moves.append(id(self)) or to(self, *a, **k))
    monkeypatch.setattr(PREPARED_MASKS, "lookup",
                        lambda tensor, tag, make: lookup(tensor, tag, lambda: prepares.append(tag) or make()))
    with torch.no_grad():
        first = tree_forward_only([model], mbs)
    counts = [(len(moves), len(prepares))]
    with torch.no_grad():
        second = tree_forward_only([model], mbs)
    chunked_step(model, mbs, seqs)
    counts.append((len(moves), len(prepares)))
    assert counts == [(len(mbs), len(mbs))] * 2, counts  # one move and one prepared mask per chunk, in all
    assert all(torch.equal(a, b) for a, b in zip(first, second))

    mbs[3].input_ids.add_(0)  # an in-place edit (bumps the version): that micro-batch is moved again
    with torch.no_grad():
        tree_forward_only([model], mbs)
    assert moves[len(mbs):] == [id(mbs[3])]

    def released(mbs_held) -> bool:
        places = {(str(mb.context_mask.device), mb.context_mask.data_ptr()) for mb in mbs_held}
        return not places & set(PREPARED_MASKS._held) and not [k for k in PREPARED_MASKS._entries
                                                                if (k[1], k[2]) in places]

    assert not released(mbs)
    other = chunked(seqs[:3])
    with torch.no_grad():  # a pass over another batch releases this one's, alive or not: one batch on the GPU at most
        tree_forward_only([model], other)
    assert released(mbs) and not released(other)
    masks = [mb.context_mask for mb in other]  # alive: their memory is not reused while the check runs
    del other
    gc.collect()
    with torch.no_grad():  # freed micro-batches release theirs at the next pass
        tree_forward_only([model], mbs)
    assert released([SimpleNamespace(context_mask=m) for m in masks])

    with torch.inference_mode():  # packed where rollouts are made: inference tensors have no version counter
        packed_in_inference = chunked(seqs)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(tree_forward_only([model], packed_in_inference), first))

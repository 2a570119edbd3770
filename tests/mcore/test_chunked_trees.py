"""Trees larger than a micro-batch (``MicroBatchSpec(chunk_trees=True)``) through the schedule (CPU, fp32).

Micro-batches of 16 slots, every sequence 40-200 tokens: every sequence spans several chunks, every chunk
reads a context from earlier ones. Log-probs (``tree_forward_only``) and parameter gradients
(``tree_forward_backward``) equal each sequence run alone through the upstream model (1e-5); the same with
the injected context gradients dropped is far off (the check can fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scripts.parity_common import (
    SLIDING_WINDOW_CASES,
    VOCAB,
    build_model,
    flat_logprobs,
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


@pytest.fixture(scope="module")
def batch():
    seqs = long_branching_batch()
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=CAPACITY, chunk_trees=True))
    assert min(map(len, seqs)) > 2 * CAPACITY
    assert all(mb.num_tokens <= CAPACITY for mb in mbs) and sum(mb.chunk is not None for mb in mbs) == len(mbs)
    return seqs, mbs


def weighted_loss_fn(seqs):
    """``loss_fn`` whose per-micro-batch sums add up to ``weighted_sum`` of all log-probs (count 1 each)."""
    whole = {}
    for sid, seq in enumerate(seqs):
        gen = torch.Generator().manual_seed(100_003 + sid)  # weighted_sum's weights, seed 1
        whole[sid] = torch.randn(len(seq) - 1, generator=gen)
    offsets = np.concatenate([[0], np.cumsum([len(s) - 1 for s in seqs])])
    flat = torch.cat([whole[sid] for sid in range(len(seqs))])

    def loss_fn(logprobs, mb):
        weights = flat[torch.from_numpy(mb.target_index(offsets))].to(logprobs)
        return (weights * logprobs).sum(), 1

    return loss_fn


def chunked_step(model, mbs, seqs):
    """Parameter gradients of one ``tree_forward_backward`` step (sums: no division, no DDP)."""
    config = model.config
    config.finalize_model_grads_func = lambda *args, **kwargs: None
    try:
        tree_forward_backward([model], mbs, weighted_loss_fn(seqs))
    finally:
        config.finalize_model_grads_func = None
    assert not chunk_context._LINKS  # every chunk's kept keys and values were released
    return param_grads(model)


@pytest.mark.parametrize("arch,recompute", [("qwen3", "none"), *(pytest.param(*case, marks=pytest.mark.slow) for case in
                                            [("qwen3", "full"), ("qwen3", "selective"), ("qwen3_moe", "full"),
                                             ("deepseek_v3", "full")])])
def test_chunked_tree_equals_each_sequence_alone(arch, recompute, checkpoints, batch):
    seqs, mbs = batch
    tree = build_model(checkpoints[arch], tree=True, recompute=recompute)[0].train()
    flat = build_model(checkpoints[arch], tree=False)[0].train()
    with torch.no_grad():
        lp = tree_forward_only([tree], mbs)
    want = flat_logprobs(flat, seqs)
    weighted_sum(want).backward()
    lp_err = max_diff(dict(enumerate(lp)), want)
    grad_err = relative_grad_error(chunked_step(tree, mbs, seqs), param_grads(flat))
    print(f"{arch}/{recompute}: {len(mbs)} chunks of <= {CAPACITY} slots: logprob {lp_err:.3g}, relative grad {grad_err:.3g}")
    assert lp_err < TOL and grad_err < TOL


@pytest.mark.slow
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
    monkeypatch.setattr(chunk_context._AddContextGrad, "backward", staticmethod(lambda ctx, grad: (grad, None, None)))
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


@pytest.mark.slow
@pytest.mark.parametrize("case", ["all", "z_loss"])
def test_chunked_router_statistics_equal_the_flat_step_with_the_same_grouping(case, checkpoints, batch):
    """MoE aux / seq-aux / global-aux losses and z-loss with large coefficients: the chunked step's loss, gradients,
    logged values and router token counts equal the flat step whose micro-batch c holds chunk c's sequence parts."""
    from scripts.router_stats_parity import build, compare, tree_step

    seqs, mbs = batch
    path = checkpoints["qwen3_moe"]
    got = tree_step(build(path, case), mbs)
    want = piece_rows_step(build(path, case, tree=False), seqs, mbs)
    errors = compare(got, want)
    print(f"{case}: {errors}")
    assert max(errors.values()) < TOL, errors


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

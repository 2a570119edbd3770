"""gather_tree_logprobs vs a full-vocab per-sequence torch.log_softmax reference: values,
entropy and logits grads at TP 1 (here) and TP 2 (tests/scripts/logprobs_tp2.py over gloo),
the caller's logits left untouched, and input validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from dist_utils import run_torchrun
from scripts.logprobs_reference import BATCHES, compare, micro_batches

from megatron_tree.ops.logprobs import gather_tree_logprobs, vocab_parallel_logprobs

TOL = 1e-5


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("temperature", "chunk_rows"), [(0.7, 1), (1.0, None), (1.6, 5)])
def test_matches_per_sequence_reference(name, dtype, temperature, chunk_rows):
    errs = compare(
        BATCHES[name], max_tokens=24, vocab=13, temperature=temperature, dtype=dtype, seed=3, chunk_rows=chunk_rows
    )
    assert errs["logprobs"] < TOL and errs["entropy"] < TOL, errs
    if dtype == torch.float32:
        assert max(errs["grad"], errs["grad_lp_only"], errs["grad_ent_only"]) < TOL, errs
    else:
        assert errs["grad_vs_plain"] <= 2.0, errs


@pytest.mark.multiprocess
def test_tensor_parallel_2():
    script = Path(__file__).parents[1] / "scripts" / "logprobs_tp2.py"
    run_torchrun(script, 2)


def test_many_targets_per_slot_flat_api():
    """N >> T: every (slot, label) pair drawn at random, duplicates included."""
    gen = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(5, 9, generator=gen)).requires_grad_()
    slots = torch.randint(0, 4, (400,), generator=gen)
    labels = torch.randint(0, 9, (400,), generator=gen)
    w = torch.randn(400, generator=gen)
    lp = vocab_parallel_logprobs(logits, slots, labels, temperature=1.3, rows=4, chunk_rows=2)
    (lp * w).sum().backward()
    ref_in = logits.detach().clone().requires_grad_()
    ref = torch.log_softmax(ref_in[slots] / 1.3, dim=-1)[torch.arange(400), labels]
    (ref * w).sum().backward()
    assert (lp - ref).abs().max() < TOL
    assert (logits.grad - ref_in.grad).abs().max() < TOL
    assert torch.all(logits.grad[4:] == 0)  # rows past `rows` are never read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_whole_vocabulary_backward_sums_duplicate_targets_without_unique(dtype):
    """Without tensor parallelism the backward sums the targets at one (slot, label) by sorting (no host sync); the
    gradient is bitwise the one of the tensor-parallel path (``torch.unique``), each position rounded once."""
    from megatron_tree.ops.logprobs import _backward_kernel, _forward_kernel

    gen = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(5, 9, generator=gen)).to(dtype)
    slots, labels = torch.randint(0, 4, (300,), generator=gen), torch.randint(0, 9, (300,), generator=gen)
    _, _, lse, _ = _forward_kernel(logits, slots, labels, 0, 4, 1.3, False, 2, None)
    grads = [_backward_kernel(logits, slots, labels, 0, lse, None, torch.randn(300, generator=gen.manual_seed(2)),
                              None, 1.3, 2, False, whole) for whole in (True, False)]
    assert torch.equal(*grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_caller_logits_unchanged(dtype):
    (mb,) = micro_batches(BATCHES["grpo"], max_tokens=64)
    logits = torch.randn(1, mb.num_slots, 11).to(dtype).requires_grad_()
    before, version = logits.detach().clone(), logits._version
    lp, ent = gather_tree_logprobs(logits, mb, temperature=0.5, with_entropy=True, chunk_rows=3)
    (lp.sum() + ent.sum()).backward()
    assert logits._version == version and torch.equal(logits.detach(), before)
    assert lp.dtype == ent.dtype == torch.float32 and logits.grad.dtype == dtype


@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprobs", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inplace_backward_same_grad(dtype, with_entropy):
    """inplace_backward gives the same gradient, stored in the logits' own memory."""
    (mb,) = micro_batches(BATCHES["grpo"], max_tokens=64)
    base = (3 * torch.randn(1, mb.num_slots, 11)).to(dtype)
    grads = []
    for inplace in (False, True):
        logits = base.clone().requires_grad_()
        out = logits * 1  # a non-leaf, as Megatron's output layer returns
        res = gather_tree_logprobs(out, mb, temperature=0.8, with_entropy=with_entropy, chunk_rows=3,
                                   inplace_backward=inplace)
        lp, ent = res if with_entropy else (res, torch.zeros(()))
        weights = torch.linspace(-1, 2, lp.numel())
        ((lp * weights).sum() + 0.5 * ent.sum()).backward()
        grads.append(logits.grad)
        assert torch.equal(out.detach(), logits.grad) == inplace  # the grad lives in out's memory
    assert torch.equal(grads[0], grads[1])


def test_returns_tensor_without_entropy():
    (mb,) = micro_batches(BATCHES["multi_turn"], max_tokens=64)
    out = gather_tree_logprobs(torch.randn(1, mb.num_slots, 11), mb)
    assert isinstance(out, torch.Tensor) and out.shape == (sum(n - 1 for n in mb.seq_lens),)


@pytest.mark.gpu  # needs CUDA
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprobs", "entropy"])
def test_cuda_compiled_chunks_match_reference(with_entropy):
    """CUDA runs each chunk as one compiled kernel: values and grads vs fp64 log_softmax, N >> T,
    a ragged last chunk and a second call of another length (the dynamic-shape recompile)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t, rows in ((300, 290), (173, 170)):
        logits = (3 * torch.randn(t, 1000, device="cuda", generator=gen)).requires_grad_()
        slots = torch.randint(0, rows, (4 * t,), device="cuda", generator=gen)
        labels = torch.randint(0, 1000, (4 * t,), device="cuda", generator=gen)
        w = torch.randn(4 * t, device="cuda", generator=gen)
        res = vocab_parallel_logprobs(logits, slots, labels, temperature=0.9, rows=rows, chunk_rows=64,
                                      with_entropy=with_entropy)
        lp, ent = res if with_entropy else (res, torch.zeros((), device="cuda"))
        ((lp * w).sum() + ent.sum()).backward()
        ref_in = logits.detach().double().requires_grad_()
        logp = torch.log_softmax(ref_in[slots] / 0.9, dim=-1)
        ref = logp[torch.arange(4 * t, device="cuda"), labels]
        ref_ent = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros((), device="cuda", dtype=torch.float64)
        ((ref * w).sum() + ref_ent.sum()).backward()
        # the entropy's gradient adds (log p + H) terms of size ~15 over 1000 columns (H200, TF32 off: 1.02e-5 off)
        grad_tol = 2 * TOL if with_entropy else TOL
        assert (lp.double() - ref).abs().max() < TOL and (logits.grad.double() - ref_in.grad).abs().max() < grad_tol
        # an entropy sums 1000 fp32 terms of size ~log(1000): relative to its value (H200: 1.02e-5 off)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=4e-6, atol=TOL)


_V = 11
_swap = dataclasses.replace
# name -> (make (logits, mb, kwargs) from good ones, error type, message pattern)
_BAD = {
    "2-D logits": (lambda lg, mb: (lg[0], mb, {}), ValueError, r"must be \[1, T="),
    "wrong T": (lambda lg, mb: (torch.cat([lg, lg], 1), mb, {}), ValueError, r"must be \[1, T="),
    "int logits": (lambda lg, mb: (lg.long(), mb, {}), ValueError, "float tensor"),
    "temperature 0": (lambda lg, mb: (lg, mb, {"temperature": 0.0}), ValueError, "finite and > 0"),
    "temperature nan": (lambda lg, mb: (lg, mb, {"temperature": float("nan")}), ValueError, "finite and > 0"),
    "temperature tensor": (lambda lg, mb: (lg, mb, {"temperature": torch.tensor(1.0)}), TypeError, "temperature"),
    "chunk_rows 0": (lambda lg, mb: (lg, mb, {"chunk_rows": 0}), ValueError, "chunk_rows must be a positive int"),
    "label >= V": (lambda lg, mb: (lg, _swap(mb, logprob_labels=mb.logprob_labels + _V), {}), ValueError, "labels"),
    "negative label": (lambda lg, mb: (lg, _swap(mb, logprob_labels=mb.logprob_labels - 99), {}), ValueError, "labels"),
    "slot in padding": (
        lambda lg, mb: (lg, _swap(mb, logprob_slots=mb.logprob_slots + mb.num_tokens), {}),
        ValueError,
        "slots range",
    ),
    "float labels": (
        lambda lg, mb: (lg, _swap(mb, logprob_labels=mb.logprob_labels.float()), {}),
        ValueError,
        "integer tensor",
    ),
    "targets vs seq_lens": (
        lambda lg, mb: (lg, _swap(mb, seq_lens=[n + 1 for n in mb.seq_lens]), {}),
        ValueError,
        "seq_lens imply",
    ),
    "not a micro-batch": (lambda lg, mb: (lg, {"input_ids": mb.input_ids}, {}), TypeError, "TreeMicroBatch"),
    "tp_group without init": (lambda lg, mb: (lg, mb, {"tp_group": object()}), ValueError, "not initialised"),
}


@pytest.mark.parametrize("case", sorted(_BAD))
def test_bad_inputs(case):
    make, error, match = _BAD[case]
    (mb,) = micro_batches(BATCHES["grpo"], max_tokens=64)
    logits, mb, kwargs = make(torch.randn(1, mb.num_slots, _V), mb)
    with pytest.raises(error, match=match):
        gather_tree_logprobs(logits, mb, **kwargs)


def test_minus_inf_vocab_columns():
    """Masked (-inf) vocab columns act as absent: values as without them, zero grad there."""
    (mb,) = micro_batches(BATCHES["multi_turn"], max_tokens=64)
    base = torch.randn(1, mb.num_slots, 11)
    masked = torch.cat([base, torch.full((1, mb.num_slots, 3), float("-inf"))], dim=-1).requires_grad_()
    base.requires_grad_()
    outs = []
    for logits in (base, masked):
        lp, ent = gather_tree_logprobs(logits, mb, temperature=0.9, with_entropy=True, chunk_rows=4)
        (lp.sum() + 2 * ent.sum()).backward()
        outs.append((lp, ent))
    assert (outs[0][0] - outs[1][0]).abs().max() < TOL and (outs[0][1] - outs[1][1]).abs().max() < TOL
    assert torch.isfinite(masked.grad).all() and torch.all(masked.grad[..., 11:] == 0)
    assert (masked.grad[..., :11] - base.grad).abs().max() < TOL


@pytest.mark.parametrize("kernel", ["_chunk_sums", "_chunk_grad_"])
def test_compiled_chunk_kernels_compile_once_for_every_chunk_length(monkeypatch, kernel):
    """The CUDA path's compiled chunk kernels (``logprobs._compiled``): one Dynamo compile serves every chunk length
    (the first step's cold start: otherwise a static compile, then a dynamic one at the call's last chunk), with the
    eager values. Counted with Dynamo's own compile counter in place of Inductor, on the CPU."""
    from torch._dynamo.testing import CompileCounter

    from megatron_tree.ops import logprobs

    counter, compile_ = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, backend=counter, **kwargs))
    torch._dynamo.reset()
    fn = getattr(logprobs, kernel)
    run = logprobs._compiled.__wrapped__(fn)
    gen = torch.Generator().manual_seed(0)
    for rows in (96, 96, 37, 64, 96):
        x = torch.randn(rows, 50, generator=gen)
        per_row = torch.randn(rows, generator=gen) if kernel == "_chunk_sums" else torch.rand(rows, 2, generator=gen)
        if kernel == "_chunk_sums":
            got, want = run(x, per_row, 0.7, False)[0], fn(x, per_row, 0.7, False)[0]
        else:
            got, want = x.clone(), x.clone()
            run(got, per_row, 0.7)
            fn(want, per_row, 0.7)
        torch.testing.assert_close(got, want)
    assert counter.frame_count == 1

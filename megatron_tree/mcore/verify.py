"""A one-off numerical self-check of a tree-training model, in its own dtype and parallel layout.

:func:`verify_tree_model` runs a tiny branching batch through the model twice, both times
through :func:`~megatron_tree.mcore.schedule.tree_forward_backward` (forward only, so every pipeline
stage and TP rank takes part as in training):

- packed as prefix trees (:func:`~megatron_tree.pack_trees`): per prompt, a short branch laid
  out first, long branches after it (slot index != depth there), a duplicate sequence and the
  prompt alone (a sequence ending at a branch point);
- each sequence alone in its own micro-batch: a chain, whose interval mask is the causal mask
  and whose depths are the slot indices, with every tree attention module on the ``"dense"``
  reference backend (SDPA on the materialised mask).

Both give every sequence's next-token log-probs; they agree to rounding error exactly when the
tree path is right for this model: mask, per-token RoPE (RoPE by packed index is wrong only in
the first pass), log-prob slots and labels at branch points, the vocab-parallel gather, the
pipeline, and the model's attention kernel (against the dense reference). Then one backward of
the same weighted log-prob loss in each packing: the parameter gradients agree exactly when the
backward is right too (a kernel with a wrong dQ passes the forward check and fails this one). The
test suite also compares with Hugging Face.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import get_model_config

from megatron_tree.mcore.core_attention import TreeCoreAttention
from megatron_tree.core.microbatch_spec import MicroBatchSpec
from megatron_tree.mcore.model_check import check_tree_model
from megatron_tree.core.packing import build_micro_batch, pack_trees
from megatron_tree.mcore.schedule import tree_forward_backward

__all__ = ["TreeModelReport", "verify_tree_model"]

# Unit roundoff u of the precision the model's matmuls run in.
_UNIT_ROUNDOFF = {"fp32": 2.0**-24, "tf32": 2.0**-11, "fp16": 2.0**-11, "bf16": 2.0**-8}
# K in the tolerance K * u * max(1, max |log-prob|). In fp32 the error is the rounding of the
# logits and log-probs themselves: measured <= 5 u |log-prob| on the tiny test models (Qwen3, Llama,
# Qwen3-MoE). In TF32 / bf16 / fp16 the rounding of every layer's activations dominates, and is
# smaller per unit of u: measured <= 0.6 u |log-prob| in bf16. K leaves ~7x headroom over both.
_ROUNDOFF_MULTIPLE = {"fp32": 32, "tf32": 4, "fp16": 4, "bf16": 4}
# Gradients: relative error of the parameter gradients, ||g_tree - g_seq|| / ||g_seq|| over each
# tensor, at most _GRAD_MULTIPLE * u. Measured on the tiny test models (Qwen3, Llama, Qwen3-MoE, CPU):
# <= 1.3e-6 in fp32 (21 u), <= 1.7e-2 in bf16 (4.3 u). A dQ off by 30% moves them by 0.14 - 0.41.
_GRAD_MULTIPLE = {"fp32": 256, "tf32": 16, "fp16": 16, "bf16": 16}


def _tolerance(precision: str, logprob_scale: float) -> float:
    """Absolute log-prob tolerance for ``precision`` when log-probs reach ``-logprob_scale``."""
    return _ROUNDOFF_MULTIPLE[precision] * _UNIT_ROUNDOFF[precision] * max(1.0, logprob_scale)


@dataclass(frozen=True)
class TreeModelReport:
    """What :func:`verify_tree_model` saw.

    max_error       largest |tree - per-sequence| log-prob over all targets (same on every rank).
    tolerance       the bound it was held to.
    grad_error      largest relative error ``||g_tree - g_seq|| / ||g_seq||`` of a parameter gradient
                    (over every parameter tensor of every rank); None with ``check_gradients=False``.
    grad_tolerance  the bound it was held to.
    grad_parameter  the parameter of ``grad_error`` (its name on the rank that holds it).
    precision       "fp32", "tf32" (fp32 with TF32 matmuls), "bf16" or "fp16".
    targets         next-token log-probs compared.
    tree_tokens     unique tokens of the packed trees (vs ``original_tokens`` run one by one).
    """

    max_error: float
    tolerance: float
    precision: str
    targets: int
    tree_tokens: int
    original_tokens: int
    grad_error: float | None = None
    grad_tolerance: float | None = None
    grad_parameter: str = ""

    @property
    def ok(self) -> bool:
        """True when both errors are within their tolerances."""
        return self.max_error <= self.tolerance and (self.grad_error is None or self.grad_error <= self.grad_tolerance)

    def __str__(self) -> str:
        def verdict(ok):
            return "<=" if ok else "> (FAILED)"

        text = (
            f"tree vs per-sequence max |dlogprob| {self.max_error:.3g} {verdict(self.max_error <= self.tolerance)} "
            f"tolerance {self.tolerance:.3g}"
        )
        if self.grad_error is not None:
            text += (
                f", max grad rel err {self.grad_error:.3g} {verdict(self.grad_error <= self.grad_tolerance)} "
                f"tolerance {self.grad_tolerance:.3g} ({self.grad_parameter})"
            )
        return (
            f"{text} ({self.precision}, {self.targets} targets, {self.tree_tokens} tree tokens for "
            f"{self.original_tokens})"
        )


def _gpt_model(chunk: torch.nn.Module) -> GPTModel:
    return next(m for m in chunk.modules() if isinstance(m, GPTModel))  # check_tree_model found one


def _precision(chunks: Sequence[torch.nn.Module]) -> str:
    config = get_model_config(chunks[0])
    if config.bf16:
        return "bf16"
    if config.fp16:
        return "fp16"
    param = next(chunks[0].parameters())
    if param.dtype != torch.float32:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[param.dtype]
    if param.is_cuda and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0":
        # Transformer Engine's fp32 GEMMs use TF32 unless NVIDIA_TF32_OVERRIDE=0.
        te = any(type(m).__module__.startswith("transformer_engine") for c in chunks for m in c.modules())
        if te or torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
    return "fp32"


def _branching_sequences(vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """Ten sequences over tokens ``< vocab_size`` (>= 4): per prompt (6 tokens), ``prompt+[0]+2``,
    ``prompt+[1]+11``, ``prompt+[2]+9`` twice and the prompt alone. Tokens 0..2 sort before the
    prompts' tokens (3..vocab_size-1), so the long branches are laid out after a sibling."""
    if vocab_size < 4:
        raise ValueError(f"verify_tree_model needs a vocabulary of at least 4 tokens, got {vocab_size}")
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=gen).tolist()

    seqs = []
    for _ in range(2):
        prompt = rand(6)
        long_branch = prompt + [2] + rand(9)
        seqs += [prompt + [0] + rand(2), prompt + [1] + rand(11), long_branch, long_branch, prompt]
    return [np.array(s, dtype=np.int64) for s in seqs]


def _logprobs(chunks, mbs) -> dict[int, torch.Tensor]:
    """``{sequence id: log-probs [len - 1]}`` of ``mbs`` (filled on the last pipeline stage only)."""
    out: dict[int, torch.Tensor] = {}

    def keep(logprobs: torch.Tensor, mb):
        cu = mb.cu_targets.tolist()
        for k, sid in enumerate(mb.sequence_ids):
            out[sid] = logprobs[cu[k] : cu[k + 1]].float()
        return logprobs.sum(), logprobs.numel()

    tree_forward_backward(chunks if len(chunks) > 1 else chunks[0], mbs, keep, forward_only=True)
    return out


@contextlib.contextmanager
def _reference_attention(chunks):
    """Every tree attention module of ``chunks`` on the ``"dense"`` backend inside the block."""
    modules = [m for c in chunks for m in c.modules() if isinstance(m, TreeCoreAttention)]
    saved = [m.backend for m in modules]
    try:
        for m in modules:
            m.backend = "dense"
        yield
    finally:
        for m, backend in zip(modules, saved):
            m.backend = backend


def _zero_gradients(chunks) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):  # Megatron's DDP: param.main_grad lives in its buffers
            chunk.zero_grad_buffer()
        for param in chunk.parameters():
            param.grad = None


def _gradients(chunks, mbs, weights: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{name: gradient}`` of ``sum_seq sum_t weights[seq][t] * logprob[seq][t]`` over ``mbs``: local sums
    (no data-parallel reduction, no division), copied; the gradients are zero again afterwards."""
    config = get_model_config(chunks[0])

    def weighted(logprobs: torch.Tensor, mb):
        cu = mb.cu_targets.tolist()
        w = torch.cat([weights[sid] for sid in mb.sequence_ids]).to(logprobs.device)
        assert w.numel() == cu[-1] == logprobs.numel()
        return (logprobs * w).sum(), logprobs.numel()

    _zero_gradients(chunks)
    saved = config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func
    config.finalize_model_grads_func = lambda *args, **kwargs: None  # keep the local sums
    # the no_sync() below holds for every micro-batch: an overlapping DDP neither starts a reduction nor counts this
    # backward's gradients as a training step's (it learns from the first step when a bucket is complete)
    config.no_sync_func, config.grad_sync_func = contextlib.nullcontext, None
    try:
        with contextlib.ExitStack() as stack:
            for chunk in chunks:  # Megatron's DDP reduces nothing inside no_sync()
                if hasattr(chunk, "no_sync"):
                    stack.enter_context(chunk.no_sync())
            tree_forward_backward(chunks if len(chunks) > 1 else chunks[0], mbs, weighted)
    finally:
        config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func = saved
    grads = {}
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads[f"{i}.{name}" if len(chunks) > 1 else name] = grad.detach().float().clone()
    _zero_gradients(chunks)
    return grads


def _worst_relative_error(tree: dict[str, torch.Tensor], chain: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest ``||a - b|| / ||b||`` over the parameters with a gradient in either pass (NaN counts as inf)."""
    worst, where = 0.0, ""
    for name in sorted(set(tree) | set(chain)):
        a, b = tree.get(name), chain.get(name)
        if a is None or b is None:
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
        ref = b.norm().item()
        diff = (a - b).norm().item()
        if ref == 0.0 and diff == 0.0:
            continue
        err = diff / ref if ref > 0.0 else float("inf")
        err = float("inf") if err != err else err
        if err > worst or not where:
            worst, where = err, name
    return worst, where


def verify_tree_model(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    atol: float | None = None,
    grad_rtol: float | None = None,
    check_gradients: bool = True,
    seed: int = 0,
    raise_on_mismatch: bool = True,
) -> TreeModelReport:
    """Check once that ``model`` gives the same log-probs, and the same parameter gradients, on
    tree micro-batches as on each sequence alone; returns a :class:`TreeModelReport`.

    ``model``: the model chunks of this rank as built for training (``get_model`` / ``build_tree_model``),
    called on every rank of the job (every pipeline stage and TP rank takes part; parallel state
    initialised). The model runs in eval mode under ``no_grad``; each module's training flag is
    restored. Tokens are drawn below the model's ``vocab_size`` (``seed``).
    ``atol`` (absolute, on log-probs) defaults to ``K * u * max(1, max |log-prob|)``, u the unit
    roundoff of the model's matmul precision, K = 32 in fp32 and 4 in TF32, bf16 and fp16: on
    the tiny test models (log-probs down to about -7) 1.3e-5 in fp32, 0.11 in bf16, 0.014 in
    TF32 (``torch.backends.cuda.matmul.allow_tf32``, or Transformer Engine's fp32 GEMMs without
    ``NVIDIA_TF32_OVERRIDE=0``) and fp16. Low precision catches gross errors only (an ignored
    mask; RoPE by packed index on a model sensitive to it); the sharp check is fp32.
    Gradients (``check_gradients``, default on): one backward, in eval mode, of
    ``sum w * logprob`` (fixed random weights per target) in each packing; every parameter
    tensor's relative error ``||g_tree - g_seq|| / ||g_seq||`` must be at most ``grad_rtol``,
    default ``K * u`` with K = 256 in fp32 (1.5e-5: measured <= 1.3e-6 on the tiny models)
    and 16 in TF32, bf16 and fp16 (6.3e-2 in bf16: measured <= 1.7e-2; a dQ off by 30% gives 0.14 - 0.41).
    The per-sequence passes run on the ``"dense"`` reference attention, so both checks also hold
    the model's attention kernel against an independent one. This zeroes the model's
    gradients (as the start of a Megatron step does) and holds one copy of them while it compares:
    call it before a step, not between a backward and ``optimizer.step()``.
    First :func:`~megatron_tree.mcore.model_check.check_tree_model` (a ``ValueError`` naming the
    offending module); then, unless ``raise_on_mismatch=False``, a ``RuntimeError`` when an
    error exceeds its tolerance, on every rank alike.
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    check_tree_model(chunks)
    config = get_model_config(chunks[0])
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    group = (config.microbatch_group_size_per_vp_stage or pp) if len(chunks) > 1 else 1
    seqs = _branching_sequences(_gpt_model(chunks[0]).vocab_size, seed)
    lengths = [len(s) for s in seqs]
    tree_mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=sum(lengths), n_mbs=group, n_mbs_divisor=group))
    chain_mbs = [build_micro_batch(seqs, [i]) for i in range(len(seqs))]
    chain_mbs += [build_micro_batch(seqs, [])] * (-len(chain_mbs) % group)

    gen = torch.Generator().manual_seed(seed + 1)
    weights = {sid: torch.randn(n - 1, generator=gen) for sid, n in enumerate(lengths)}
    training = [(m, m.training) for c in chunks for m in c.modules()]
    grad_error, where = None, ""
    try:
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            tree = _logprobs(chunks, tree_mbs)
            with _reference_attention(chunks):
                chain = _logprobs(chunks, chain_mbs)
        if check_gradients:
            tree_grads = _gradients(chunks, tree_mbs, weights)
            with _reference_attention(chunks):
                chain_grads = _gradients(chunks, chain_mbs, weights)
            grad_error, where = _worst_relative_error(tree_grads, chain_grads)
    finally:
        for module, flag in training:
            module.training = flag

    device = next(chunks[0].parameters()).device
    # [max |tree - chain|, max |chain|]; only the last pipeline stage saw log-probs.
    seen = torch.tensor(
        [max(((tree[k] - chain[k]).abs().max().item() for k in chain), default=0.0),
         max((chain[k].abs().max().item() for k in chain), default=0.0)],
        dtype=torch.float64,
        device=device,
    )
    local_grad_error = -1.0 if grad_error is None else grad_error
    seen = torch.cat([seen, torch.tensor([local_grad_error], dtype=torch.float64, device=device)])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
    error, scale, grad_error = seen.tolist()
    if check_gradients and local_grad_error != grad_error:
        where = "on another rank"
    precision = _precision(chunks)
    report = TreeModelReport(
        max_error=error,
        tolerance=_tolerance(precision, scale) if atol is None else float(atol),
        precision=precision,
        targets=sum(n - 1 for n in lengths),
        tree_tokens=sum(mb.num_tokens for mb in tree_mbs),
        original_tokens=sum(lengths),
        grad_error=grad_error if check_gradients else None,
        grad_tolerance=(_GRAD_MULTIPLE[precision] * _UNIT_ROUNDOFF[precision] if grad_rtol is None else float(grad_rtol))
        if check_gradients else None,
        grad_parameter=where,
    )
    if raise_on_mismatch and not report.ok:
        raise RuntimeError(
            f"verify_tree_model: {report}. The tree path of this model is not exact: look for RoPE "
            f"rotating by packed slot index instead of position_ids (a custom rotary module, or RoPE "
            f"applied inside a custom attention), an attention that ignores the interval mask or whose "
            f"backward is wrong on this shape (try attention backend 'dense'), or log-probs not read through "
            f"gather_tree_logprobs; pass atol= / grad_rtol= only if the error is rounding"
        )
    return report

"""Megatron's data-parallel machinery for tree training: the distributed optimizer and overlapped communication.

megatron-core's ``DistributedDataParallel`` (DDP) keeps every gradient in contiguous buckets and reduces them over
data-parallel ranks in ``finish_grad_sync`` (called by ``finalize_model_grads`` after the schedule's last backward).
Its ``DistributedDataParallelConfig`` chooses how:

- ``use_distributed_optimizer``: the buckets are reduce-*scattered* (each rank keeps the sum of its shard), the
  optimizer (``OptimizerConfig(use_distributed_optimizer=True)``: ``DistributedOptimizer``) updates only that shard
  and all-gathers the weights after its step (ZeRO-1). The DDP wrap and the optimizer must agree on it: a sharded
  reduction under a whole-model optimizer updates every weight outside the rank's shard with an unreduced gradient,
  silently (:func:`check_optimizer_fits`).
- ``overlap_grad_reduce``: a bucket's collective starts, asynchronously, as soon as the last micro-batch's backward
  has produced all its gradients. The schedule must tell DDP which backward is the last: ``config.no_sync_func``
  (DDP's ``no_sync``) is entered for the others (:func:`configure_grad_sync`, as Megatron-LM's training loop sets it;
  ``tree_forward_backward`` calls it).
- ``overlap_param_gather`` (with both above): the weights' all-gather after the optimizer step is deferred to the
  next forward, bucket by bucket (DDP's forward pre-hooks). Weights read outside a forward (a checkpoint, an
  export) are then stale on the shards other ranks updated until :func:`sync_params` has run.

None of this changes the numbers: per-token normalisation (``finalize_model_grads``'s ``num_tokens``) divides the
reduced gradients by the global count whichever collective reduced them, so a run with the distributed optimizer
gives the losses and gradient norms of a run without (to fp32 summation order).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

__all__ = ["check_optimizer_fits", "configure_grad_sync", "ddp_config", "describe", "sync_params"]

_log = logging.getLogger(__name__)


def ddp_config(
    *,
    use_distributed_optimizer: bool = False,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    bucket_size: int | None = None,
) -> dict[str, Any]:
    """Keywords of megatron-core's ``DistributedDataParallelConfig`` for a tree model
    (``build_tree_model(..., wrap_with_ddp=True, ddp_config=ddp_config(...))`` or mbridge's
    ``bridge.get_model``): gradients reduced in fp32, the given choices (module docstring). ``bucket_size``
    (parameters per bucket) applies with ``overlap_grad_reduce`` only. ``ValueError`` for the combinations
    Megatron-LM refuses."""
    if overlap_param_gather and not use_distributed_optimizer:
        raise ValueError("overlap_param_gather needs use_distributed_optimizer=True: it all-gathers the weights "
                         "the distributed optimizer updated in shards")
    if overlap_param_gather and not overlap_grad_reduce:
        raise ValueError("overlap_param_gather needs overlap_grad_reduce=True, as in Megatron-LM")
    if bucket_size is not None and not overlap_grad_reduce:
        raise ValueError(f"bucket_size={bucket_size} applies to an overlapped gradient reduction only; set "
                         f"overlap_grad_reduce=True or bucket_size=None")
    config = dict(grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer,
                  overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather)
    if bucket_size is not None:
        config["bucket_size"] = bucket_size
    return config


def _ddp_configs(chunks: Sequence[torch.nn.Module]) -> list:
    """Each chunk's ``DistributedDataParallelConfig`` (None for a chunk not wrapped in Megatron's DDP)."""
    return [getattr(chunk, "ddp_config", None) if hasattr(chunk, "finish_grad_sync") else None for chunk in chunks]


def check_optimizer_fits(chunks: Sequence[torch.nn.Module], use_distributed_optimizer: bool) -> None:
    """``ValueError`` (one line) unless ``chunks`` are wrapped in Megatron's DDP with the same
    ``use_distributed_optimizer`` as the optimizer about to be built over them (``get_megatron_optimizer``
    checks neither: the distributed optimizer needs DDP's buffers, and a whole-model optimizer over
    reduce-scattered gradients trains on wrong ones without an error)."""
    configs = _ddp_configs(chunks)
    if use_distributed_optimizer and any(c is None for c in configs):
        raise ValueError("the distributed optimizer shards megatron-core DDP's gradient buffers, but the model is not "
                         "wrapped in Megatron's DistributedDataParallel; build it with wrap_with_ddp=True and "
                         "ddp_config=ddp_config(use_distributed_optimizer=True)")
    wrapped = {bool(c.use_distributed_optimizer) for c in configs if c is not None}
    if wrapped and wrapped != {use_distributed_optimizer}:
        if use_distributed_optimizer:
            raise ValueError("OptimizerConfig(use_distributed_optimizer=True) over a model whose DDP all-reduces whole "
                             "gradients (its ddp_config has use_distributed_optimizer=False); wrap it with "
                             "ddp_config(use_distributed_optimizer=True)")
        raise ValueError("the model's DDP reduce-scatters its gradients for a distributed optimizer (ddp_config "
                         "use_distributed_optimizer=True: mbridge's default) but the optimizer is not one; pass "
                         "OptimizerConfig(use_distributed_optimizer=True), or wrap with use_distributed_optimizer=False")


def configure_grad_sync(chunks: Sequence[torch.nn.Module]) -> None:
    """Set the model config's ``no_sync_func`` / ``grad_sync_func`` for chunks whose DDP overlaps the gradient
    reduction, as Megatron-LM's training loop does (per chunk; a single function for one chunk): the schedule
    then enters DDP's ``no_sync`` for every micro-batch but the last, and under pipeline parallel starts each
    chunk's reduction when its last backward is done. Functions already set are kept (a user's own). No-op
    without ``overlap_grad_reduce``. ``param_sync_func`` stays unset: DDP's forward pre-hooks gather the
    weights (``overlap_param_gather``), Megatron-LM's choice whenever ``align_param_gather`` is off."""
    from megatron.core.utils import get_model_config

    configs = _ddp_configs(chunks)
    if not any(c is not None and c.overlap_grad_reduce for c in configs):
        return
    config = get_model_config(chunks[0])
    if config.no_sync_func is not None:
        return
    no_sync = [chunk.no_sync for chunk in chunks]
    grad_sync = [chunk.start_grad_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
    config.grad_sync_func = grad_sync[0] if len(chunks) == 1 else grad_sync
    _log.info("overlap_grad_reduce: config.no_sync_func and grad_sync_func set to the DDP chunks' no_sync and "
              "start_grad_sync, as Megatron's training loop does")


def sync_params(chunks: Sequence[torch.nn.Module]) -> None:
    """Finish the weights' all-gather now where DDP defers it to the next forward (``overlap_param_gather``),
    so that every rank holds the whole updated model: call before reading weights outside a forward (a
    checkpoint, an export, a copy). No-op otherwise (the distributed optimizer's step gathers them itself)."""
    for chunk, config in zip(chunks, _ddp_configs(chunks)):
        if config is not None and config.use_distributed_optimizer and config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def describe(chunks: Sequence[torch.nn.Module]) -> str | None:
    """One line on how the DDP chunks reduce gradients and gather weights (None for plain all-reduce)."""
    configs = [c for c in _ddp_configs(chunks) if c is not None]
    if not configs or not any(c.use_distributed_optimizer or c.overlap_grad_reduce for c in configs):
        return None
    from megatron.core import parallel_state

    c = configs[0]
    buckets = sum(len(buffer.buckets) for chunk in chunks for buffer in getattr(chunk, "buffers", []))
    parts = []
    if c.use_distributed_optimizer:
        parts.append(f"distributed optimizer (state sharded over {parallel_state.get_data_parallel_world_size()} "
                     f"data-parallel rank(s))")
    if c.overlap_grad_reduce:
        parts.append(f"gradient reduction overlapped with the backward in {buckets} bucket(s)")
    if c.overlap_param_gather:
        parts.append("weight all-gather overlapped with the next forward")
    return "data parallel: " + ", ".join(parts)

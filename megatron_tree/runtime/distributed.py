"""The one distributed set-up: ``torch.distributed`` plus megatron-core's model-parallel groups.

Used by the launcher, the examples, the benchmarks and the tests. Under ``torchrun`` (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) it joins that job; otherwise it starts a
one-process group on a free local port. gloo without CUDA (models then run in
:func:`megatron_tree.runtime.cpu_mode`), NCCL with one GPU per local rank.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from typing import Any

import torch

from megatron_tree.runtime.cpu import cpu_mode

__all__ = ["destroy_distributed", "init_cpu_distributed", "init_distributed"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _bind_gpu() -> None:
    """Set this process's GPU to its ``LOCAL_RANK``; a clear error when the host has fewer GPUs than local ranks."""
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if local_rank >= gpus:
        ranks = os.environ.get("LOCAL_WORLD_SIZE", "more")
        raise RuntimeError(
            f"this host has {gpus} GPU(s) but torchrun started {ranks} processes on it (this one is local rank "
            f"{local_rank}); NCCL needs one GPU per process: launch at most {gpus} per node "
            f"(torchrun --nproc-per-node {gpus}), or run all of them on the CPU over gloo with CUDA_VISIBLE_DEVICES="
        )
    torch.cuda.set_device(local_rank)


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    vpp: int | None = None,
    *,
    cp: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    backend: str | None = None,
    timeout_minutes: float | None = None,
) -> None:
    """Initialise ``torch.distributed`` and megatron-core model parallelism.

    ``backend`` None: NCCL when CUDA is available (each process on the GPU of its ``LOCAL_RANK``),
    else gloo. An existing process group is reused. Megatron's parallel state is (re)initialised
    with tensor parallel ``tp``, pipeline parallel ``pp``, expert parallel ``ep``, virtual pipeline
    ``vpp`` (None = no interleaving), context parallel ``cp`` (data parallel = world /
    (tp * pp * cp)) and expert tensor parallel ``etp`` (None: megatron-core's default, ``tp``); the
    model-parallel RNG tracker is seeded with ``seed``. ``timeout_minutes``: how long a collective may
    wait before it fails (a hung or dead rank then ends the job; megatron-core's process groups get it
    rounded up to whole minutes); None keeps torch's and megatron-core's default (30 minutes).
    """
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        _check_size(name, value)
    if timeout_minutes is not None and not (isinstance(timeout_minutes, (int, float)) and 0 < timeout_minutes < 1e6):
        raise ValueError(f"timeout_minutes must be a positive number of minutes, got {timeout_minutes!r}")
    timeout = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}
    if vpp is not None:
        _check_size("vpp", vpp)
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        _bind_gpu()
    if not dist.is_initialized():
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            dist.init_process_group(backend, **timeout)
        else:
            port = os.environ.get("MASTER_PORT") or _free_port()
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **timeout)
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tp * pp * cp = {tp} * {pp} * {cp}; "
            f"launch a multiple of {tp * pp * cp} processes (torchrun --nproc-per-node) or lower tp/pp/cp"
        )
    if (world // pp) % ep != 0:
        raise ValueError(f"expert parallel ep={ep} must divide world / pp = {world // pp}; lower ep")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
        expert_tensor_parallel_size=etp,
        **({} if timeout_minutes is None else {"distributed_timeout_minutes": math.ceil(timeout_minutes)}),
    )
    with cpu_mode():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_cpu_distributed(
    tp: int = 1, pp: int = 1, ep: int = 1, vpp: int | None = None, *, cp: int = 1, seed: int = 1234
) -> None:
    """:func:`init_distributed` over gloo (CPU tensors; on a GPU host the models still run on the GPU
    unless CUDA is hidden, ``CUDA_VISIBLE_DEVICES=``)."""
    init_distributed(tp, pp, ep, vpp, cp=cp, seed=seed, backend="gloo")


def destroy_distributed() -> None:
    """Tear down what :func:`init_distributed` set up (megatron parallel state, then the process group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

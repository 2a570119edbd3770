"""CPU mode: megatron-core and mbridge models on a machine without CUDA (tests, demos, the launcher's CPU runs).

megatron-core and mbridge hard-code CUDA (``torch.cuda.current_device()``, CUDA RNG state,
``.cuda()``, ``device="cuda"`` factories). :func:`cpu_mode` maps those to the CPU for the
duration of a ``with`` block; on a machine with CUDA it does nothing, so the same test or
demo code runs unchanged on GPUs. A typical CPU run::

    from megatron_tree import build_tree_model
    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.runtime import cpu_mode, init_distributed, save_tiny_hf_checkpoint

    with apply_compat_patches(), cpu_mode():
        init_distributed(tp=1)                        # gloo without CUDA; works alone or under torchrun
        path = save_tiny_hf_checkpoint("qwen3", tmp_dir)
        bridge, model = build_tree_model(path, wrap_with_ddp=False)   # CPU overrides applied
        logits = model[0](mb.input_ids, mb.position_ids, mb.attention_mask)   # [1, T, V/tp]

Keep the ``cpu_mode`` block open while the model runs: the shim is only active inside it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_tree.core.patching import AttrPatch, PatchScope

__all__ = ["cpu_mode"]


def _is_cuda_device(device: Any) -> bool:
    """True for anything naming a CUDA device: ``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an int ordinal."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to ``"cpu"`` in torch calls: the ``device=`` keyword of factories,
    the positional device of ``Tensor.to``, and ``pin_memory=True`` (needs CUDA)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


class _CpuStream:
    """What ``torch.cuda.current_stream()`` returns in CPU mode: a stream whose waits and syncs are no-ops
    (CPU work runs in program order, so there is nothing to wait for)."""

    device = torch.device("cpu")

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "<cpu_mode stream>"


_CPU_STREAM = _CpuStream()


def cpu_current_stream() -> list[AttrPatch]:
    """``torch.cuda.current_stream()`` -> a stream whose waits are no-ops (no CUDA only).

    Needed on machines without CUDA (a CPU build of torch, or CUDA hidden) by megatron-core 0.19
    (not 0.16): ``distributed/param_and_grad_buffer.py`` ``start_grad_sync`` reads
    ``torch.cuda.current_stream()`` unconditionally (to wait on CUDA-graph weight-gradient events), so every
    DDP gradient reduction (``finish_grad_sync`` from ``finalize_model_grads``, each training step) raises
    "No CUDA GPUs are available" / "Torch not compiled with CUDA enabled". No-op with CUDA; without it the
    original can only raise, so the stand-in changes nothing that worked, on any version. Streams made
    by megatron-core's overlap options (``torch.cuda.Stream``) are not stood in: the CPU overrides keep those off.
    """
    if torch.cuda.is_available():
        return []
    return [AttrPatch(torch.cuda, "current_stream", lambda device=None: _CPU_STREAM,
                      "no CUDA: megatron-core >= 0.19 gradient sync asks for the current stream")]


def _module_cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
    return self


def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
    return self


def _torch_cpu_patches() -> list[AttrPatch]:
    why = "no CUDA: CPU shim"
    patches = [
        # A device object, not the index 0: an int means cuda:0 wherever the device-rewriting
        # mode is not active (autograd runs backward outside it, e.g. megatron's all-gathers).
        AttrPatch(torch.cuda, "current_device", lambda: torch.device("cpu"), why),
        # megatron's p2p shape exchange (PP with variable_seq_lengths) synchronises the device.
        AttrPatch(torch.cuda, "synchronize", lambda device=None: None, why),
        AttrPatch(torch.nn.Module, "cuda", _module_cuda, why),
        AttrPatch(torch.Tensor, "cuda", _tensor_cuda, why),
    ]
    for namespace in (torch.cuda, torch.cuda.random):
        patches += [
            AttrPatch(namespace, "get_rng_state", _cpu_get_rng_state, why),
            AttrPatch(namespace, "set_rng_state", _cpu_set_rng_state, why),
            AttrPatch(namespace, "manual_seed", _cpu_manual_seed, why),
        ]
    return patches


def _mcore_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in for ``tensor_parallel.random._get_cuda_rng_state``: the CPU generator state."""
    return torch.get_rng_state()


def _mcore_set_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    """CPU stand-in for ``tensor_parallel.random._set_cuda_rng_state``: sets the CPU generator state."""
    torch.set_rng_state(new_state)


def cpu_rng_state() -> list[AttrPatch]:
    """Route megatron-core's private CUDA RNG-state helpers to the CPU generator (no CUDA only).

    Needed on machines without CUDA, every megatron-core version up to at least 0.19:
    the RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``)
    and activation recompute save/restore state through
    ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which index
    ``torch.cuda.default_generators``. On CPU, dropout and init draw from the CPU generator,
    so tracking that generator keeps the tracker's fork/restore semantics.
    """
    if torch.cuda.is_available():
        return []
    from megatron.core.tensor_parallel import random as tp_random

    why = "no CUDA: RNG tracker state lives in the CPU generator"
    return [
        AttrPatch(tp_random, "_get_cuda_rng_state", _mcore_get_rng_state, why),
        AttrPatch(tp_random, "_set_cuda_rng_state", _mcore_set_rng_state, why),
    ]


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """CPU stand-in for megatron-core's ``clip_grad_by_total_norm_fp32``: scale every gradient by
    ``max_norm / (total_norm + 1e-6)`` when that is below 1 (megatron-core asserts CUDA gradients)."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)


def cpu_gradient_clipping() -> list[AttrPatch]:
    """Megatron-core's gradient norm and clipping on the CPU (no CUDA only).

    Needed on machines without CUDA, megatron-core 0.16 - 0.19 at least: ``clip_grad_by_total_norm_fp32``
    asserts ``torch.cuda.FloatTensor`` gradients, and where Transformer Engine or Apex is installed (a CPU
    run on a GPU host) ``optimizer.clip_grads`` binds their CUDA multi-tensor kernels for the norm and the
    scaling. Routes both to megatron-core's own local (torch) implementations and a CPU scaling.
    """
    if torch.cuda.is_available():
        return []
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    why = "no CUDA: megatron-core's gradient clipping on the CPU"
    patches = [AttrPatch(optimizer, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32, why)]
    for name, local in (("multi_tensor_applier", utils.local_multi_tensor_applier),
                        ("l2_norm_impl", utils.local_multi_tensor_l2_norm),
                        ("multi_tensor_scale_impl", utils.local_multi_tensor_scale)):
        if getattr(clip_grads, name, local) is not local:
            patches.append(AttrPatch(clip_grads, name, local, why))
    return patches


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


class _CudaTypeNamesMode(TorchFunctionMode):
    """``Tensor.type()`` (no argument: the name) of a CPU float tensor gives the CUDA tensor type's name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(result, result)
        return result


def cpu_distributed_optimizer() -> list[AttrPatch]:
    """megatron-core's ``DistributedOptimizer`` over CPU parameters (no CUDA only).

    Needed on machines without CUDA, megatron-core 0.16 - 0.20 at least: ``DistributedOptimizer.
    _build_model_and_main_param_groups`` sorts the parameters by ``param.type()`` and refuses any but
    ``torch.cuda.{Float,Half,BFloat16}Tensor``. Runs it with ``Tensor.type()`` naming CPU float tensors as
    their CUDA types, inside that call only (everything else it does works on CPU tensors).
    """
    if torch.cuda.is_available():
        return []
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    name = "_build_model_and_main_param_groups"
    original = vars(DistributedOptimizer)[name].__func__  # a classmethod

    def build_groups(cls, *args, **kwargs):
        with _CudaTypeNamesMode():
            return original(cls, *args, **kwargs)

    return [AttrPatch(DistributedOptimizer, name, classmethod(build_groups),
                      "no CUDA: DistributedOptimizer accepts only torch.cuda.* parameter types")]


def _cpu_shim_patches() -> list[AttrPatch]:
    return (_torch_cpu_patches() + cpu_rng_state() + cpu_gradient_clipping() + cpu_distributed_optimizer()
            + cpu_current_stream())


_CPU_SCOPE = PatchScope(_cpu_shim_patches)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """Run megatron-core / mbridge code on the CPU inside the block; a no-op when CUDA is available.

    What it maps (reverted on exit, nesting-safe): ``torch.cuda.current_device() -> torch.device('cpu')``; ``torch.cuda.synchronize`` -> no-op;
    ``torch.cuda.get_rng_state / set_rng_state / manual_seed`` (also under
    ``torch.cuda.random``) -> the CPU generator; ``nn.Module.cuda`` and ``Tensor.cuda`` ->
    identity; megatron-core's ``tensor_parallel.random._get_cuda_rng_state /
    _set_cuda_rng_state`` -> the CPU generator (:func:`cpu_rng_state`); its gradient clipping -> the CPU
    (:func:`cpu_gradient_clipping`); its ``DistributedOptimizer`` over CPU parameters (:func:`cpu_distributed_optimizer`);
    ``torch.cuda.current_stream()`` -> a stream whose waits are no-ops
    where megatron-core's gradient sync asks for it (:func:`cpu_current_stream`);
    and, through a ``TorchFunctionMode`` active in this thread, CUDA devices in
    ``device=`` keywords and ``Tensor.to(device)`` -> ``"cpu"``. The mode is thread-local:
    code run by other threads inside the block sees no device rewriting.
    """
    if torch.cuda.is_available():
        yield
        return
    with _CPU_SCOPE.active(), _CudaToCpuMode():
        yield

"""CPU mode for tests and demos: tiny megatron-core models over gloo, without CUDA.

megatron-core and mbridge hard-code CUDA (``torch.cuda.current_device()``, CUDA RNG state,
``.cuda()``, ``device="cuda"`` factories). :func:`cpu_mode` maps those to the CPU for the
duration of a ``with`` block; on a machine with CUDA it does nothing, so the same test or
demo code runs unchanged on GPUs. A typical CPU run::

    from megatron_tree.patches import apply_compat_patches
    from megatron_tree.bridge import build_tree_model
    from megatron_tree.testing import cpu_mode, init_cpu_distributed, save_tiny_hf_checkpoint

    with apply_compat_patches(), cpu_mode():
        init_cpu_distributed(tp=1)                    # gloo; works alone or under torchrun
        path = save_tiny_hf_checkpoint("qwen3", tmp_dir)
        bridge, model = build_tree_model(path, wrap_with_ddp=False)   # CPU overrides applied
        logits = model[0](mb.input_ids, mb.position_ids, mb.attention_mask)   # [1, T, V/tp]

Keep the ``cpu_mode`` block open while the model runs: the shim is only active inside it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_tree.patches._attr import AttrPatch, PatchScope

TINY_ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe")


# --------------------------------------------------------------------------- CPU shim


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


def _cpu_shim_patches() -> list[AttrPatch]:
    from megatron_tree.patches.megatron_core import cpu_rng_state

    return _torch_cpu_patches() + cpu_rng_state()


_CPU_SCOPE = PatchScope(_cpu_shim_patches)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """Run megatron-core / mbridge code on the CPU inside the block; a no-op when CUDA is available.

    What it maps (reverted on exit, nesting-safe): ``torch.cuda.current_device() -> torch.device('cpu')``; ``torch.cuda.synchronize`` -> no-op;
    ``torch.cuda.get_rng_state / set_rng_state / manual_seed`` (also under
    ``torch.cuda.random``) -> the CPU generator; ``nn.Module.cuda`` and ``Tensor.cuda`` ->
    identity; megatron-core's ``tensor_parallel.random._get_cuda_rng_state /
    _set_cuda_rng_state`` -> the CPU generator (:func:`megatron_tree.patches.megatron_core.cpu_rng_state`);
    and, through a ``TorchFunctionMode`` active in this thread, CUDA devices in
    ``device=`` keywords and ``Tensor.to(device)`` -> ``"cpu"``. The mode is thread-local:
    code run by other threads inside the block sees no device rewriting.
    """
    if torch.cuda.is_available():
        yield
        return
    with _CPU_SCOPE.active(), _CudaToCpuMode():
        yield


# --------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def init_cpu_distributed(
    tp: int = 1, pp: int = 1, ep: int = 1, vpp: int | None = None, *, cp: int = 1, seed: int = 1234
) -> None:
    """Initialise gloo ``torch.distributed`` and megatron-core model parallelism for CPU runs.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) it joins that job;
    otherwise it starts a one-process group on a free local port. An existing process
    group is reused. Megatron's parallel state is (re)initialised with tensor parallel
    ``tp``, pipeline parallel ``pp``, expert parallel ``ep``, virtual pipeline
    ``vpp`` (None = no interleaving) and context parallel ``cp`` (data parallel = world /
    (tp * pp * cp)), then the model-
    parallel RNG tracker is seeded with ``seed`` under :func:`cpu_mode`.
    """
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        _check_size(name, value)
    if vpp is not None:
        _check_size("vpp", vpp)
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
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
    )
    with cpu_mode():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_cpu_distributed() -> None:
    """Tear down what :func:`init_cpu_distributed` set up (megatron parallel state, then the process group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- tiny models


def tiny_hf_config(arch: str, **overrides: Any):
    """The Hugging Face config of the tiny ``arch`` model (defaults as :func:`save_tiny_hf_checkpoint`),
    changed by ``overrides``. A key the config class does not define raises ``ValueError``
    naming the closest valid keys (HF config classes would store a typo silently)."""
    import difflib

    import transformers

    common: dict[str, Any] = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    per_arch: dict[str, tuple[str, dict[str, Any]]] = {
        "qwen3": ("Qwen3Config", dict(head_dim=16)),
        "qwen2": ("Qwen2Config", {}),
        "llama": ("LlamaConfig", dict(head_dim=16, attention_bias=False, mlp_bias=False)),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            dict(
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
        ),
    }
    if arch not in per_arch:
        raise ValueError(f"arch={arch!r} is not a tiny test architecture; use one of {TINY_ARCHS}")
    class_name, extra = per_arch[arch]
    config_class = getattr(transformers, class_name)
    valid = {*config_class().to_dict(), *config_class.attribute_map, *common, *extra}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        close = {key: difflib.get_close_matches(key, valid, n=1) for key in unknown}
        if all(close.values()):
            fix = "; ".join(f"did you mean {m[0]!r} for {key!r}?" for key, m in close.items())
        else:
            fix = f"valid keys: {sorted(k for k in valid if not k.startswith('_'))}"
        raise ValueError(f"unknown {class_name} key(s) {unknown} for arch={arch!r}; {fix}")
    return config_class(**{**common, **extra, **overrides})


def save_tiny_hf_checkpoint(arch: str, path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """Write a random tiny Hugging Face causal LM (fp32 safetensors + config) to ``path``; return ``path``.

    ``arch`` is one of ``"qwen3"`` (qk-norm), ``"qwen2"`` (qkv biases), ``"llama"``,
    ``"qwen3_moe"`` (4 experts, top-2, normalised top-k probs). Defaults: hidden 64,
    2 layers, 4 heads of dim 16, 2 KV heads (GQA), FFN 128 (expert FFN 32), vocab 160,
    RoPE theta 1e6, untied embeddings; ``overrides`` are passed to the HF config class.
    Every parameter is drawn from a ``seed``-ed generator, norm weights around 1 and
    biases non-zero, so a weight mapped to the wrong place changes the logits.

    Under ``torch.distributed`` only rank 0 writes; all ranks then meet at a barrier, so
    call it on every rank after :func:`init_cpu_distributed`.
    """
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, **overrides)
    path = os.fspath(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
                is_norm = param.ndim == 1 and "norm" in name
                param.copy_(1.0 + 0.2 * noise if is_norm else 0.1 * noise)
        model.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path


def save_hf_config(arch: str, path: str | os.PathLike, **overrides: Any) -> str:
    """Write only the HF ``config.json`` of ``arch`` (defaults as :func:`save_tiny_hf_checkpoint`,
    changed by ``overrides``) to ``path``; return ``path``. For models that Megatron initialises
    randomly (``AutoBridge.from_pretrained`` reads only the config). Rank 0 writes, then a barrier."""
    import torch.distributed as dist

    path = os.fspath(path)
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        tiny_hf_config(arch, **overrides).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path


def hf_reference_logits(hf_path: str | os.PathLike, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, S, V]`` fp32 of the HF model at ``hf_path`` (eval, causal) for ``input_ids`` ``[b, S]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.fspath(hf_path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits

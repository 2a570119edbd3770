"""One test command for every machine: on a GPU host the suite runs in two passes.

Pass 1, this pytest (and its xdist workers): every test as on a CPU-only machine. CUDA is hidden
(``CUDA_VISIBLE_DEVICES=""``, set before anything in this process initialises CUDA), so megatron-core,
mbridge and this package take their CPU paths (gloo, the local spec, fp32 without TF32) and compare
against CPU references exactly as CI does; ``gpu`` tests are skipped here.
Pass 2, a second pytest started when pass 1 ends, with CUDA visible: the ``gpu`` tests of the same
selection (the same arguments, ``-m "(<yours>) and gpu"``). The command fails if either pass fails.

Why not one pass: with a GPU visible, megatron-core builds the CPU tests' models on it (Transformer
Engine spec, TF32 GEMMs, CUDA tensors on a gloo group, CUDA RNG state), none of which those tests are
about; the GPU's share of the suite is the ``gpu`` tests.

Transformer Engine is hidden in pass 1 too (:func:`hide_transformer_engine`), in this process and every
process it starts (xdist workers, torchrun ranks, example scripts): CI has no TE, and with TE importable
megatron-core picks TE kernels by import (0.19: the MoE router GEMM, fused expert ops, TE norms), which
need CUDA and fail on CPU tensors. ``import transformer_engine`` raises ``ModuleNotFoundError`` there and
``importlib.util.find_spec`` answers None (``tests/cpu_pass/sitecustomize.py``, put first on
``PYTHONPATH``). The same happens in a run with ``CUDA_VISIBLE_DEVICES=""`` set by hand (pass 1 alone).
Pass 2 sees TE as installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

GPU_PASS_ENV = "MEGATRON_TREE_GPU_PASS"
"""Set in pass 2's environment (its conftest then neither probes nor hides CUDA)."""


@dataclass(frozen=True)
class GpuPass:
    """Pass 2 to run: the ``CUDA_VISIBLE_DEVICES`` value pass 1 hid (None: it was unset)."""

    visible_devices: str | None


def hide_cuda_for_pass_one() -> GpuPass | None:
    """On a GPU host, in the first pytest process: hide CUDA from this process and its children; the GPU
    pass to run at the end. None in pass 2, in xdist workers (they inherit the hidden CUDA) and where no
    GPU is visible. The probe runs in a fresh interpreter, so this process never initialises CUDA."""
    if os.environ.get(GPU_PASS_ENV) or os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return None
    import torch

    if torch.version.cuda is None:  # a CPU build of torch
        return None
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=300)
    if probe.stdout.strip().splitlines()[-1:] != ["True"]:
        return None
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before tests/conftest.py could hide it for the CPU pass; "
                           "run the suite with `python -m pytest tests` and no plugin that touches CUDA")
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return GpuPass(saved)


CPU_PASS_DIR = Path(__file__).resolve().with_name("cpu_pass")
"""Put first on ``PYTHONPATH`` in the CPU pass: its ``sitecustomize.py`` hides Transformer Engine at start-up."""

TRANSFORMER_ENGINE_MODULES = ("transformer_engine", "transformer_engine_torch")


def hide_transformer_engine() -> bool:
    """In the CPU pass (CUDA hidden, ``CUDA_VISIBLE_DEVICES=""``; not pass 2): make Transformer Engine
    unimportable in this process and in every process started from it, as on a CPU-only machine.
    Whether it did (False where CUDA is visible). Call it before anything imports TE (an xdist worker
    finds it done at start-up and only checks)."""
    if os.environ.get(GPU_PASS_ENV) or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        return False
    imported = [name for name in TRANSFORMER_ENGINE_MODULES if sys.modules.get(name) is not None]
    if imported:
        raise RuntimeError(f"{imported[0]} was imported before tests/conftest.py could hide it for the CPU pass; "
                           "run the suite with `python -m pytest tests` and no plugin that imports it")
    for name in TRANSFORMER_ENGINE_MODULES:
        sys.modules[name] = None  # import -> ModuleNotFoundError, find_spec -> None
    path = os.environ.get("PYTHONPATH", "")
    if str(CPU_PASS_DIR) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_PASS_DIR), path]))
    return True


def gpu_pass_args(args: Sequence[str], markexpr: str) -> list[str]:
    """Pass 2's pytest arguments: pass 1's, with its ``-m`` expression (``markexpr``) and-ed with ``gpu``.

    >>> gpu_pass_args(["-q", "tests", "-m", "not slow", "-n", "4"], "not slow")
    ['-q', 'tests', '-n', '4', '-m', '(not slow) and gpu']
    """
    out: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg == "-m":
            next(rest, None)
        elif not (arg.startswith("-m") and not arg.startswith("--")):
            out.append(arg)
    return [*out, "-m", f"({markexpr}) and gpu" if markexpr else "gpu"]


def gpu_pass_env(gpu_pass: GpuPass) -> dict[str, str]:
    """Pass 2's environment: this one with CUDA visible again and Transformer Engine no longer hidden."""
    env = {**os.environ, GPU_PASS_ENV: "1"}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(CPU_PASS_DIR)]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    else:
        env.pop("PYTHONPATH", None)
    if gpu_pass.visible_devices is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpu_pass.visible_devices
    return env


def run_gpu_pass(config, gpu_pass: GpuPass) -> int:
    """Run pass 2 (its output straight to the terminal); its exit code (5: no ``gpu`` test selected)."""
    env = gpu_pass_env(gpu_pass)
    cmd = [sys.executable, "-m", "pytest", *gpu_pass_args(config.invocation_params.args, config.option.markexpr)]
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n=== GPU pass (CUDA visible): {' '.join(cmd)}", flush=True)
        return subprocess.run(cmd, cwd=config.invocation_params.dir, env=env).returncode

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
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
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


def run_gpu_pass(config, gpu_pass: GpuPass) -> int:
    """Run pass 2 (its output straight to the terminal); its exit code (5: no ``gpu`` test selected)."""
    env = {**os.environ, GPU_PASS_ENV: "1"}
    if gpu_pass.visible_devices is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpu_pass.visible_devices
    cmd = [sys.executable, "-m", "pytest", *gpu_pass_args(config.invocation_params.args, config.option.markexpr)]
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n=== GPU pass (CUDA visible): {' '.join(cmd)}", flush=True)
        return subprocess.run(cmd, cwd=config.invocation_params.dir, env=env).returncode

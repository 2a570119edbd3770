"""Run a script under ``torchrun`` on this machine for multi-process (gloo) tests.

``run_torchrun(script, nproc)`` launches ``python -m torch.distributed.run --standalone
--nproc-per-node nproc script *args`` (``--standalone`` picks a free rendezvous port, so
concurrent launches do not collide), with the repository root and ``tests/`` on
``PYTHONPATH`` and one OpenMP thread per process, and fails the calling test with the
tail of the output when the script exits non-zero or runs past ``timeout`` seconds.

Subprocesses of the suite run on the CPU (:func:`cpu_env` hides CUDA): the multi-process
tests compare gloo runs on any machine, whatever its GPU count (one rank per GPU would need as
many GPUs as ranks); the GPU multi-process checks are ``benchmarks/gpu_te_checks.sh``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CURRENT_MARKERS: set[str] | None = None
"""The running test's markers (set by ``conftest.py``; None outside pytest)."""
TESTS_DIR = REPO_ROOT / "tests"


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess of the suite: CUDA hidden, one OpenMP thread, the repository
    root and ``tests/`` on ``PYTHONPATH``; ``extra`` on top."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": pythonpath, **extra}


def run_torchrun(
    script: str | os.PathLike, nproc: int, args: Sequence[str] = (), *, timeout: float = 300, tail: int = 6000
) -> str:
    """Run ``script`` with ``nproc`` processes; return its stdout + stderr (fails the test if it fails).

    ``script`` is a path (relative paths are taken from ``tests/``); ``args`` are passed
    to every process. Output of all ranks is interleaved in the returned string: torchrun runs its workers
    with ``python -u``, so ``print`` writes the text and its newline separately and one
    rank's line can end up glued to another's. Parse with patterns that do not rely on
    line boundaries (non-greedy, anchored on the rank's own fields).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    if CURRENT_MARKERS is not None and "multiprocess" not in CURRENT_MARKERS:
        pytest.fail("a test that starts processes (run_torchrun) needs @pytest.mark.multiprocess (tests/conftest.py)")
    path = Path(script)
    if not path.is_absolute():
        path = TESTS_DIR / path
    if not path.is_file():
        raise ValueError(f"script {str(path)!r} does not exist; pass a path to a python file")
    env = cpu_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(path), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{' '.join(cmd)} ran past {timeout}s; output tail:\n{out[-tail:]}")
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}; output tail:\n{output[-tail:]}")
    return output

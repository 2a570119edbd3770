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

import json
import os
import re
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
    script: str | os.PathLike, nproc: int, args: Sequence[str] = (), *, timeout: float = 300, tail: int = 6000,
    check: bool = True,
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
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}; output tail:\n{output[-tail:]}")
    return output


class TorchrunCases:
    """Cases of test scripts that run together: one ``torchrun`` job per process count
    (``scripts/run_cases.py``), started when a test first asks for one of them, holding every case of
    that count whose test is selected in this session. A process start costs ~7 s of CPU in imports.

    ``cases``: ``{case id: (test function name, nproc, script, argv)}``; ``script`` relative to ``tests/``
    (or absolute), ``argv`` may hold ``{tmp}``, replaced by a directory of the case's own.
    """

    _CASE = re.compile(r"CASE-BEGIN ([^;\s]+);")  # ranks' lines may run into each other

    def __init__(self, cases: dict[str, tuple[str, int, str, list[str]]], tmp: Path, *, timeout: float = 900):
        self.cases, self.tmp, self.timeout = cases, tmp, timeout
        self.outputs: dict[str, str] = {}

    def output(self, request: pytest.FixtureRequest, case: str) -> str:
        """The output of ``case`` (every rank's lines, from its ``CASE-BEGIN`` on); fails the test unless the
        case ended with status 0 on every rank."""
        nproc = self.cases[case][1]
        if case not in self.outputs:
            self._run(request, nproc, case)
        out = self.outputs[case]
        if out.count(f"CASE-END {case} rc=0;") != nproc:
            pytest.fail(f"case {case} did not end with status 0 on all {nproc} ranks; its output:\n{out[-6000:]}")
        return out

    def _run(self, request: pytest.FixtureRequest, nproc: int, asked: str) -> None:
        selected = {item.originalname for item in request.session.items if hasattr(item, "originalname")}
        batch = {
            case: [str(TESTS_DIR / script), *(a.replace("{tmp}", str(self.tmp / case)) for a in argv)]
            for case, (test, n, script, argv) in self.cases.items()
            if n == nproc and case not in self.outputs and (test in selected or case == asked)
        }
        out = run_torchrun("scripts/run_cases.py", nproc, [json.dumps(batch)], timeout=self.timeout, check=False)
        marks = [(m.start(), m.group(1)) for m in self._CASE.finditer(out)]
        for case in batch:
            starts = [i for i, c in marks if c == case]
            later = [i for i, c in marks if starts and i > starts[-1] and c != case]
            self.outputs[case] = out[starts[0]:later[0] if later else len(out)] if starts else out

"""Run scripts in processes of their own for the suite: multi-process (gloo) jobs as under ``torchrun``, and single
``python script`` / ``python -c`` runs.

``run_torchrun(script, nproc)`` runs what ``python -m torch.distributed.run --standalone --nproc-per-node nproc
script *args`` runs, with the repository root and ``tests/`` on ``PYTHONPATH`` and one OpenMP thread per process,
and fails the calling test with the tail of the output when the script exits non-zero or runs past ``timeout``
seconds. ``run_python(script, args)`` is one ``python script args`` (or ``code=``: ``python -c``).

Both run in forks of the session's fork server (``tests/fork_server.py``): a process that imported torch,
megatron-core, mbridge and transformers once, where every process would otherwise spend ~7 s of CPU importing them
(on the 2-core CI machine most of a small job). Each rank is still a fresh process with torchrun's environment;
``MEGATRON_TREE_TEST_FORK_SERVER=0`` runs every job through ``torchrun`` / ``python`` instead.

Subprocesses of the suite run on the CPU (:func:`cpu_env` hides CUDA): the multi-process
tests compare gloo runs on any machine, whatever its GPU count (one rank per GPU would need as
many GPUs as ranks); the GPU multi-process checks are ``benchmarks/gpu_te_checks.sh``.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import warnings
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
    return gpu_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)


def gpu_env(**extra: str) -> dict[str, str]:
    """The environment for a GPU test's subprocess: CUDA as the suite sees it, the repository root and ``tests/`` on
    ``PYTHONPATH``; ``extra`` on top."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, **extra}


def run_torchrun(
    script: str | os.PathLike, nproc: int, args: Sequence[str] = (), *, timeout: float = 300, tail: int = 6000,
    check: bool = True, fork: bool = True,
) -> str:
    """Run ``script`` with ``nproc`` processes; return its stdout + stderr (fails the test if it fails).

    ``script`` is a path (relative paths are taken from ``tests/``); ``args`` are passed
    to every process. Output of all ranks is interleaved in the returned string: torchrun runs its workers
    with ``python -u``, so ``print`` writes the text and its newline separately and one
    rank's line can end up glued to another's. Parse with patterns that do not rely on
    line boundaries (non-greedy, anchored on the rank's own fields). ``fork=False``: through ``torchrun`` itself,
    not the fork server.
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
    if fork and FORK_SERVER.usable():
        returncode, output, _, timed_out = FORK_SERVER.run(path, nproc, args, env, timeout)
        cmd.append("(its processes forked by tests/fork_server.py)")
        if timed_out:
            pytest.fail(f"{' '.join(cmd)} ran past {timeout}s; output tail:\n{output[-tail:]}")
    else:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            pytest.fail(f"{' '.join(cmd)} ran past {timeout}s; output tail:\n{out[-tail:]}")
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    if check and returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {returncode}; output tail:\n{output[-tail:]}")
    return output


def run_python(script: str | os.PathLike | None, args: Sequence[str] = (), *, code: str | None = None,
               cwd: str | os.PathLike = REPO_ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python script args`` (a path relative to the repository root) or ``python -c code``, one process in the
    suite's subprocess environment (:func:`cpu_env`), as ``subprocess.run(..., capture_output=True, text=True)``
    returns it; a fork of the session's fork server where there is one. Fails the test past ``timeout`` seconds."""
    env = cpu_env()
    path = None if script is None else (Path(script) if Path(script).is_absolute() else REPO_ROOT / script)
    cmd = [sys.executable, *(["-c", code] if code is not None else [str(path)]), *map(str, args)]
    if FORK_SERVER.usable():
        rc, out, err, timed_out = FORK_SERVER.run(path, None, args, env, timeout, code=code, cwd=Path(cwd), split=True)
        if timed_out:
            pytest.fail(f"{' '.join(cmd)} ran past {timeout}s; output tail:\n{(out + err)[-6000:]}")
        return subprocess.CompletedProcess(cmd, rc, out, err)
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout}s")


class _ForkServer:
    """The client of ``tests/fork_server.py``: one server per test session, started on the first job; jobs run there
    as under torchrun, each rank a fork of a process that has imported megatron-core once. Off with
    ``MEGATRON_TREE_TEST_FORK_SERVER=0`` (then every job is a real ``torchrun``), and where ``os.fork`` is missing."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.problem: str | None = None if hasattr(os, "fork") else "no os.fork on this platform"
        self.log = None

    def _off(self) -> bool:
        return os.environ.get("MEGATRON_TREE_TEST_FORK_SERVER", "1") == "0" or self.problem is not None

    def usable(self) -> bool:
        """Whether jobs run here (the server is started, and waited for, on the first ask)."""
        if self._off():
            return False
        self.start()
        if not self.ready:
            started, _, _ = select.select([self.proc.stdout], [], [], 600)
            line = self.proc.stdout.readline() if started else ""
            self.ready = line.startswith('{"ready"')
            if not self.ready:
                self.log.seek(0)
                self.problem = f"the fork server did not start: {self.log.read()[-2000:]}"
                self.proc.kill()
                warnings.warn(f"{self.problem}; running multi-process jobs through torchrun")
        return self.problem is None

    def start(self) -> None:
        """Start the server (its imports run in the background until the first job waits for them)."""
        if self.proc is not None or self._off():
            return
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fork_server_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(TESTS_DIR / "fork_server.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=cpu_env(), cwd=REPO_ROOT)

    def run(self, script: Path | None, nproc: int | None, args: Sequence, env: dict[str, str], timeout: float, *,
            code: str | None = None, cwd: Path = REPO_ROOT, split: bool = False) -> tuple[int, str, str, bool]:
        """(exit status, stdout, stderr, timed out) of the job: ``nproc`` ranks of ``script`` as under torchrun, or
        (``nproc`` None) one ``python script args`` / ``python -c code``. Without ``split`` the stderr of every
        process is in the first string, interleaved as written, and the second is empty."""
        with tempfile.TemporaryDirectory(prefix="job_") as tmp:
            out, err = Path(tmp, "out"), Path(tmp, "err")
            job = dict(script=None if script is None else str(script), code=code, args=list(map(str, args)),
                       nproc=nproc, env=env, cwd=str(cwd), out=str(out), err=str(err) if split else None,
                       timeout=timeout)
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            answered, _, _ = select.select([self.proc.stdout], [], [], timeout + 120)  # it ends jobs at ``timeout``
            reply = self.proc.stdout.readline() if answered else ""
            if not reply:
                self.proc.kill()
                self.log.seek(0)
                self.problem = f"the fork server died or hung: {self.log.read()[-2000:]}"
                pytest.fail(self.problem)
            result = json.loads(reply)
            return result["rc"], out.read_text(), err.read_text() if split else "", result["timed_out"]

    def close(self) -> None:
        """End the server (at the end of the session) and remove its log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.log is not None:
            self.log.close()
            os.unlink(self.log.name)


FORK_SERVER = _ForkServer()
atexit.register(FORK_SERVER.close)


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

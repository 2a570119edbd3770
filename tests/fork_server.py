"""A Python process that has imported torch, megatron-core, mbridge, transformers and megatron_tree once, and forks
the processes of the suite's multi-process jobs from that state (``dist_utils.run_torchrun``).

Each process of a job starts by importing those (~7 s of CPU on the CI machine, more than most jobs' own work); a
fork of this server starts with them imported. A job's processes are what ``torchrun --standalone
--nproc-per-node N script args`` starts, less its agent: fresh processes (one fork per rank), the job's
environment plus torchrun's rank variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` on a free port, ...), the script run as ``__main__`` with ``sys.argv``,
``sys.path[0]`` its folder, unbuffered output of all ranks into one file (as ``python -u``). As torchrun does, when
one rank fails the others are ended (SIGTERM, then SIGKILL), and the job's exit status is the first failure's.

Single processes too (``nproc`` null: ``python script args`` or ``python -c CODE``, no rank variables).

Protocol (one JSON object per line): the client writes ``{"script" or "code", "args", "nproc", "env", "cwd",
"out", "err" (optional: stderr apart), "timeout"}``; the server answers ``{"rc": int, "timed_out": bool}`` once the job has ended. Started by
``dist_utils`` with the suite's subprocess environment (CUDA hidden); it never runs a torch op itself, so it
holds no threads to lose in a fork.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback


def preload() -> None:
    """What every job's scripts import (nothing here touches CUDA or starts a thread)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import mbridge  # noqa: F401
    import megatron_tree  # noqa: F401
    import megatron_tree.mcore.schedule  # noqa: F401
    import megatron_tree.train.trainer  # noqa: F401


def _rank(job: dict, rank: int, port: int, out_fd: int, err_fd: int) -> None:
    """The body of one forked process; never returns."""
    rc = 1
    try:
        os.close(REPLY_FD)  # the protocol pipe is the server's alone (its client waits for the end of it)
        os.setpgid(0, 0)  # its own process group: ending the rank ends what it started
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.environ.clear()
        os.environ.update(job["env"])
        n = job["nproc"]
        if n is not None:  # torchrun's variables
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                              ROLE_NAME="default", WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), GROUP_WORLD_SIZE="1",
                              ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                              TORCHELASTIC_RUN_ID="fork_server")
        os.chdir(job["cwd"])
        try:
            if job.get("code") is not None:  # python -c CODE
                sys.argv = ["-c", *job["args"]]
                sys.path[0] = ""
                exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                script = job["script"]
                sys.argv = [script, *job["args"]]
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                runpy.run_path(script, run_name="__main__")
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int) and exc.code is not None:
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            rc = 1
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _end(pids: dict[int, int | None], sig: int) -> None:
    for pid, status in pids.items():
        if status is None:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass


def run_job(job: dict) -> dict:
    """Fork the job's ranks, wait for them (ending the rest when one fails, or all at the timeout)."""
    from megatron_tree.runtime.distributed import _free_port  # imported by preload()

    port = _free_port()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    out_fd = os.open(job["out"], flags, 0o644)
    err_fd = os.open(job["err"], flags, 0o644) if job.get("err") else out_fd
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int | None] = {}
    for rank in range(job["nproc"] or 1):
        pid = os.fork()
        if pid == 0:
            _rank(job, rank, port, out_fd, err_fd)
        pids[pid] = None
    os.close(out_fd)
    if err_fd != out_fd:
        os.close(err_fd)
    deadline = time.monotonic() + job["timeout"]
    first_failure, ending_since, timed_out = None, None, False
    while any(status is None for status in pids.values()):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            rc = os.waitstatus_to_exitcode(status)
            pids[pid] = rc
            if rc != 0 and first_failure is None:
                first_failure, ending_since = rc, time.monotonic()
                _end(pids, signal.SIGTERM)
            continue
        now = time.monotonic()
        if now > deadline and not timed_out:
            timed_out = True
            _end(pids, signal.SIGKILL)
        elif ending_since is not None and now - ending_since > 10:
            _end(pids, signal.SIGKILL)
        time.sleep(0.02)
    for pid in pids:  # whatever a rank left in its process group (helper processes)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return {"rc": -9 if timed_out else (first_failure or 0), "timed_out": timed_out}


REPLY_FD = -1
"""The protocol pipe's file descriptor in the server (its stdout moves there; fd 1 becomes its stderr, so that
nothing a library prints reaches the client as a reply)."""


def main() -> None:
    global REPLY_FD
    REPLY_FD = os.dup(1)
    os.dup2(2, 1)
    reply = os.fdopen(REPLY_FD, "w")
    preload()
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(run_job(json.loads(line))), file=reply, flush=True)


if __name__ == "__main__":
    main()

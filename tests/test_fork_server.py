"""The fork server (``tests/fork_server.py``) starts a job's processes as torchrun does: the same launcher
variables, argv, ``sys.path[0]`` and ``__main__``; a failed rank ends the job with its status; a job past its
timeout is ended. The comparison runs the probe both ways, so it fails if the fork server drifts from torchrun."""

import re
import time

import pytest
from dist_utils import FORK_SERVER, run_python, run_torchrun

pytestmark = pytest.mark.multiprocess


def _probes(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"PROBE rank=(\d+) (.*?) END", out)}


def test_ranks_see_what_torchrun_gives_them():
    if not FORK_SERVER.usable():
        pytest.skip(f"no fork server here: {FORK_SERVER.problem or 'MEGATRON_TREE_TEST_FORK_SERVER=0'}")
    args = ["a b", "x=1"]
    forked = _probes(run_torchrun("scripts/launch_probe.py", 2, args))
    real = _probes(run_torchrun("scripts/launch_probe.py", 2, args, fork=False))
    assert sorted(forked) == sorted(real) == [0, 1]
    assert forked == real
    assert '"MASTER_PORT"' in forked[0] and 'path0=scripts' in forked[0] and "main=__main__" in forked[0]


def test_a_failed_rank_ends_the_job_with_its_status():
    start = time.perf_counter()
    out = run_torchrun("scripts/launch_probe.py", 2, ["--fail-rank", "1"], check=False)
    assert sorted(_probes(out)) == [0, 1]
    assert time.perf_counter() - start < 60, "rank 0 was left waiting on its barrier"
    with pytest.raises(pytest.fail.Exception, match="exited with 5"):
        run_torchrun("scripts/launch_probe.py", 2, ["--fail-rank", "1"])


def test_a_job_past_its_timeout_is_ended():
    start = time.perf_counter()
    with pytest.raises(pytest.fail.Exception, match="ran past 3s"):
        run_torchrun("scripts/launch_probe.py", 2, ["--sleep", "100"], timeout=3)
    assert time.perf_counter() - start < 30


def test_single_processes_and_code():
    proc = run_python(None, code="import sys; print('out', sys.argv); print('err', file=sys.stderr); sys.exit(3)")
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out ['-c']\n", "err\n")
    proc = run_python("tests/scripts/launch_probe.py", ["--help"])
    assert proc.returncode == 0 and "--fail-rank" in proc.stdout

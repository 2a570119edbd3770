"""runtime.init_distributed's collective timeout: a hung rank ends the job in about the timeout, not torch's 30 minutes."""

from __future__ import annotations

import re
import time

import pytest
from dist_utils import run_torchrun

from megatron_tree.runtime import init_distributed


@pytest.mark.multiprocess
def test_a_hung_rank_ends_the_job_within_the_collective_timeout():
    start = time.perf_counter()
    out = run_torchrun("scripts/hung_rank.py", 2, ["0.05"], timeout=150, check=False)  # 3 s
    failed = re.search(r"rank0 failed after (\S+) s", out)
    assert failed and float(failed[1]) < 30, out[-3000:]
    assert time.perf_counter() - start < 120


@pytest.mark.parametrize("minutes", [0, -1, float("nan"), "10"])
def test_timeout_must_be_positive_minutes(minutes):
    with pytest.raises(ValueError, match="timeout_minutes must be a positive number of minutes"):
        init_distributed(timeout_minutes=minutes)

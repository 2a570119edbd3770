"""Run several cases of one test script in one ``torchrun`` job (the suite's batching: a process start
imports torch, megatron-core, mbridge and transformers, ~7 s of CPU each, more than most cases take).

    torchrun --nproc-per-node N tests/scripts/run_cases.py CASES_JSON

``CASES_JSON``: ``{"case id": [script, argv...], ...}``. Each case runs its script as ``__main__`` with that
argv in the same processes, one after the other: the process group lives across cases (the script's
``destroy_process_group`` is a no-op here; ``init_distributed`` reuses the group and rebuilds megatron's
parallel state). Every rank prints ``CASE-BEGIN id`` before a case and ``CASE-END id rc=N`` after it (N: its
exit status; 1 for an exception, whose traceback is printed), with a barrier between cases so each case's
output comes after its ``CASE-BEGIN`` lines. Exits 0 when every case did.
"""

from __future__ import annotations

import json
import runpy
import sys
import traceback

import torch.distributed as dist


def main() -> int:
    cases = json.loads(sys.argv[1])
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    failed = 0
    try:
        for case, (script, *argv) in cases.items():
            if dist.is_initialized():
                dist.barrier()
            print(f"CASE-BEGIN {case};", flush=True)
            sys.argv = [script, *argv]
            try:
                runpy.run_path(script, run_name="__main__")
                rc = 0
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            sys.stderr.flush()
            print(f"CASE-END {case} rc={rc};", flush=True)
            failed += rc != 0
    finally:
        dist.destroy_process_group = destroy
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

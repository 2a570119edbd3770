"""Two ranks, collective timeout ``sys.argv[1]`` minutes: rank 1 stops answering (sleeps), rank 0's barrier must
fail within about the timeout. Prints ``rank0 failed after S s: <error>`` (or ``rank0 passed``, a failure)."""

import sys
import time

import torch.distributed as dist

from megatron_tree.runtime import init_distributed

init_distributed(timeout_minutes=float(sys.argv[1]))
if dist.get_rank() == 1:
    time.sleep(120)  # a hung rank (torchrun ends it once rank 0 has failed)
else:
    start = time.perf_counter()
    try:
        dist.barrier()
    except Exception as error:  # gloo: "Timed out waiting ..." / "Connection closed by peer"
        print(f"rank0 failed after {time.perf_counter() - start:.1f} s: {type(error).__name__}: {str(error)[:200]}",
              flush=True)
        sys.exit(3)
    print("rank0 passed", flush=True)

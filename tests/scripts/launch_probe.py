"""What a launched process sees: prints ``PROBE rank=R env=<sorted launcher variables> argv=<argv[1:]> path0=<dir>``
and, with ``--fail-rank R``, exits 5 on rank R while the others wait on a barrier (a failed rank must end them);
``--sleep S``: every rank sleeps S seconds first."""

import argparse
import json
import os
import sys
import time

import torch.distributed as dist

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--sleep", type=float, default=0)
parser.add_argument("rest", nargs="*")
args = parser.parse_args()
time.sleep(args.sleep)
dist.init_process_group("gloo")
rank = dist.get_rank()
env = sorted(k for k in LAUNCH_VARS if k in os.environ)
print(f"PROBE rank={rank} env={json.dumps(env)} argv={json.dumps(sys.argv[1:])} "
      f"path0={os.path.basename(sys.path[0])} main={__name__} END", flush=True)
if args.fail_rank == rank:
    sys.exit(5)
if args.fail_rank is not None:
    time.sleep(120)  # only a launcher that ends the job when a rank fails gets past this quickly
dist.barrier()
dist.destroy_process_group()

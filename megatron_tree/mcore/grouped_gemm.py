"""Transformer Engine's CUTLASS grouped GEMM for the experts of MoE models on Hopper.

megatron-core's ``TEGroupedMLP`` runs the experts through TE's ``GroupedLinear``. By default TE issues one cuBLAS
GEMM per expert (on 4 streams), and each builds its cuBLASLt descriptors and asks cuBLASLt's heuristic for an
algorithm on the host, so a layer call costs ~2 ms of host time at 16 experts (cProfile of the 2B MoE multi-turn
step, one H200: ``te_general_grouped_gemm`` 487 ms of a 1.2 s step; ``benchmarks/results/te/e2e_moe_multi_turn_h200*``).
With ``NVTE_USE_CUTLASS_GROUPED_GEMM=1`` (TE >= 2.8, documented in TE's environment variables) TE runs every
expert's GEMM in one CUTLASS kernel where it can: SM 9.0, bf16 / fp16 operands and output, no bias, the reduction
dimension equal across experts and a multiple of 128 (the forward and the input gradient of experts whose hidden
and FFN sizes are multiples of 128; weight gradients, whose reduction runs over each expert's tokens, stay on
cuBLAS unless every expert has the same token count, a multiple of 128). Elsewhere it falls back to cuBLAS on its own. TE reads the variable at every grouped GEMM.

The kernel is checked against an fp64 reference on the expert shapes of ``tests/scripts/grouped_gemm_check.py``
(``tests/mcore/test_grouped_gemm_gpu.py``, TE 2.20.2 on an H100, bf16): the profiler saw it run wherever a reduction
dimension qualified and nowhere else, and its forward, input and weight gradient errors equal cuBLAS's on all 11
shapes (the same bits on 10). The 2B MoE training step at 32k-token micro-batches (H100): tree 426 -> 298 ms, flat
2805 -> 1900 ms (``benchmarks/results/te/e2e_moe_*_mb32k_*``).
"""

from __future__ import annotations

import os

import torch

__all__ = ["CUTLASS_GROUPED_GEMM_ENV", "cutlass_grouped_gemm_on", "use_cutlass_grouped_gemm"]

CUTLASS_GROUPED_GEMM_ENV = "NVTE_USE_CUTLASS_GROUPED_GEMM"


def use_cutlass_grouped_gemm(*, bf16: bool) -> bool:
    """Turn on TE's CUTLASS grouped GEMM in this process for a bf16 MoE model on a Hopper GPU (SM 9.0), unless
    ``NVTE_USE_CUTLASS_GROUPED_GEMM`` is already set (a user's ``=0`` keeps cuBLAS). Whether it is on afterwards.

    Process-wide: it sets the environment variable (every later ``GroupedLinear`` call of the process, the flat
    baseline's included, and the processes it starts). fp32 models never take the CUTLASS path (TE runs it for
    bf16 / fp16 only), so they leave the variable alone.
    """
    if CUTLASS_GROUPED_GEMM_ENV not in os.environ and bf16 and torch.cuda.is_available():
        if torch.cuda.get_device_capability() == (9, 0):
            os.environ[CUTLASS_GROUPED_GEMM_ENV] = "1"
    return cutlass_grouped_gemm_on()


def cutlass_grouped_gemm_on() -> bool:
    """Whether this process asks TE for its CUTLASS grouped GEMM (``NVTE_USE_CUTLASS_GROUPED_GEMM`` set, not to 0)."""
    return os.environ.get(CUTLASS_GROUPED_GEMM_ENV, "0") not in ("", "0")

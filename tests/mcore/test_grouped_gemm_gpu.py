"""Transformer Engine's CUTLASS grouped GEMM (``NVTE_USE_CUTLASS_GROUPED_GEMM=1``: every expert's GEMM of
megatron-core's ``TEGroupedMLP`` in one kernel on Hopper, instead of one cuBLAS GEMM per expert) against an fp64
reference and against TE's cuBLAS path, on one GPU: every expert shape of ``tests/scripts/grouped_gemm_check.py``
(forward output, input and weight gradients; experts without tokens), bf16. The CUTLASS results must be as close to
fp64 as cuBLAS's, and the profiler must see TE's CUTLASS kernel where TE should take that path (forward and input
gradient: every K a multiple of 128) and nowhere else (else this test checked nothing: on an H100 both paths gave the
same bits on the 2B shape). fp32 never takes it. The gate for turning the variable on for MoE
models (docs/results.md, "MoE steps are host-bound")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import gpu_env

pytestmark = pytest.mark.gpu

TESTS_DIR = Path(__file__).resolve().parents[1]


def _check(dtype: str, cutlass: bool) -> dict[str, dict]:
    env = gpu_env(NVTE_USE_CUTLASS_GROUPED_GEMM="1" if cutlass else "0", NVIDIA_TF32_OVERRIDE="0")
    proc = subprocess.run([sys.executable, str(TESTS_DIR / "scripts" / "grouped_gemm_check.py"), dtype],
                          capture_output=True, text=True, env=env, timeout=600, cwd=TESTS_DIR.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


def _needs_hopper_te():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU (SM 9.0): TE's CUTLASS grouped GEMM runs there only")
    from megatron_tree.core.platform import have_transformer_engine

    if not have_transformer_engine():
        pytest.skip("needs Transformer Engine")


def test_cutlass_grouped_gemm_is_as_exact_as_cublas_in_bf16():
    _needs_hopper_te()
    cublas, cutlass = _check("bf16", False), _check("bf16", True)
    assert cublas.keys() == cutlass.keys() and cublas
    for case, ref in cublas.items():
        row = cutlass[case]
        print(json.dumps({"case": case, **{f"{k}_cublas": ref[k] for k in ("out_err", "dgrad_err", "wgrad_err")},
                          **{f"{k}_cutlass": row[k] for k in ("out_err", "dgrad_err", "wgrad_err")},
                          "same_bits": ref["digest"] == row["digest"], "cutlass_launches": row["cutlass_launches"]}))
        for key in ("out_err", "dgrad_err", "wgrad_err"):
            assert row[key] <= max(1.5 * ref[key], ref[key] + 2e-3), (case, key, row[key], ref[key])
        assert ref["cutlass_launches"] == 0, f"{case}: CUTLASS ran with NVTE_USE_CUTLASS_GROUPED_GEMM=0"
        # The forward reduces over in_features, the input gradient over out_features: each needs K % 128 == 0.
        eligible = (ref["in"] % 128 == 0) + (ref["out"] % 128 == 0)
        assert (row["cutlass_launches"] >= eligible) and (row["cutlass_launches"] > 0) == (eligible > 0), (
            f"{case}: {row['cutlass_launches']} CUTLASS launches where {eligible} GEMMs of 3 qualify")


def test_fp32_never_takes_the_cutlass_path():
    _needs_hopper_te()
    cublas, cutlass = _check("fp32", False), _check("fp32", True)
    for case, ref in cublas.items():
        assert cutlass[case]["digest"] == ref["digest"], case
        assert cutlass[case]["cutlass_launches"] == 0, case
        assert max(ref["out_err"], ref["dgrad_err"], ref["wgrad_err"]) < 1e-5, ref

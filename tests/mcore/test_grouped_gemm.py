"""use_cutlass_grouped_gemm: TE's CUTLASS grouped GEMM turned on for bf16 MoE models on Hopper only, a user's
setting kept (the GPU check of the kernel: tests/mcore/test_grouped_gemm_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_tree.mcore.grouped_gemm import CUTLASS_GROUPED_GEMM_ENV, use_cutlass_grouped_gemm


@pytest.fixture
def gpu(monkeypatch):
    """Pretend a GPU of the given capability is visible; the variable starts unset."""
    monkeypatch.delenv(CUTLASS_GROUPED_GEMM_ENV, raising=False)

    def set_capability(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return set_capability


@pytest.mark.parametrize("capability, bf16, on", [((9, 0), True, True), ((9, 0), False, False), ((8, 0), True, False),
                                                  ((10, 0), True, False), (None, True, False)])
def test_on_for_bf16_on_hopper_only(gpu, capability, bf16, on):
    import os

    gpu(capability)
    assert use_cutlass_grouped_gemm(bf16=bf16) is on
    assert os.environ.get(CUTLASS_GROUPED_GEMM_ENV) == ("1" if on else None)


@pytest.mark.parametrize("value, on", [("0", False), ("1", True), ("", False)])
def test_a_users_setting_is_kept(gpu, monkeypatch, value, on):
    import os

    gpu((9, 0))
    monkeypatch.setenv(CUTLASS_GROUPED_GEMM_ENV, value)
    assert use_cutlass_grouped_gemm(bf16=True) is on
    assert os.environ[CUTLASS_GROUPED_GEMM_ENV] == value

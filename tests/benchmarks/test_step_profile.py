"""The step-time breakdown of benchmarks/step_profile.py accounts regions once and stays within the wall time."""

import time

import torch

from benchmarks.step_profile import OPTIMIZER_REGION, _busy_and_gaps, _category, profile_step
from megatron_tree.ops.logprobs import vocab_parallel_logprobs


def test_regions_and_busy_time_on_cpu():
    logits = torch.randn(256, 512, requires_grad=True)
    slots, labels = torch.randint(0, 256, (1024,)), torch.randint(0, 512, (1024,))
    opt = torch.optim.SGD([logits], lr=0.1)

    def step():
        vocab_parallel_logprobs(logits, slots, labels, chunk_rows=64).sum().backward()
        with torch.profiler.record_function(OPTIMIZER_REGION):
            opt.step()
        time.sleep(0.05)  # host-side time with no op running: wall, not busy

    out = profile_step(step)
    assert out["kernels_ms"] == {}  # no kernels on CPU
    regions = out["regions_ms"]
    assert regions["logprobs"] > 0 and regions["optimizer"] > 0
    assert regions["logprobs"] + regions["optimizer"] <= out["busy_ms"] <= out["wall_ms"] - 40


def test_union_and_categories():
    assert _busy_and_gaps([(0, 1000), (500, 1500), (3000, 4000), (3100, 3200)])[0] == 2.5
    assert _busy_and_gaps([(0, 1000), (500, 1500), (3000, 4000), (3100, 3200), (4500, 4600)])[1] == [
        (1500, 3000), (4000, 4500)]
    assert _category("triton_tem_fused_flex_attention_0") == "attention"
    assert _category("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_obj") == "attention"
    assert _category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert _category("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NTN") == "gemm"
    assert _category("triton_poi_fused_add_0") == "compiled_other"
    assert _category("elementwise_kernel<128, 4>") == "other"


def test_idle_attributed_to_the_host_op_running():
    from types import SimpleNamespace as NS

    from benchmarks.step_profile import _idle_by_host_op
    from torch.autograd import DeviceType

    def op(name, start, end, parent=None):
        return NS(name=name, device_type=DeviceType.CPU, time_range=NS(start=start, end=end), cpu_parent=parent)

    step = op("step", 0, 10_000)
    events = [step, op("aten::item", 1000, 2000, step), op("optimizer", 5000, 9000, step)]
    out, gaps = _idle_by_host_op(events, [(1200, 1800), (6000, 7000), (12_000, 13_000), (20_000, 32_000)])
    assert out["innermost"] == {"<none>": 13.0, "optimizer": 1.0, "aten::item": 0.6}
    assert out["outermost"] == {"<none>": 13.0, "step": 1.6}
    assert gaps["under_1ms"] == [1, 0.6] and gaps["1_to_10ms"] == [2, 2.0] and gaps["over_10ms"] == [1, 12.0]
    assert gaps["longest"][:2] == [[12.0, "<none>", "<none>"], [1.0, "optimizer", "step"]]


def test_gpu_user_annotations_are_not_kernels():
    """record_function ranges appear on the GPU timeline as user annotations spanning their kernels and the gaps
    between them: neither a kernel's time nor busy time."""
    from types import SimpleNamespace as NS

    from benchmarks.step_profile import summarize
    from torch.autograd import DeviceType

    def gpu(name, start, end, annotation=False):
        return NS(name=name, device_type=DeviceType.CUDA, is_user_annotation=annotation, cpu_parent=None,
                  time_range=NS(start=start, end=end, elapsed_us=lambda: end - start))

    events = [gpu("megatron_tree.chunk_forward", 0, 10_000, annotation=True), gpu("nvjet_gemm", 0, 2000),
              gpu("nvjet_gemm", 6000, 8000)]
    out = summarize(events, wall_s=0.01, cuda=True)
    assert out["busy_ms"] == 4.0 and out["kernels_ms"] == {"gemm": 4.0}
    assert [name for name, _, _ in out["top_kernels"]] == ["nvjet_gemm"]

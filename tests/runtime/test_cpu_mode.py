"""CPU mode (megatron_tree.runtime.cpu): the CUDA shim and its revert, distributed init checks, tiny
HF checkpoints, and mbridge-built models whose fp32 logits equal Hugging Face's (TP 1 here;
TP 2 and EP 2 over gloo in tests/scripts/bridge_logits.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("mbridge")

from dist_utils import run_torchrun  # noqa: E402
from megatron.core.tensor_parallel import random as tp_random  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from megatron_tree.mcore.bridge import build_flat_model  # noqa: E402
from megatron_tree.mcore.config_overrides import cpu_transformer_overrides  # noqa: E402
from megatron_tree.runtime import (  # noqa: E402
    TINY_ARCHS,
    cpu_mode,
    init_cpu_distributed,
    save_tiny_hf_checkpoint,
)
from megatron_tree.compat import apply_compat_patches  # noqa: E402
from megatron_tree.testing import hf_reference_logits  # noqa: E402

TOL = 1e-5
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim is a no-op when CUDA is present")



@needs_no_cuda
def test_cpu_mode_maps_cuda_to_cpu_and_reverts():
    owners = [
        (torch.cuda, "current_device"),
        (torch.cuda, "synchronize"),
        (torch.cuda, "current_stream"),
        (torch.cuda, "get_rng_state"),
        (torch.cuda, "set_rng_state"),
        (torch.cuda, "manual_seed"),
        (torch.cuda.random, "get_rng_state"),
        (torch.nn.Module, "cuda"),
        (torch.Tensor, "cuda"),
        (tp_random, "_get_cuda_rng_state"),
        (tp_random, "_set_cuda_rng_state"),
    ]
    before = [getattr(owner, name) for owner, name in owners]
    with cpu_mode():
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()  # a no-op, not a CUDA error
        stream = torch.cuda.current_stream()  # megatron-core 0.19's gradient sync asks for it every step
        stream.wait_event(None), stream.wait_stream(stream), stream.synchronize()
        assert stream.query() and stream.device.type == "cpu"
        for device in ("cuda", "cuda:0", 0, torch.device("cuda")):
            assert torch.empty(2, device=device).device.type == "cpu"
            assert torch.ones(2).to(device).device.type == "cpu"
        assert torch.zeros(3, pin_memory=True).sum() == 0
        layer = torch.nn.Linear(2, 2)
        assert layer.cuda() is layer and layer.weight.cuda() is layer.weight
        torch.cuda.manual_seed(7)
        a = torch.rand(3)
        torch.manual_seed(7)
        assert torch.equal(a, torch.rand(3))
        state = tp_random._get_cuda_rng_state()
        b = torch.rand(3)
        tp_random._set_cuda_rng_state(state)
        assert torch.equal(b, torch.rand(3))
        with cpu_mode():  # nested: still active after the inner block
            pass
        assert torch.empty(1, device="cuda").device.type == "cpu"
    assert all(getattr(owner, name) is old for (owner, name), old in zip(owners, before))
    assert "cuda" not in vars(torch.Tensor)  # inherited from TensorBase before: deleted, not copied, on revert


@needs_no_cuda
def test_cpu_mode_leaves_no_device_rewrite_behind():
    with cpu_mode():
        pass
    with pytest.raises((AssertionError, RuntimeError)):
        torch.empty(1, device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [(dict(tp=0), ValueError), (dict(tp="2"), TypeError), (dict(ep=True), TypeError), (dict(vpp=0), ValueError)],
)
def test_init_cpu_distributed_rejects_bad_sizes(kwargs, error):
    with pytest.raises(error):
        init_cpu_distributed(**kwargs)


def test_init_cpu_distributed_rejects_sizes_larger_than_world(cpu_dist):
    with pytest.raises(ValueError, match="not divisible"):
        init_cpu_distributed(tp=2)
    init_cpu_distributed()


def test_cpu_transformer_overrides():
    dense, moe = cpu_transformer_overrides(moe=False), cpu_transformer_overrides(moe=True)
    assert dense["use_cpu_initialization"] and not dense["masked_softmax_fusion"] and not dense["sequence_parallel"]
    assert moe["moe_token_dispatcher_type"] == "allgather" and moe["moe_grouped_gemm"] is False
    assert moe["moe_shared_expert_overlap"] is False  # megatron-core allows it with alltoall only
    assert dense.items() <= moe.items() and "moe_grouped_gemm" not in dense


def test_save_tiny_hf_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="qwen9"):
        save_tiny_hf_checkpoint("qwen9", tmp_path / "x")
    configs, weights = {}, {}
    for arch in TINY_ARCHS:
        path = Path(save_tiny_hf_checkpoint(arch, tmp_path / arch, num_hidden_layers=1))
        configs[arch] = json.loads((path / "config.json").read_text())
        weights[arch] = load_file(path / "model.safetensors")
    assert all(c["num_hidden_layers"] == 1 for c in configs.values())
    assert all(c["num_key_value_heads"] == 2 for arch, c in configs.items() if arch != "deepseek_v3")  # GQA
    assert configs["deepseek_v3"]["num_key_value_heads"] == 4  # MLA: a key and value per query head
    assert "model.layers.0.self_attn.q_norm.weight" in weights["qwen3"]
    assert "model.layers.0.self_attn.q_proj.bias" in weights["qwen2"]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in weights["qwen3_moe"]
    norm = weights["llama"]["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))  # randomised: a mis-mapped norm shows in logits
    assert all(t.dtype == torch.float32 for t in weights["llama"].values())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_bridge_logits_match_hf(arch, tmp_path, cpu_dist):
    path = save_tiny_hf_checkpoint(arch, tmp_path / arch)
    input_ids = torch.randint(0, 160, (1, 12), generator=torch.Generator().manual_seed(3))
    with apply_compat_patches(), cpu_mode():
        _, chunks = build_flat_model(path)
        model = chunks[0].eval()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        with torch.no_grad():
            logits = model(input_ids, torch.arange(12)[None], attention_mask=None)
    ref = hf_reference_logits(path, input_ids)
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < TOL


@pytest.mark.multiprocess
def test_tensor_and_expert_parallel_logits_match_hf(tmp_path):
    out = run_torchrun("scripts/bridge_logits.py", 2, [str(tmp_path), "tp2:qwen3", "ep2:qwen3_moe"], timeout=400)
    for case in ("tp2:qwen3", "ep2:qwen3_moe"):
        assert f"{case} max_abs_diff=" in out and "export_ok=False" not in out, out[-3000:]

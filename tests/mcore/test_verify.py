"""No silent fallback: tree micro-batches run on a tree model or fail with a clear error.

- check_tree_model (run by tree_forward_backward, tree_forward_step and the launcher) refuses
  upstream attention, unknown attention and RoPE by packed index, naming the module;
- a tree model called directly with the wrong mask, no mask or packed_seq_params refuses;
- verify_tree_model passes a tree model (fp32 and bf16, TP=2, PP=2) and fails one whose RoPE
  rotates by packed slot index (structurally a tree model);
- on a GPU (with Transformer Engine: its TEDotProductAttention named): tests/mcore/test_verify_gpu.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from dist_utils import run_python, run_torchrun
from scripts.parity_common import branching_forest, micro_batches
from scripts.verify_dist import packed_index_rope

from megatron_tree.mcore import model_check
from megatron_tree.mcore.bridge import build_model
from megatron_tree.mcore.model_check import check_tree_model
from megatron_tree.mcore.rope import TreeRotaryEmbedding
from megatron_tree.mcore.schedule import tree_forward_backward, tree_forward_step
from megatron_tree.runtime import save_tiny_hf_checkpoint
from megatron_tree.mcore.verify import verify_tree_model


@pytest.fixture(scope="module")
def megatron_cpu(cpu_megatron, tmp_path_factory):
    """Path of a tiny Qwen3 checkpoint (CPU mode and one gloo process: tests/conftest.py)."""
    return save_tiny_hf_checkpoint("qwen3", tmp_path_factory.mktemp("tiny_hf") / "qwen3")


def build(path, *, tree: bool = True, bf16: bool = False) -> torch.nn.Module:
    return build_model(path, tree=tree, bf16=bf16, wrap_with_ddp=False)[1][0]


def sum_loss(logprobs, mb):
    return -logprobs.sum(), logprobs.numel()


@pytest.fixture(scope="module")
def mbs():
    return micro_batches(branching_forest())


@pytest.mark.parametrize("entry", ["forward_backward", "forward_only", "forward_step"])
def test_upstream_model_is_refused_before_it_runs(megatron_cpu, mbs, entry):
    model = build(megatron_cpu, tree=False)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    run = {
        "forward_backward": lambda: tree_forward_backward(model, mbs, sum_loss),
        "forward_only": lambda: tree_forward_backward([model], mbs, sum_loss, forward_only=True),
        "forward_step": lambda: tree_forward_step(sum_loss)(iter(mbs), model),
    }[entry]
    with pytest.raises(ValueError) as e:
        run()
    msg = str(e.value)
    print(msg)
    assert "'decoder.layers.0.self_attention.core_attention' is " in msg
    assert "megatron.core.transformer.dot_product_attention.DotProductAttention" in msg
    assert "(and 2 more problem(s))" in msg  # layer 1's attention, the RoPE
    assert "build_tree_model" in msg and "tree_layer_spec" in msg and "convert_to_tree_model" in msg
    assert not calls


class CustomCoreAttention(torch.nn.Module):
    pass


class LinearMixer(torch.nn.Module):
    """A token mixer without a core_attention (linear / state-space attention)."""


@pytest.mark.parametrize(
    "breakage, expected",
    [
        ("custom_core", ["'decoder.layers.1.self_attention.core_attention' is ", "CustomCoreAttention"]),
        ("linear_mixer", ["'decoder.layers.0.self_attention' is ", "LinearMixer", "no core_attention"]),
        ("packed_rope", ["'rotary_pos_emb' is ", "RotaryEmbedding", "rotates slot i as position i"]),
        ("no_positions", ["'decoder.layers.0.self_attention.core_attention' is TreeCoreAttention",
                          "positions_from_ids=False"]),
    ],
)
def test_check_names_the_offending_module(megatron_cpu, mbs, breakage, expected):
    model = build(megatron_cpu)
    layers = model.decoder.layers
    if breakage == "custom_core":
        layers[1].self_attention.core_attention = CustomCoreAttention()
    elif breakage == "linear_mixer":
        layers[0].self_attention = LinearMixer()
    elif breakage == "packed_rope":
        model.rotary_pos_emb = model.rotary_pos_emb.inner
    else:
        for layer in layers:
            layer.self_attention.core_attention.positions_from_ids = False
    for run in (lambda: check_tree_model(model), lambda: verify_tree_model(model)):
        with pytest.raises(ValueError) as e:
            run()
        assert all(part in str(e.value) for part in expected), str(e.value)


def test_check_walks_each_model_once(megatron_cpu, mbs, monkeypatch):
    walks = []
    real = model_check._problems
    monkeypatch.setattr(model_check, "_problems", lambda chunk: walks.append(chunk) or real(chunk))
    model = build(megatron_cpu)
    check_tree_model(model)
    check_tree_model([model])
    tree_forward_backward(model, mbs, sum_loss, forward_only=True)  # checks once per call and per micro-batch
    assert walks == [model]


def _packed_params(t: int, fmt: str):
    from megatron.core.packed_seq_params import PackedSeqParams

    if fmt == "sbhd":
        return PackedSeqParams(qkv_format="sbhd")
    cu = torch.tensor([0, t], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=t, max_seqlen_kv=t)


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("no_mask", ValueError, "got attention_mask=None"),
        ("dense_bool_mask", TypeError, "int32/int64 interval vector"),
        ("dense_int_mask", ValueError, "expected [b, s]"),
        ("packed_thd", ValueError, "packed_seq_params=None"),
        ("packed_sbhd", ValueError, "packed_seq_params=None"),
        ("no_positions", ValueError, "position_ids=None"),
    ],
)
def test_tree_model_refuses_wrong_direct_call(megatron_cpu, mbs, case, error, message):
    model = build(megatron_cpu).eval()
    device = next(model.parameters()).device
    mb = mbs[0].to(device)
    t = mb.num_slots
    ids, pos, mask = mb.input_ids, mb.position_ids, mb.attention_mask
    dense = torch.ones(t, t, dtype=torch.bool, device=device).tril()  # True = attend
    call = {
        "no_mask": lambda: model(ids, pos, None),
        "dense_bool_mask": lambda: model(ids, pos, ~dense[None, None]),  # Megatron: True = masked out
        "dense_int_mask": lambda: model(ids, pos, dense.int()),
        "packed_thd": lambda: model(ids, pos, mask, packed_seq_params=_packed_params(t, "thd")),
        "packed_sbhd": lambda: model(ids, pos, mask, packed_seq_params=_packed_params(t, "sbhd")),
        "no_positions": lambda: model(ids, None, mask),
    }[case]
    with torch.no_grad(), pytest.raises(error) as e:
        call()
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_verify_passes_a_tree_model_and_fails_packed_index_rope(megatron_cpu, bf16, monkeypatch):
    model = build(megatron_cpu, bf16=bf16).train()
    good = verify_tree_model(model)
    assert model.training and all(m.training for m in model.modules())  # mode restored
    monkeypatch.setattr(TreeRotaryEmbedding, "forward", packed_index_rope)
    bad = verify_tree_model(model, raise_on_mismatch=False)
    print(f"{good}\npacked-index RoPE: {bad}")
    assert good.ok and good.precision == ("bf16" if bf16 else "fp32") and good.targets == 120
    assert good.tolerance < (0.2 if bf16 else 2e-5)
    assert good.grad_error <= good.grad_tolerance < (0.07 if bf16 else 2e-5)
    assert not bad.ok and bad.max_error > 0.5
    with pytest.raises(RuntimeError, match=r"not exact: look for RoPE rotating by packed slot index"):
        verify_tree_model(model)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_verify_fails_a_backend_whose_backward_is_wrong(megatron_cpu, bf16, broken_attention_backends):
    """A kernel with a right forward and a wrong dQ passes the log-prob check and fails the gradient check
    (the per-sequence passes run on the dense reference attention)."""
    from megatron_tree.mcore.core_attention import TreeCoreAttention

    model = build(megatron_cpu, bf16=bf16)
    for m in model.modules():
        if isinstance(m, TreeCoreAttention):
            m.backend = "test_wrong_dq"
    report = verify_tree_model(model, raise_on_mismatch=False)
    print(report)
    assert report.max_error <= report.tolerance and report.grad_error > 2 * report.grad_tolerance
    assert "self_attention" in report.grad_parameter or "layernorm" in report.grad_parameter
    with pytest.raises(RuntimeError, match=r"max grad rel err .* > \(FAILED\).*backward is wrong"):
        verify_tree_model(model)
    assert all(p.grad is None for p in model.parameters()), "verify leaves the gradients zeroed"
    assert verify_tree_model(model, check_gradients=False).grad_error is None


@pytest.mark.multiprocess
def test_verify_at_tp2_and_pp2(tmp_path):
    out = run_torchrun("scripts/verify_dist.py", 2, ["--ckpt", str(tmp_path)], timeout=600)
    num = r"([0-9.]+e[+-]\d+)"  # ranks' lines may run into each other (dist_utils)
    rows = re.findall(rf"VERIFY rank=(\d) layout=(tp2|pp2) error={num} tolerance={num} bad_error={num} "
                      rf"grad_error={num} grad_tolerance={num}", out)
    assert sorted((r[0], r[1]) for r in rows) == [("0", "pp2"), ("0", "tp2"), ("1", "pp2"), ("1", "tp2")], out[-3000:]
    for _, _, error, tolerance, bad, grad_error, grad_tolerance in rows:
        assert float(error) <= float(tolerance) < 2e-5 and float(bad) > 0.5
        assert float(grad_error) <= float(grad_tolerance) < 2e-5


@pytest.mark.slow
def test_launcher_flag_logs_the_error():
    proc = run_python("examples/train_tree.py", ["--steps", "1", "--no-progress", "--verify-tree-model"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"verify_tree_model: tree vs per-sequence max \|dlogprob\| (\S+) <= tolerance ([^,]+), "
                     r"max grad rel err (\S+) <= tolerance (\S+)", proc.stdout)
    assert line and float(line[1]) <= float(line[2]) and float(line[3]) <= float(line[4]), proc.stdout[-3000:]


def test_bf16_model_logits_stay_bf16_with_the_same_logprobs(megatron_cpu, mbs, monkeypatch):
    """The tree forward step asks megatron's Float16Module for bf16 logits (no fp32 [T, V] copy); the
    log-probs are bit-identical to those from its fp32 copy (the values are the same bf16 numbers)."""
    from megatron.core.transformer.module import Float16Module

    from megatron_tree.mcore import schedule
    from megatron_tree.mcore.forward_only import tree_forward_only

    model = build(megatron_cpu, bf16=True)
    assert isinstance(model, Float16Module)
    dtypes = []
    model.register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    kept = tree_forward_only(model, mbs)
    monkeypatch.setattr(schedule, "_half_precision", lambda m: False)
    upcast = tree_forward_only(model, mbs)
    assert set(dtypes[: len(mbs)]) == {torch.bfloat16} and set(dtypes[len(mbs) :]) == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(kept, upcast, strict=True))

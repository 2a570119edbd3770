"""Attention conformance: no backend is trusted beyond the shapes its gradients were compared on.

On a GPU every backend runs the whole grid (megatron_tree.attention.conformance: head dims 64 .. 256
and MLA's 192 / 128, MHA and GQA 2:1 / 4:1, bf16 / fp16 / fp32, branching trees with a ragged last
tile, context-parallel query slots) as training calls it: each call either passes the rule (out,
dQ, dK, dV within 2x the dense kernel's error of the fp64 reference) or is refused by the backend.
On CPU the same rule runs for the backends that run there, and must fail a backend with a broken
backward.
"""


import pytest
import torch

from megatron_tree.attention import dispatch as attention
from megatron_tree.attention import fa4 as fa4_attention
from megatron_tree.attention import flex as flex_attention
from megatron_tree.attention import te_chains as chain_attention
from megatron_tree.attention.conformance import accept, head_dim_grid, run_conformance
from megatron_tree.attention.shapes import AttentionShape, ProvenShapes
from megatron_tree.core.platform import have_transformer_engine

have_transformer_engine()  # TE loads the system cuDNN: before SDPA's cuDNN backend runs

GPU = torch.cuda.is_available()
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _shape(d, dv=None, ratio=1, dtype=BF16, device="sm90"):
    return AttentionShape(d, d if dv is None else dv, ratio, dtype, device)


def test_fa4_proven_table():
    """FA4 4.0.0b36: bf16 on Hopper, 64 / 96 / 128 with MHA and GQA 2:1 / 4:1 / 8:1, 64 / 128 with GQA 5:1 / 7:1 too,
    and nothing else (4.0.0b36's dQ is wrong at head dims 72 - 112 and it refuses 192 / 256; other GQA ratios and
    fp16 were not compared on a GPU: benchmarks/results/te/conformance_raw_*.json)."""
    proven = fa4_attention.PROVEN
    for d, ratios in ((64, (1, 2, 4, 5, 7, 8)), (96, (1, 2, 4, 8)), (128, (1, 2, 4, 5, 7, 8))):
        for ratio in ratios:
            assert proven.proves(_shape(d, ratio=ratio)), (d, ratio)
    for unproven in (_shape(72), _shape(80, ratio=2), _shape(112), _shape(96, ratio=5), _shape(64, ratio=3),
                     _shape(128, ratio=16), _shape(192, 128), _shape(256), _shape(128, dtype=FP16),
                     _shape(128, dtype=FP32), _shape(128, device="sm100"), _shape(128, device="cpu"), _shape(32)):
        assert not proven.proves(unproven), unproven


def test_backends_refuse_what_they_are_not_proven_on():
    """Each backend's refusal names what it is proven on and the call's shape; dense computes everything."""
    reason = flex_attention.refusal(_shape(80, dtype=BF16), batch=1, dropout_p=0.0)
    assert "proven exact" in reason and "head dim 80" in reason
    assert flex_attention.refusal(_shape(128, ratio=2), batch=1, dropout_p=0.0) is None
    assert flex_attention.refusal(_shape(128, ratio=2), batch=2, dropout_p=0.0)
    assert flex_attention.refusal(_shape(128, ratio=2), batch=1, dropout_p=0.1)
    assert chain_attention.refusal(_shape(64, ratio=4), dropout_p=0.0) is None
    assert chain_attention.refusal(_shape(48, ratio=4), dropout_p=0.0)
    assert chain_attention.refusal(_shape(128, ratio=2), dropout_p=0.0)
    if not fa4_attention.fa4_available():
        assert "cannot run" in fa4_attention.refusal(_shape(128), batch=1, dropout_p=0.0)
    assert attention.get_tree_attention_backend("dense").refusal(_shape(256, 128), batch=3, dropout_p=0.5) is None
    assert "no backward on cpu" in flex_attention.refusal(_shape(128, ratio=2, device="cpu"), batch=1, dropout_p=0.0)
    with pytest.raises(ValueError, match="does not run this call: .*Use backend='auto'"):
        attention.tree_attention(*(torch.zeros(4, 1, 2, 8),) * 3, torch.full((1, 4), 4, dtype=torch.int32),
                                 backend="flex")


def test_proven_shapes_describe_and_combine():
    a = ProvenShapes.grid((64, (192, 128)), (1,), (BF16,), ("sm90",), "a")
    b = ProvenShapes.grid((128,), (2,), (FP32,), ("sm90",), "b")
    assert (a | b).describe() == "on sm90: MHA bf16: head dims 64, 192/v128; GQA 2:1 fp32: head dims 128"
    assert (a | b).proves(_shape(192, 128)) and not a.proves(_shape(192))
    with pytest.raises(ValueError, match="different devices"):
        a | ProvenShapes.grid((64,), (1,), (BF16,), ("sm100",), "c")


def test_accept_rule():
    dense = {"out": 1e-3, "dq": 1e-3, "dk": 1e-3, "dv": 1e-3}
    assert accept({**dense, "dq": 2e-3}, dense, BF16) == []
    assert accept({**dense, "dq": 1.3}, dense, BF16) == ["dq: rel err 1.3 > 2 x dense 0.001 + 0.0001"]
    assert accept({**dense, "dv": float("nan")}, dense, BF16)


def test_conformance_fails_a_wrong_backward_and_a_wrong_mask(broken_attention_backends):
    rows = run_conformance(["dense", *broken_attention_backends], head_dims=[(16, 16)], gqa_ratios=[2], dtypes=["fp32"],
                           trees=["multi_turn"], modes=["routed"], max_tokens=300, heads=4, device="cpu")
    status = {r.backend: r for r in rows}
    assert status["dense"].status == "pass"
    assert status["test_wrong_dq"].status == "FAIL" and status["test_wrong_dq"].message.startswith("dq:")
    assert status["test_wrong_mask"].status == "FAIL" and "out:" in status["test_wrong_mask"].message


def _assert_conforms(rows, backend):
    failed = [r for r in rows if r.status == "FAIL"]
    assert not failed, "\n".join(f"{r.backend} {r.tree} d={r.head_dim}/{r.v_head_dim} gqa={r.gqa_ratio} {r.dtype}: "
                                 f"{r.message}" for r in failed)
    impl = attention.get_tree_attention_backend(backend)
    for r in rows:  # every refusal is the backend declining the shape, and it never declines what it is proven on
        shape = AttentionShape(r.head_dim, r.v_head_dim, r.gqa_ratio, {"bf16": BF16, "fp16": FP16, "fp32": FP32}[r.dtype],
                               r.device, windowed=r.window is not None)
        assert (r.status == "refused") == (impl.refusal(shape, batch=1, dropout_p=0.0) is not None), r


@pytest.mark.skipif(GPU, reason="the CPU grid; on a GPU the full grid below runs")
@pytest.mark.parametrize("backend", ["dense", "auto", "flex", "fa4"])
def test_backends_conform_on_cpu(backend):
    rows = run_conformance([backend], head_dims=[(64, 64), (72, 72), (192, 128)], gqa_ratios=[1, 4],
                           dtypes=["bf16", "fp32"], modes=["routed"], max_tokens=300, device="cpu")
    _assert_conforms(rows, backend)
    if backend in ("dense", "auto"):
        assert all(r.status == "pass" for r in rows)


@pytest.mark.skipif(GPU, reason="the CPU grid; on a GPU the windowed grid below runs")
@pytest.mark.parametrize("backend", ["dense", "auto", "flex", "fa4"])
def test_backends_conform_on_cpu_with_a_window(backend):
    rows = run_conformance([backend], head_dims=[(64, 64)], gqa_ratios=[1, 4], dtypes=["bf16", "fp32"],
                           modes=["routed"], max_tokens=300, device="cpu", window=7)
    assert rows and all(r.window == 7 for r in rows)
    _assert_conforms(rows, backend)
    assert all(r.status == ("pass" if backend in ("dense", "auto") else "refused") for r in rows)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("window", [5, 200])
def test_flex_windowed_kernel_conforms_on_gpu(window):
    """The windowed flex kernel itself (raw) on the grid's proven flex shapes, routed rows pass or are refused, auto
    runs every windowed call: the raw rows passing is the evidence for ``flex.PROVEN_WINDOWED``; FA4 refuses windows."""
    # a flex compilation per (shape, dtype, window) costs 5-18 s on an H200: a small grid (the full one, every
    # windowed shape, is `python -m megatron_tree.attention.conformance --window W`; the 128 bf16 2:1 proof is
    # tests/attention/test_sliding_window.py's)
    rows = run_conformance(["flex", "fa4", "auto"], head_dims=[(64, 64)], gqa_ratios=[1, 4], dtypes=["bf16", "fp32"],
                           trees=["grpo_query_slots"], device="cuda", window=window)
    for backend in ("flex", "fa4", "auto"):
        _assert_conforms([r for r in rows if r.backend == backend and r.mode == "routed"], backend)
    assert all(r.status == "pass" for r in rows if r.backend == "auto")
    raw = [r for r in rows if r.backend == "flex" and r.mode == "raw" and (r.dtype == "bf16" or r.head_dim == 64)]
    assert raw and all(r.status == "pass" for r in raw), [r for r in raw if r.status != "pass"]
    assert all(r.status != "pass" for r in rows if r.backend == "fa4")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["dense", "flex", "fa4", "auto"])
def test_backends_conform_on_gpu(backend):
    """The grid as training calls each backend (two of the harness's trees: deep multi-turn, and GRPO under
    context-parallel query slots): pass or refused, never wrong; auto runs every call."""
    rows = run_conformance([backend], head_dims=head_dim_grid(), modes=["routed"], trees=["multi_turn", "grpo_query_slots"],
                           device="cuda")
    _assert_conforms(rows, backend)
    if backend == "auto":
        assert all(r.status == "pass" for r in rows)
    if backend == "fa4" and fa4_attention.fa4_available():
        passed = {(r.head_dim, r.gqa_ratio) for r in rows if r.status == "pass"}
        assert passed == {(d, r) for d in (64, 96, 128) for r in (1, 2, 4)}

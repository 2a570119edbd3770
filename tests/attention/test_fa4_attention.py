"""FA4 (FlashAttention-4 CuTe) tree attention against the dense reference: Hopper / Blackwell GPUs only.

The kernels run bf16, so exactness is judged the way a dense bf16 kernel is: outputs and gradients
against the fp32 dense-mask reference on the same bf16 inputs, within twice the error of SDPA's own
bf16 kernel with the dense tree mask. A wrong mask (one visible pair too many or too few per
partial tile) moves the output by far more, which the last test checks.
"""

import pytest
import torch

from kernel_reference import bf16_inputs, dense_attention, fwd_bwd, gpu_tree, rel_errors
from megatron_tree.attention import fa4 as fa4_attention
from megatron_tree.core.platform import have_transformer_engine
from megatron_tree.attention.fa4 import fa4_available, fa4_tree_attention, fa4_tree_mask, fa4_unavailable_reason
from megatron_tree.core.masks import dense_tree_mask

# Transformer Engine loads the system cuDNN: importing it after SDPA's cuDNN backend ran fails, so first.
have_transformer_engine()

_fa4_here = pytest.mark.skipif(
    not torch.cuda.is_available() or not fa4_available(), reason="needs a Hopper/Blackwell GPU and flash-attn-4"
)


def requires_fa4(test):
    """A GPU test (marker ``gpu``) that also needs FA4 to run here."""
    return pytest.mark.gpu(_fa4_here(test))







def _check_against_dense(end, slots, base):
    """FA4 bf16 out / dq / dk / dv within twice the dense bf16 kernel's error of the fp32 dense reference."""
    mask = dense_tree_mask(end, slots)
    ref = fwd_bwd(dense_attention(mask), base, torch.float32)
    dense_bf16 = rel_errors(fwd_bwd(dense_attention(mask), base, torch.bfloat16), ref)
    prepared = fa4_tree_mask(end, slots)
    fa4 = rel_errors(fwd_bwd(lambda q, k, v: fa4_tree_attention(q, k, v, prepared), base, torch.bfloat16), ref)
    for name, e, e_dense in zip(("out", "dq", "dk", "dv"), fa4, dense_bf16):
        assert e <= 2 * e_dense + 1e-4, f"{name}: FA4 rel err {e:.2e} vs dense bf16 {e_dense:.2e}"


@requires_fa4
@pytest.mark.parametrize("kind", ["grpo", "multi_turn"])
@pytest.mark.parametrize("heads,kv_heads,d", [(16, 8, 128), (8, 8, 64)])
def test_fa4_matches_dense_reference(kind, heads, kv_heads, d):
    end = gpu_tree(kind)
    t = end.shape[0]
    assert t % 128, "the test wants a ragged last tile"
    _check_against_dense(end, None, bf16_inputs(t, t, heads, kv_heads, d))


@requires_fa4
def test_fa4_query_slots_match_dense_reference():
    """Context parallel: the rank's queries are a scattered subset of the slots (the mask pads them with -1 rows)."""
    end = gpu_tree("multi_turn")
    t = end.shape[0]
    g = torch.Generator(device="cuda").manual_seed(3)
    slots = torch.randperm(t, device="cuda", generator=g)[: t // 2]
    _check_against_dense(end, slots, bf16_inputs(t, slots.numel(), 16, 8, 128, seed=1))


@requires_fa4
def test_fa4_wrong_mask_is_caught():
    """The comparison can fail: the tree kernel against the reference of a causal mask is far off."""
    end = gpu_tree("grpo")
    t = end.shape[0]
    base = bf16_inputs(t, t, 16, 8, 128, seed=2)
    causal = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
    ref = fwd_bwd(dense_attention(causal), base, torch.float32)
    fa4 = rel_errors(fwd_bwd(lambda q, k, v: fa4_tree_attention(q, k, v, fa4_tree_mask(end)), base, torch.bfloat16), ref)
    assert fa4[0] > 0.05


def _elementwise_tree_mask_mods():
    """The tree mask_mods' predicate as unregistered mask_mods: FA4 applies them with its own element-wise code."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def tree(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        end = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0]], cutlass.Int32)
        return (kv_idx <= q_idx) & (q_idx < end)

    @cute.jit
    def tree_slots(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        end = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0]], cutlass.Int32)
        slot = utils.scalar_to_ssa(aux_tensors[1][q_idx[0]], cutlass.Int32)
        return (kv_idx <= slot) & (slot < end)

    return tree, tree_slots


def _lean_and_elementwise(query_slots: bool, heads: int, kv_heads: int, token_major: bool = False):
    """out / dq / dk / dv of fa4_tree_attention (our registered mask_mods) and of FA4's flash_attn_func with the
    unregistered copies (FA4's element-wise mask, FA4's GQA backward) on the same bf16 inputs ([1, h, T, d]
    head-major in memory, or token-major as Megatron's [T, 1, h, d] permuted)."""
    from flash_attn.cute.interface import flash_attn_func

    end = gpu_tree("multi_turn")
    t = end.shape[0]
    slots = None
    if query_slots:
        slots = torch.randperm(t, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))[: t // 2]
    tq = t if slots is None else slots.numel()
    base = bf16_inputs(t, tq, heads, kv_heads, 128, seed=4)
    if token_major:
        base = [x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for x in base]
    prepared = fa4_tree_mask(end, slots)
    lean = fwd_bwd(lambda q, k, v: fa4_tree_attention(q, k, v, prepared), base, torch.bfloat16)
    tree, tree_slots = _elementwise_tree_mask_mods()

    def elementwise(q, k, v):
        return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               mask_mod=tree_slots if query_slots else tree, aux_tensors=list(prepared.aux),
                               block_sparse_tensors=prepared.forward,
                               block_sparse_tensors_bwd=prepared.backward)[0].transpose(1, 2)

    return lean, fwd_bwd(elementwise, base, torch.bfloat16)


def _assert_dq_close(a, b):
    """dq is accumulated with fp32 atomic adds in an order that varies from run to run."""
    torch.testing.assert_close(a, b, rtol=0, atol=2e-3 * b.abs().max().item())


@requires_fa4
@pytest.mark.parametrize("query_slots", [False, True])
def test_lean_mask_equals_fa4_elementwise_mask(query_slots):
    """megatron_tree/attention/fa4_kernels.py's lean mask (our mask_mods) against FA4's own element-wise masking of the same
    predicate, one K/V head per query head (the same kernels otherwise): identical out / dk / dv bits, dq up to
    the order of its atomic adds."""
    lean, ref = _lean_and_elementwise(query_slots, 16, 16)
    _assert_dq_close(lean[1], ref[1])
    for name, a, b in zip(("out", "dk", "dv"), lean[::2] + lean[3:], ref[::2] + ref[3:]):
        assert torch.equal(a, b), f"{name}: lean mask differs from FA4's element-wise mask"


@requires_fa4
@pytest.mark.parametrize("token_major", [False, True])
def test_grouped_kv_backward_runs_per_query_head(monkeypatch, token_major):
    """GQA (16 query, 8 K/V heads): the tree backward runs FA4's kernel on K/V repeated to the query heads and
    sums dK / dV per group (megatron_tree/attention/fa4_kernels.py), FA4's own GQA backward accumulates them in fp32. Same out
    bits, dq up to atomic order, dK / dV within the extra bf16 rounding of each query head's share."""
    from megatron_tree.attention import fa4_kernels as patch

    kv_heads_seen = []
    original = patch._ORIGINAL_BWD
    monkeypatch.setattr(patch, "_ORIGINAL_BWD", lambda q, k, *a, **kw: kv_heads_seen.append(k.shape[-2]) or
                        original(q, k, *a, **kw))
    lean, ref = _lean_and_elementwise(False, 16, 8, token_major)
    assert kv_heads_seen == [16, 8], "the tree backward should run on K/V repeated to 16 heads, FA4's on 8"
    assert torch.equal(lean[0], ref[0])
    _assert_dq_close(lean[1], ref[1])
    for name, a, b in zip(("dk", "dv"), lean[2:], ref[2:]):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-6 * scale, msg=lambda m: f"{name}: {m}")


@requires_fa4
@pytest.mark.parametrize("head_major", [True, False])
def test_head_pair_kernels_are_exact(head_major):
    """The per-query-head backward's two element-wise steps: K/V repeated to head pairs (bit copies) and dK / dV pairs
    added (fp32 sum rounded once to bf16), on a ragged T and a head dim that is not a power of two."""
    from megatron_tree.attention import fa4_kernels as patch

    g = torch.Generator(device="cuda").manual_seed(6)
    heads_first = torch.randn(2, 4, 301, 96, device="cuda", generator=g).bfloat16()  # [b, hkv, T, d]
    x = heads_first.transpose(1, 2) if head_major else heads_first.transpose(1, 2).contiguous()
    repeated = patch._repeat_heads(x)
    assert torch.equal(repeated, x.repeat_interleave(2, dim=2))
    assert (repeated.stride(2) > repeated.stride(1)) == head_major
    grads = torch.randn(2, 301, 8, 96, device="cuda", generator=g).bfloat16()
    if head_major:
        grads = grads.transpose(1, 2).contiguous().transpose(1, 2)
    summed = patch._add_head_pairs(grads, like=x)
    assert summed.stride() == x.stride()
    assert torch.equal(summed, grads.float().unflatten(2, (4, 2)).sum(3).bfloat16())


@requires_fa4
def test_fa4_refuses_fp32():
    end = gpu_tree("grpo")
    t = end.shape[0]
    q = torch.randn(1, 4, t, 64, device="cuda")
    k = torch.randn(1, 4, t, 64, device="cuda")
    with pytest.raises(TypeError, match="bf16/fp16.*flex"):
        fa4_tree_attention(q, k, k, fa4_tree_mask(end))


def test_fa4_call_checks_name_each_refusal():
    """What ``auto`` asks (``refusal``) names each reason; ``attend`` raises for dropout (no GPU needed)."""
    from megatron_tree.attention.shapes import AttentionShape
    from megatron_tree.attention.fa4 import attend, refusal

    def why(d=128, dv=128, ratio=2, dtype=torch.bfloat16, batch=1, dropout_p=0.0):
        return refusal(AttentionShape(d, dv, ratio, dtype, "sm90"), batch=batch, dropout_p=dropout_p)

    assert "dropout" in why(dropout_p=0.1)
    assert "bf16/fp16" in why(dtype=torch.float32)
    assert "b = 1" in why(batch=2)
    if fa4_available():
        assert why() is None and "proven exact" in why(d=72)  # 4.0.0b36's dQ is wrong at 72
        assert "proven exact" in why(d=192, dv=128) and "proven exact" in why(dtype=torch.float16)
    q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no attention dropout"):
        attend(q, q, q, None, scale=1.0, dropout_p=0.1)


def test_fa4_unavailable_reason_is_explicit():
    reason = fa4_unavailable_reason()
    if reason is not None:
        assert reason.startswith("the FA4 tree attention backend cannot run: ")
        assert "CUDA GPU" in reason or "sm" in reason or "flash-attn-4" in reason or "flash_attn" in reason


def test_fa4_pin_matches_setup_extra():
    import pathlib
    import re

    from megatron_tree.attention.fa4 import FA4_VERSION

    setup = (pathlib.Path(__file__).parents[2] / "setup.py").read_text()
    assert re.search(r'"fa4": \["flash-attn-4==([^"]+)"\]', setup).group(1) == FA4_VERSION


@pytest.mark.skipif(fa4_available(), reason="checks the refusal where FA4 cannot run")
def test_fa4_backend_refuses_clearly_where_it_cannot_run():
    """Asked for explicitly, FA4 never falls back: the call and the model build say why and what to use."""
    from megatron_tree.attention import PREPARED_MASKS, tree_attention

    PREPARED_MASKS.clear()
    end = torch.tensor([[3, 3, 3]], dtype=torch.int32)
    q = torch.randn(3, 1, 2, 16)
    with pytest.raises(ValueError, match="cannot run: .*Use backend="):
        tree_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), end, backend="fa4")
    with pytest.raises(ValueError, match="cannot run"):
        fa4_tree_mask(end)


@requires_fa4
def test_auto_backend_runs_fa4_for_bf16_and_flex_for_fp32(monkeypatch):
    """Megatron layout through ``tree_attention``: ``auto`` takes FA4 for a branching bf16 micro-batch and
    FlexAttention for fp32 (exact there), both against the dense backend."""
    from megatron_tree.attention import PREPARED_MASKS, tree_attention

    used = []
    real = fa4_attention.fa4_tree_attention
    monkeypatch.setattr(fa4_attention, "fa4_tree_attention", lambda *a, **k: used.append(1) or real(*a, **k))
    PREPARED_MASKS.clear()
    mask = gpu_tree("grpo")[None]
    t = mask.shape[1]
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(t, 1, h, 128, device="cuda", generator=g) for h in (16, 8, 8))
    ref = tree_attention(q.double(), k.double(), v.double(), mask, backend="dense")
    out32 = tree_attention(q, k, v, mask, backend="auto")
    assert not used
    torch.testing.assert_close(out32.double(), ref, rtol=1e-5, atol=1e-5)
    dense16 = tree_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, backend="dense")
    out16 = tree_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, backend="auto")
    assert used
    err, err_dense = ((x.double() - ref).norm() / ref.norm() for x in (out16, dense16))
    assert err <= 2 * err_dense + 1e-4
    torch.testing.assert_close(tree_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, backend="fa4"), out16)


@requires_fa4
def test_fa4_model_build_refuses_an_unproven_shape():
    """backend='fa4' at build time: a head dim FA4 4.0.0b36 is not proven on (256) is refused with what it is proven on."""
    from types import SimpleNamespace

    from megatron_tree.mcore.core_attention import _model_attention_shape

    config = SimpleNamespace(bf16=True, fp16=False, num_attention_heads=8, num_query_groups=4, kv_channels=256,
                             multi_latent_attention=False)
    assert "proven exact" in fa4_attention.refusal(_model_attention_shape(config), batch=1, dropout_p=0.0)
    config.kv_channels = 96
    assert fa4_attention.refusal(_model_attention_shape(config), batch=1, dropout_p=0.0) is None


@requires_fa4
def test_auto_passes_over_unproven_fa4_with_one_warning(recwarn):
    """bf16 head dim 256 (Gemma 3): auto does not run FA4 (4.0.0b36 refuses 256) but an exact backend, and says so once."""
    from megatron_tree.attention.dispatch import PREPARED_MASKS, _PASSED_OVER, tree_attention

    _PASSED_OVER.clear()
    PREPARED_MASKS.clear()
    mask = gpu_tree("grpo")[None]
    t = mask.shape[1]
    q, k = (torch.randn(t, 1, h, 256, device="cuda", dtype=torch.bfloat16) for h in (4, 2))
    ref = tree_attention(q.double(), k.double(), k.double(), mask, backend="dense")
    for _ in range(2):
        out = tree_attention(q, k, k, mask, backend="auto")
    assert (out.double() - ref).norm() / ref.norm() < 2e-2
    assert sum("does not use fa4" in str(w.message) for w in recwarn) == 1

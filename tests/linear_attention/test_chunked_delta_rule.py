"""chunk_gated_delta_rule (the PyTorch path on CPU): against the fp64 per-token loop (values, final states and
gradients of q, k, v, g, beta, initial_state), against Hugging Face's ``torch_recurrent_gated_delta_rule`` and
``torch_chunk_gated_delta_rule`` (an outside oracle), varlen ``cu_seqlens`` against one call per sequence,
and refusals naming the tensor. ``gpu``: fla's kernels (bf16) against fla per sequence, opt-in while fla is off.
"""

from __future__ import annotations

import os

import pytest
import torch
from gdn_trees import FLA_OFF, rel_err

import megatron_tree.linear_attention.chunked_delta_rule as chunk_module
from megatron_tree.linear_attention import chunk_gated_delta_rule
from megatron_tree.testing import gated_delta_rule_reference


def _inputs(b, t, h=3, dk=8, dv=12, n_states=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -0.2 * torch.rand(b, t, h, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    h0 = torch.randn(b if n_states is None else n_states, h, dk, dv, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


@pytest.mark.parametrize("t,dtype", [(1, torch.float32), (63, torch.float32), (64, torch.float32),
                                     (65, torch.float32), (200, torch.float32), (1, torch.float64),
                                     (200, torch.float64)])
def test_batched_equals_the_per_token_loop(t, dtype):
    """fp32 within 1e-5; fp64 (computed in fp64, final states fp64) within 1e-12 of the fp64 loop."""
    q, k, v, g, beta, h0 = inputs = [x.detach().to(dtype).requires_grad_() for x in _inputs(2, t)]
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == final.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    wo, wf = torch.randn_like(o), torch.randn_like(final)
    grads = torch.autograd.grad((o * wo).sum() + (final * wf).sum(), inputs)
    ref_o, ref_f, loss = [], [], 0.0
    for row in range(2):
        ro, rf = gated_delta_rule_reference(q[row], k[row], v[row], g[row], beta[row], initial_state=h0[row])
        ref_o.append(ro)
        ref_f.append(rf)
        loss = loss + (ro * wo[row]).sum() + (rf * wf[row]).sum()
    ref_grads = torch.autograd.grad(loss, inputs)
    errors = {"o": rel_err(o, torch.stack(ref_o)), "final": rel_err(final, torch.stack(ref_f))}
    errors |= {f"d{n}": rel_err(a, r) for n, a, r in zip("q k v g beta h0".split(), grads, ref_grads)}
    assert max(errors.values()) < (1e-12 if dtype == torch.float64 else 1e-5), errors


@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zero-state"])
def test_one_token_sequences_beside_longer_ones(with_state):
    """Lengths 1, 5, 1, 1, 70 (one-token sequences run in closed form, the others chunked) against the fp64
    per-token loop: outputs, final states and every gradient."""
    lens = [1, 5, 1, 1, 70]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, beta, h0 = inputs = _inputs(1, sum(lens), n_states=len(lens))
    state = h0 if with_state else None
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=cu)
    wo, wf = torch.randn_like(o), torch.randn_like(final)
    grads = torch.autograd.grad((o * wo).sum() + (final * wf).sum(), inputs[:5] + ([h0] if with_state else []))
    loss = 0.0
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ro, rf = gated_delta_rule_reference(*(x[0, a:b] for x in (q, k, v, g, beta)),
                                            initial_state=h0[n] if with_state else None)
        assert rel_err(o[0, a:b], ro) < 1e-5 and rel_err(final[n], rf) < 1e-5, n
        loss = loss + (ro * wo[0, a:b]).sum() + (rf * wf[n]).sum()
    ref_grads = torch.autograd.grad(loss, inputs[:5] + ([h0] if with_state else []))
    for name, a, r in zip("q k v g beta h0".split(), grads, ref_grads):
        assert rel_err(a, r) < 1e-5, name


def test_matches_hugging_face_recurrent_and_chunked():
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, h0 = (x.detach() for x in _inputs(2, 150, dk=16, dv=24))
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        ref_o, ref_f = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert rel_err(o, ref_o) < 1e-5 and rel_err(final, ref_f) < 1e-5, fn.__name__


def test_varlen_equals_one_call_per_sequence():
    """Lengths 10, 0 (empty), 64, 129, 21: each range independent, with its own initial state."""
    cu = torch.tensor([0, 10, 10, 74, 203, 224])
    q, k, v, g, beta, h0 = inputs = _inputs(1, 224, n_states=5)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    wo, wf = torch.randn_like(o), torch.randn_like(final)
    grads = torch.autograd.grad((o * wo).sum() + (final * wf).sum(), inputs)
    loss = 0.0
    for n in range(5):
        a, b = int(cu[n]), int(cu[n + 1])
        so, sf = chunk_gated_delta_rule(*(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=h0[n : n + 1],
                                        output_final_state=True) if b > a else (wo[:, a:b], h0[n : n + 1])
        assert rel_err(final[n], sf[0]) < 1e-6, n
        if b > a:
            assert rel_err(o[:, a:b], so) < 1e-6, n
        loss = loss + (so * wo[:, a:b]).sum() + (sf[0] * wf[n]).sum()
    ref_grads = torch.autograd.grad(loss, inputs)
    for name, a, r in zip("q k v g beta h0".split(), grads, ref_grads):
        assert rel_err(a, r) < 1e-5, name


def test_defaults_scale_dtype_and_no_final_state():
    q, k, v, g, beta, _ = (x.detach() for x in _inputs(1, 70))
    o, final = chunk_gated_delta_rule(q, k, v, g, beta)
    assert final is None
    ref = gated_delta_rule_reference(q[0], k[0], v[0], g[0], beta[0], scale=0.5)[0]
    assert rel_err(chunk_gated_delta_rule(q, k, v, g, beta, scale=0.5)[0][0], ref) < 1e-5
    assert rel_err(o[0], gated_delta_rule_reference(q[0], k[0], v[0], g[0], beta[0])[0]) < 1e-5
    low = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, output_final_state=True)
    assert low[0].dtype == torch.bfloat16 and low[1].dtype == torch.float32


def test_bad_inputs_are_refused_naming_the_tensor():
    q, k, v, g, beta, h0 = (x.detach() for x in _inputs(2, 20))
    with pytest.raises(ValueError, match=r"k must be \[B, T, H, Kd\] like q = \[2, 20, 3, 8\], got shape \(2, 19"):
        chunk_gated_delta_rule(q, k[:, 1:], v, g, beta)
    with pytest.raises(ValueError, match=r"g must be \[B, T, H\] like q"):
        chunk_gated_delta_rule(q, k, v, g[..., None], beta)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, Kd, Vd\] = \[2, 3, 8, 12\]"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="q, k and v must share one dtype"):
        chunk_gated_delta_rule(q, k, v.half(), g, beta)
    with pytest.raises(ValueError, match="beta must be a floating-point tensor"):
        chunk_gated_delta_rule(q, k, v, g, beta.int())
    bad = v.clone()
    bad[1, 3, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite values \(inf or nan\) in v;"):
        chunk_gated_delta_rule(q, k, bad, g, beta)
    with pytest.raises(ValueError, match=r"B == 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 20]))
    one = [x[:1] for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to T = 20"):
        chunk_gated_delta_rule(*one, cu_seqlens=torch.tensor([0, 12, 8, 20]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be an int tensor"):
        chunk_gated_delta_rule(*one, cu_seqlens=torch.tensor([0.0, 20.0]))


@pytest.mark.gpu
def test_fla_varlen_with_states_matches_fla_per_sequence_on_gpu(monkeypatch):
    """bf16 on CUDA runs fla: one varlen call with initial states is within 2x (FlashAttention's rule) the error of
    fla called on each sequence alone (the flat path's kernel), both against the fp32 PyTorch path on the fp32
    inputs: values, final states and gradients of q, k, v, g, beta, initial_state. fp32 on CUDA never runs fla
    (its dots take TF32): it equals the CPU result. Prints fla's own fp32 error for the record."""
    if not torch.cuda.is_available() or chunk_module._fla_chunk_gated_delta_rule is None:
        pytest.skip("needs a CUDA GPU and flash-linear-attention (fla-core >= 0.6)")
    if not os.environ.get("MEGATRON_TREE_FLA_CHECK"):
        pytest.skip(FLA_OFF)
    monkeypatch.setattr(chunk_module, "FLA_DTYPES", (torch.bfloat16, torch.float16))
    cu = [0, 100, 164, 500, 537]
    inputs = [x.detach().cuda() for x in _inputs(1, 537, h=4, dk=64, dv=128, n_states=4)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    wo = torch.randn(1, 537, 4, 128, device="cuda", generator=gen)
    wf = torch.randn(4, 4, 64, 128, device="cuda", generator=gen)

    def run(xs, fn=chunk_gated_delta_rule, split=False):
        xs = [x.clone().requires_grad_() for x in xs]
        if split:  # each sequence its own call
            parts = [fn(*(x[:, a:b] for x in xs[:5]), initial_state=xs[5][n:n + 1], output_final_state=True)
                     for n, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
            o, final = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts])
        else:
            o, final = fn(*xs[:5], initial_state=xs[5], output_final_state=True,
                          cu_seqlens=torch.tensor(cu, device=xs[0].device))
        loss = (o.float() * wo).sum() + (final.float() * wf).sum()
        return [o, final, *torch.autograd.grad(loss, xs)]

    exact = run(inputs)
    cpu = run([x.cpu() for x in inputs])
    for a, b in zip(exact, cpu):
        assert rel_err(a.cpu(), b) < 1e-5
    low = [x.bfloat16() if i < 3 else x for i, x in enumerate(inputs)]  # q, k, v bf16; g, beta, h0 fp32
    varlen, alone = run(low), run(low, split=True)
    fla32 = run(inputs, fn=chunk_module._fla_chunk_gated_delta_rule)
    for name, a, b, e, f in zip("o final dq dk dv dg dbeta dh0".split(), varlen, alone, exact, fla32):
        print(f"{name}: fla varlen bf16 {rel_err(a, e):.2e}, fla per sequence bf16 {rel_err(b, e):.2e}, "
              f"fla fp32 {rel_err(f, e):.2e}")
        assert rel_err(a, e) <= 2 * rel_err(b, e) + 1e-6, name

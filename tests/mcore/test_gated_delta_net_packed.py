"""``TreeGatedDeltaNet`` with THD ``packed_seq_params`` (the flat baseline of Megatron's sequence packing): every packed
sequence equals that sequence run alone, outputs and gradients (CPU, fp32), and bad packing is refused. In fp64 (the
layer cast) a tree equals its sequences packed to 1e-12.

The sequences: one longer than a 64-token chunk of the scan, one shorter than the conv window, one of a single token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from forests import dfs_layout
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_tree.mcore.gated_delta_net import TreeGatedDeltaNet
from megatron_tree.runtime import save_tiny_hf_checkpoint

LENGTHS = (5, 70, 2, 1, 13)
TOL = 1e-5


@pytest.fixture(scope="module")
def layer(tmp_path_factory, cpu_megatron):
    """Layer 0 (Gated DeltaNet) of a tiny Qwen3.5, fp32."""
    from megatron_tree.mcore.bridge import build_model

    path = save_tiny_hf_checkpoint("qwen3_5", tmp_path_factory.mktemp("tiny") / "qwen3_5")
    model = build_model(path, tree=False, wrap_with_ddp=False)[1][0]
    gdn = model.decoder.layers[0].self_attention
    assert isinstance(gdn, TreeGatedDeltaNet)
    return gdn


def thd(lengths, dtype=torch.int32) -> PackedSeqParams:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)
    longest = max(lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def outputs_and_grads(layer, x, forward):
    """``forward(x)`` [s, 1, h] and the gradients of a fixed random weighting of it (input, parameters)."""
    for p in layer.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    out = forward(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_packed_sequences_equal_each_sequence_alone(layer):
    x = torch.randn(sum(LENGTHS), 1, layer.hidden_size, generator=torch.Generator().manual_seed(0))
    params = thd(LENGTHS)
    got = outputs_and_grads(layer, x, lambda x: layer(x, None, packed_seq_params=params)[0])
    want = outputs_and_grads(layer, x, lambda x: torch.cat([layer(part, None)[0] for part in x.split(LENGTHS)]))
    for g, w in zip(got[:2], want[:2]):
        assert (g - w).abs().max() < TOL * w.abs().max()
    for name, w in want[2].items():
        err = (got[2][name] - w).abs().max() / w.abs().max()
        assert err < TOL, (name, float(err))
    # the row as one sequence (no reset at the sequence starts) is far off: the comparison can fail
    whole = outputs_and_grads(layer, x, lambda x: layer(x, None)[0])
    assert (whole[0] - want[0]).abs().max() > 1e-3 * want[0].abs().max()


def test_fp64_tree_equals_its_sequences_packed(layer):
    """The layer in fp64 (its conv, l2 norm, decay and scan then compute in fp64): a tree as an interval-vector mask
    (a prompt with a short sibling before a 70-token branch, a branch off that one, a strict prefix, a second root)
    vs its sequences packed (THD, each alone): every slot's output (from the first sequence through it) and the
    gradients of the input and of every parameter within 1e-12 relative; a sibling's token changed is far off."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 1000, 20).tolist()
    long = prompt + [3] + rng.integers(10, 1000, 70).tolist()
    seqs = [prompt + [1, 5, 6], long, long[:50] + [4] + rng.integers(10, 1000, 9).tolist(), prompt[:8],
            rng.integers(10, 1000, 12).tolist()]
    end, paths = dfs_layout(seqs)
    index = torch.tensor(sum(paths, []))
    owned = torch.zeros(index.shape[0], dtype=torch.bool)
    owned[np.unique(index.numpy(), return_index=True)[1]] = True
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(end.shape[0], 1, layer.hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(x.shape, generator=gen, dtype=torch.float64)

    def run(x, tree):
        for p in layer.parameters():
            p.grad = None
        x = x.detach().requires_grad_()
        if tree:
            out = layer(x, end[None])[0]
        else:
            packed = layer(x[index], None, packed_seq_params=thd([len(p) for p in paths]))[0]
            out = packed.new_empty(x.shape)
            out[index[owned]] = packed[owned]
        (out * weight).sum().backward()
        return {"out": out.detach(), "x": x.grad} | {n: p.grad for n, p in layer.named_parameters()}

    layer.double()  # fp32 -> fp64 -> fp32 gives back the same weights
    try:
        tree, packed = run(x, True), run(x, False)
        moved = x.clone()
        moved[paths[0][-1]] += 1  # the short sibling's last token: a slot no other sequence reads
        wrong = run(moved, True)
    finally:
        layer.float()
    errors = {n: float((tree[n] - w).abs().max() / w.abs().max()) for n, w in packed.items()}
    assert tree["out"].dtype == torch.float64 and max(errors.values()) < 1e-12, errors
    assert (wrong["out"] - packed["out"]).abs().max() > 1e-3 * packed["out"].abs().max()


def test_layout_is_built_once_per_micro_batch(layer, monkeypatch):
    """Every layer (and recompute) reads the layout cached on ``cu_seqlens_q``'s memory."""
    from megatron_tree.attention.dispatch import PREPARED_MASKS
    from megatron_tree.mcore import gated_delta_net

    calls = []
    real = gated_delta_net.packed_scan_layout
    monkeypatch.setattr(gated_delta_net, "packed_scan_layout", lambda *a, **k: calls.append(1) or real(*a, **k))
    PREPARED_MASKS.clear()
    params = thd(LENGTHS)
    x = torch.randn(sum(LENGTHS), 1, layer.hidden_size)
    with torch.no_grad():
        layer(x, None, packed_seq_params=params)
        layer(x, None, packed_seq_params=params)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(qkv_format="sbhd"), "THD format"),
        (dict(cu_seqlens_kv=torch.tensor([0, 91])), "cu_seqlens_kv must be None or the same tensor"),
        (dict(cu_seqlens_q_padded=torch.tensor([0, 91])), "padded THD segments are not supported"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 80])), "ends at 80, but the packed row holds s = 91"),
        (dict(cu_seqlens_q=torch.tensor([1, 5, 91])), "must rise from 0"),
    ],
)
def test_bad_packing_is_refused(layer, change, match):
    params = thd(LENGTHS)
    for key, value in change.items():
        setattr(params, key, value)
        if key == "cu_seqlens_q":
            params.cu_seqlens_kv = value
    with pytest.raises(ValueError, match=match), torch.no_grad():
        layer(torch.randn(sum(LENGTHS), 1, layer.hidden_size), None, packed_seq_params=params)


def test_tree_mask_and_packed_seq_params_together_are_refused(layer):
    mask = torch.arange(1, sum(LENGTHS) + 1)[None]
    with pytest.raises(ValueError, match="a tree attention_mask and packed_seq_params"), torch.no_grad():
        layer(torch.randn(sum(LENGTHS), 1, layer.hidden_size), mask, packed_seq_params=thd(LENGTHS))

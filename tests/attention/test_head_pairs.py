"""The per-query-head GQA backward's two element-wise steps (:mod:`megatron_tree.attention.head_pairs`), used by the FA4
and cudnn_flex tree backends: K/V repeated to head pairs (bit copies, the memory order kept) and dK / dV pairs added
(fp32 sum rounded once), on a ragged T and a head dim that is not a power of two, in both memory orders."""

from __future__ import annotations

import pytest
import torch

from megatron_tree.attention.head_pairs import add_head_pairs, repeat_heads

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_major", [True, False])
def test_head_pairs_are_exact(head_major, device):
    g = torch.Generator(device=device).manual_seed(6)
    heads_first = torch.randn(2, 4, 301, 96, device=device, generator=g).bfloat16()  # [b, hkv, T, d]
    x = heads_first.transpose(1, 2) if head_major else heads_first.transpose(1, 2).contiguous()
    repeated = repeat_heads(x)
    assert torch.equal(repeated, x.repeat_interleave(2, dim=2))
    assert (repeated.stride(2) > repeated.stride(1)) == head_major
    grads = torch.randn(2, 301, 8, 96, device=device, generator=g).bfloat16()
    if head_major:
        grads = grads.transpose(1, 2).contiguous().transpose(1, 2)
    summed = add_head_pairs(grads, like=x)
    assert summed.stride() == x.stride()
    assert torch.equal(summed, grads.float().unflatten(2, (4, 2)).sum(3).bfloat16())
    assert not torch.equal(summed, grads[:, :, 0::2])  # the second head of each pair counts


def test_a_thd_tensor_unsqueezed_keeps_its_layout():
    """cudnn_flex's varlen call: THD [T, hkv, d] tensors, seen as [1, T, hkv, d]."""
    x = torch.randn(37, 3, 16).bfloat16()
    repeated = repeat_heads(x.unsqueeze(0))
    assert repeated.shape == (1, 37, 6, 16) and repeated.squeeze(0).is_contiguous()
    assert torch.equal(add_head_pairs(repeated, like=x.unsqueeze(0)), (2 * x.float()).bfloat16().unsqueeze(0))

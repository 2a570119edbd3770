"""What the GPU tests of the tree attention kernels (FA4, cuDNN flex) compare against: branching trees of the
packer, bf16-representable inputs, one forward + backward, the dense-mask SDPA reference."""

import numpy as np
import torch
import torch.nn.functional as F

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch


def gpu_tree(kind: str, max_tokens: int = 3000) -> torch.Tensor:
    """``subtree_end`` int32 [T] on the GPU of :func:`tree_micro_batch`."""
    return tree_micro_batch(kind, max_tokens).attention_mask[0].cuda()


def tree_micro_batch(kind: str, max_tokens: int = 3000):
    """One packed micro-batch (on the CPU): ``"grpo"`` (siblings after a long shared prompt) or ``"multi_turn"`` (deep,
    branching trees with short nodes)."""
    rng = np.random.default_rng(7)
    if kind == "grpo":
        seqs = grpo_batch(rng, n_prompts=2, samples=(4, 8), prompt_len=(300, 900), response_len=(20, 400), vocab=1000)
    else:
        seqs = multi_turn_batch(rng, n_conversations=3, turns=(4, 10), turn_len=(5, 120), fork_prob=0.4,
                                system_len=200, vocab=1000)
    return pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=max_tokens))[0]


def fwd_bwd(fn, base, dtype):
    """fp32 ``[out, dq, dk, dv]`` of ``fn(q, k, v)`` on ``base = (q, k, v, grad_out)`` cast to ``dtype``."""
    q, k, v = (x.to(dtype, copy=True).requires_grad_() for x in base[:3])
    out = fn(q, k, v)
    out.backward(base[3].to(dtype))
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def rel_errors(xs, refs):
    return [((x - r).norm() / r.norm()).item() for x, r in zip(xs, refs)]


def bf16_inputs(t, tq, heads, kv_heads, d, seed=0):
    """q [1, h, Tq, d], k / v [1, hkv, T, d], grad_out [1, h, Tq, d] in fp32 holding bf16-representable values (the fp32
    reference and the bf16 kernels see the same inputs)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((1, heads, tq, d), (1, kv_heads, t, d), (1, kv_heads, t, d), (1, heads, tq, d))
    return [torch.randn(s, device="cuda", generator=g).bfloat16().float() for s in shapes]


def dense_attention(mask, scale=None):
    """SDPA with the dense bool mask [Tq, T] (GQA by ``enable_gqa``)."""
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


def frontend_flex(query, key, value, mask, scale):
    """cuDNN frontend's own ``flex_attn_func`` on the plan of ``mask`` (a ``CudnnFlexTreeMask``), in the layout of
    ``megatron_tree.attention.cudnn_flex._flex`` (query [1, h, Tq, d], key / value [1, hkv, T, d]): the call whose
    per-call Python ``megatron_tree.attention.cudnn_flex_kernels`` skips."""
    from cudnn.flex_attention import flex_attn_func

    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    plan = mask.plan(q, k, v, torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)))
    if mask.cu_seqlens is None:
        return flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale).transpose(1, 2)
    thd = (x.squeeze(0) for x in (q, k, v))
    return flex_attn_func(*thd, mask_plan=plan, softmax_scale=scale).unsqueeze(0).transpose(1, 2)

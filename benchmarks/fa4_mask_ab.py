"""The patched Hopper path for the tree ``mask_mod`` s (``megatron_tree/attention/fa4_kernels.py``) against FA4's own, one CUDA GPU.

    python benchmarks/fa4_mask_ab.py --out benchmarks/results/te/fa4_mask_ab.json

Same block tables and inputs; ``lean`` is ``fa4_tree_attention`` (our registered ``mask_mod``: the lean mask and,
with two query heads per K/V head, the backward per query head), ``generic`` calls FA4's ``flash_attn_func`` with an
identical but unregistered ``mask_mod``, which FA4 applies element by element, with its own GQA backward. Per
attention_bench workload: forward and forward + backward ms of each (``attention_bench.time_fwd_bwd``, 10 calls
after 3) and the largest relative difference of out / dq / dk / dv (dq: order of atomic adds; dk / dv: the
per-query-head backward rounds each head's share to bf16 before adding)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import attention_bench as ab  # noqa: E402

from megatron_tree.attention.fa4 import fa4_tree_attention, fa4_tree_mask  # noqa: E402


def _generic_tree_mask():
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def generic_tree_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        end = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0]], cutlass.Int32)
        return (kv_idx <= q_idx) & (q_idx < end)

    return generic_tree_mask


def main():
    args = ab.fa4_harness_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    from flash_attn.cute.interface import flash_attn_func

    generic_mask = _generic_tree_mask()

    class Timing:
        warmup, iters = 3, 10

    dev = torch.device("cuda")
    loads = ab.workloads(0)
    result = {}
    for name in ["grpo", "multi_turn", "no_sharing", "long_multi_turn"]:
        gen = torch.Generator(device=dev).manual_seed(0)
        slots = ab.LONG_WORKLOADS.get(name, ab.SLOTS)
        end = ab.fullest_micro_batch(loads[name], slots).attention_mask[0].to(device=dev, dtype=torch.int32)
        q, k, v, g = ab.bf16_inputs(end.shape[0], dev, gen)
        mask = fa4_tree_mask(end)

        def lean(q, k, v):
            return fa4_tree_attention(q, k, v, mask)

        def generic(q, k, v):
            return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask_mod=generic_mask,
                                   aux_tensors=list(mask.aux), block_sparse_tensors=mask.forward,
                                   block_sparse_tensors_bwd=mask.backward)[0].transpose(1, 2)

        vals = {}
        for label, fn in (("generic", generic), ("lean", lean)):
            for x in (q, k, v):
                x.grad = None
            out = fn(q, k, v)
            out.backward(g)
            vals[label] = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
        diff = {n: float((a - b).abs().max() / b.abs().max())
                for n, a, b in zip(("out", "dq", "dk", "dv"), vals["lean"], vals["generic"])}
        row = {"lean": ab.time_fwd_bwd(lean, [q, k, v], g, Timing),
               "generic": ab.time_fwd_bwd(generic, [q, k, v], g, Timing), "lean_vs_generic": diff}
        result[name] = row
        print(name, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Bad input to tree_forward_backward gives a clear ValueError.

    torchrun --nproc-per-node 2 tests/scripts/schedule_errors.py --ckpt DIR --pp 2 --vpp 2
    torchrun --nproc-per-node 1 tests/scripts/schedule_errors.py --ckpt DIR
    torchrun --nproc-per-node 2 tests/scripts/schedule_errors.py --ckpt DIR --cp 2

The loss-function checks run at PP=1 only: a loss error is raised on the last pipeline
stage alone, and the other stages would wait for it.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.mcore.bridge import build_flat_model, build_tree_model
from megatron_tree.runtime import cpu_mode, init_cpu_distributed, save_tiny_hf_checkpoint
from megatron_tree.compat import apply_compat_patches


def expect(fn, pattern: str) -> None:
    try:
        fn()
    except ValueError as e:
        if pattern not in str(e):
            raise AssertionError(f"error {e!r} does not mention {pattern!r}") from e
        print(f"OK raised: {str(e)[:100]}", flush=True)
        return
    raise AssertionError(f"no ValueError mentioning {pattern!r}")


def moe_errors(args, tree_forward_backward) -> None:
    """Expert-parallel ranks with different micro-batch counts (pack_trees without dp_group) are refused
    instead of deadlocking in the token exchange."""
    import torch.distributed as dist

    init_cpu_distributed(ep=args.ep)
    path = save_tiny_hf_checkpoint("qwen3_moe", args.ckpt, num_hidden_layers=2)
    _, model = build_tree_model(path, wrap_with_ddp=True)
    rng = np.random.default_rng(dist.get_rank())
    seqs = [rng.integers(0, 100, 20) for _ in range(1 + 5 * dist.get_rank())]
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=24))  # no dp_group: 1 vs 6 micro-batches
    expect(lambda: tree_forward_backward(model, mbs, lambda lp, mb: (-lp.sum(), lp.numel())), "need the same count")


def cp_errors(args, tree_forward_backward) -> None:
    """Context-parallel ranks fed different micro-batches are refused (they would attend to each
    other's keys), and so is the upstream model under CP without TE."""
    import torch.distributed as dist

    init_cpu_distributed(cp=args.cp)
    path = save_tiny_hf_checkpoint("qwen3", args.ckpt, num_hidden_layers=2)
    _, model = build_tree_model(path, wrap_with_ddp=True)
    rng = np.random.default_rng(dist.get_rank())  # a different batch on each CP rank
    mbs = pack_trees([rng.integers(0, 100, 20) for _ in range(3)], MicroBatchSpec(max_tokens_per_mb=48))
    expect(lambda: tree_forward_backward(model, mbs, lambda lp, mb: (-lp.sum(), lp.numel())),
           "context-parallel ranks hold different micro-batches")
    # A subtle difference (two tokens swapped on one rank) is caught too.
    same = pack_trees([np.arange(10, 30), np.arange(10, 25)], MicroBatchSpec(max_tokens_per_mb=48))
    swapped = pack_trees([np.r_[np.arange(10, 28), 29, 28], np.arange(10, 25)], MicroBatchSpec(max_tokens_per_mb=48))
    expect(lambda: tree_forward_backward(model, swapped if dist.get_rank() else same, lambda lp, mb: (-lp.sum(), lp.numel())),
           "context-parallel ranks hold different micro-batches")
    expect(lambda: build_flat_model(path), "megatron-core's own attention has no context parallel")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int)
    ap.add_argument("--ep", type=int, default=1, help="EP > 1: only the MoE checks (unequal micro-batch counts)")
    ap.add_argument("--cp", type=int, default=1, help="CP > 1: only the context-parallel checks")
    args = ap.parse_args()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    from megatron_tree.mcore.schedule import flat_forward_backward, tree_forward_backward

    with apply_compat_patches(), cpu_mode():
        if args.ep > 1:
            moe_errors(args, tree_forward_backward)
            sys.exit(0)
        if args.cp > 1:
            cp_errors(args, tree_forward_backward)
            sys.exit(0)
        init_cpu_distributed(pp=args.pp, vpp=args.vpp)
        path = save_tiny_hf_checkpoint("qwen3", args.ckpt, num_hidden_layers=4)
        _, model = build_tree_model(path)
        config = get_model_config(model[0])
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, 100, 20) for _ in range(6)]
        mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=48, n_mbs=2, n_mbs_divisor=2))

        def good_loss(lp, mb):
            return -lp.sum(), lp.numel()

        config.calculate_per_token_loss = False
        expect(lambda: tree_forward_backward(model, mbs, good_loss), "calculate_per_token_loss=True")
        config.calculate_per_token_loss = True
        # Not wrapped in DDP and no finalize_model_grads_func: gradients would never be divided.
        expect(lambda: tree_forward_backward(model, mbs, good_loss), "finalize_model_grads_func is unset")
        config.finalize_model_grads_func = lambda *args, **kwargs: None  # the user's own: kept as it is
        too_big = pack_trees([np.array([1, 2, 3]), np.array([1, 2, 500])], MicroBatchSpec(max_tokens_per_mb=48, n_mbs=2))
        expect(lambda: tree_forward_backward(model, too_big, good_loss), "vocabulary has 160 tokens")
        if ps.get_data_parallel_world_size() > 1:
            # Wrapped in DDP before calculate_per_token_loss was set: its buffers pre-divide by DP.
            _, ddp_model = build_tree_model(path, wrap_with_ddp=True, extra_args=dict(calculate_per_token_loss=False))
            get_model_config(ddp_model[0]).calculate_per_token_loss = True
            expect(lambda: tree_forward_backward(ddp_model, mbs, good_loss), "before calculate_per_token_loss=True")
        if args.vpp:
            three = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=48, n_mbs=3))
            assert len(three) == 3
            expect(lambda: tree_forward_backward(model, three, good_loss), f"microbatch_group_size_per_vp_stage={args.pp}")
        else:
            expect(lambda: tree_forward_backward(model, mbs, lambda lp, mb: (-lp, lp.numel())), "scalar tensor")
            expect(lambda: tree_forward_backward(model, mbs, lambda lp, mb: -lp.sum()), "(loss_sum, count)")
            # Training through TE's THD packing at head dim 256 (its backward measured wrong on the H200) is refused.
            wide = save_tiny_hf_checkpoint("qwen3", args.ckpt + "_hd256", num_hidden_layers=1, head_dim=256)
            _, flat = build_flat_model(wide, wrap_with_ddp=True)
            flat_mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=48), share_prefixes=False)
            expect(lambda: flat_forward_backward(flat, flat_mbs, good_loss), "backward gives wrong gradients at head dim 256")
        print("OK all checks", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()

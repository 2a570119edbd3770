"""verify_tree_model at TP=2 and at PP=2 (torchrun, 2 gloo processes, fp32): a tree model
passes, and the same model with RoPE on packed slot indices fails on every rank alike.

    torchrun --nproc-per-node 2 tests/scripts/verify_dist.py --ckpt DIR

Prints ``VERIFY rank=R layout=L error=E tolerance=T bad_error=B`` per layout.
"""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from megatron_tree.mcore.bridge import build_tree_model
from megatron_tree.compat import apply_compat_patches
from megatron_tree.mcore.rope import TreeRotaryEmbedding
from megatron_tree.runtime import cpu_mode, destroy_distributed, init_cpu_distributed, save_tiny_hf_checkpoint
from megatron_tree.mcore.verify import verify_tree_model


def packed_index_rope(self, max_seq_len, *args, **kwargs):
    """TreeRotaryEmbedding.forward that ignores position_ids: upstream RoPE by slot index."""
    return self.inner(max_seq_len, *args, **kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    args = ap.parse_args()
    with apply_compat_patches(), cpu_mode():
        for layout, sizes in (("tp2", dict(tp=2)), ("pp2", dict(pp=2))):
            init_cpu_distributed(**sizes)
            path = save_tiny_hf_checkpoint("qwen3", args.ckpt)
            _, model = build_tree_model(path, wrap_with_ddp=False)
            report = verify_tree_model(model)
            real = TreeRotaryEmbedding.forward
            TreeRotaryEmbedding.forward = packed_index_rope
            try:
                bad = verify_tree_model(model, raise_on_mismatch=False)
                try:  # every rank raises, or a pipeline stage would wait for the others
                    verify_tree_model(model)
                except RuntimeError as e:
                    assert "not exact" in str(e), e
                else:
                    raise AssertionError(f"{layout}: verify_tree_model passed a model with packed-index RoPE")
            finally:
                TreeRotaryEmbedding.forward = real
            print(
                f"VERIFY rank={dist.get_rank()} layout={layout} error={report.max_error:.3e} "
                f"tolerance={report.tolerance:.3e} bad_error={bad.max_error:.3e} grad_error={report.grad_error:.3e} "
                f"grad_tolerance={report.grad_tolerance:.3e}",
                flush=True,
            )
    destroy_distributed()  # as the other scripts: gloo's threads left to interpreter exit can abort it
    sys.exit(0)


if __name__ == "__main__":
    main()

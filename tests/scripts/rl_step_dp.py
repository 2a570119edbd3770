"""examples/rl_step.py over data-parallel ranks: every rank's gradient equals the single-process one.

Run: torchrun --standalone --nproc-per-node 2 tests/scripts/rl_step_dp.py WORK_DIR SINGLE_GRADS

Every rank builds the example's policy from the tiny Qwen3 checkpoint in WORK_DIR/ckpt, takes
one ``grpo_step`` on :func:`perturbed_rollout` (each rank trains its share of the prefix
groups) and compares its DDP gradient (``param.main_grad``) with SINGLE_GRADS (``torch.save``
of ``{name: grad}`` from the same step in one process) and with every other rank's. Rank 0
prints ``RLSTEP rank=R sequences=K/N single_rel=... cross_rank=...`` for each rank; then the
example's ``main`` runs two steps. Exit status 1 when a gradient differs by 1e-5 (relative)
or more.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

TOL = 1e-5
MAX_TOKENS_PER_MB = 48


def load_example():
    """``examples/rl_step.py`` as the module ``rl_step`` (loaded once)."""
    if "rl_step" not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "examples" / "rl_step.py"
        spec = importlib.util.spec_from_file_location("rl_step", path)
        sys.modules["rl_step"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(sys.modules["rl_step"])
    return sys.modules["rl_step"]


def perturbed_rollout(rl_step, model, vocab: int):
    """The example's rollout, with old log-probs moved by N(0, 0.3^2) (fixed seed), as from an
    inference engine that is off the trainer: ratios differ from 1 and some tokens clip."""
    batch = rl_step.synthetic_rollout(model, vocab, seed=0, max_tokens_per_mb=MAX_TOKENS_PER_MB)
    gen = torch.Generator().manual_seed(7)
    batch.old_logprobs = [lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in batch.old_logprobs]
    return batch


def main_grads(model) -> dict[str, torch.Tensor]:
    """This rank's step gradient from the DDP buffers, by parameter name without the DDP prefix."""
    return {name.removeprefix("module."): p.main_grad.detach().clone() for name, p in model[0].named_parameters()}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over parameters of max|got - want| / max|want|."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)).item() for n in want)


def main() -> int:
    work_dir, single_path = sys.argv[1], sys.argv[2]
    rl_step = load_example()
    from megatron_tree.runtime import cpu_mode, init_cpu_distributed, save_tiny_hf_checkpoint

    with cpu_mode():
        init_cpu_distributed()
        path = save_tiny_hf_checkpoint("qwen3", os.path.join(work_dir, "ckpt"))
        bridge, model, optimizer = rl_step.build_policy(path, bf16=False, lr=1e-4)
        batch = perturbed_rollout(rl_step, model, bridge.hf_config.vocab_size)
        rec = rl_step.grpo_step(model, optimizer, batch, max_tokens_per_mb=MAX_TOKENS_PER_MB)
        grads = main_grads(model)
        single = relative_error(grads, torch.load(single_path))
        flat = torch.cat([grads[n].flatten() for n in sorted(grads)])
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        cross = max((g - every[0]).abs().max().item() / every[0].abs().max().item() for g in every)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (dist.get_rank(), rec["sequences"], len(batch.sequences), single, cross))
        if dist.get_rank() == 0:
            for r, k, n, s, c in rows:
                print(f"RLSTEP rank={r} sequences={k}/{n} single_rel={s:.3g} cross_rank={c:.3g}", flush=True)
        failed = any(s >= TOL or c >= TOL for *_, s, c in rows)
        rl_step.main(["--hf-path", path, "--steps", "2", "--max-tokens-per-mb", str(MAX_TOKENS_PER_MB)])
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())

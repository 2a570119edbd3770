"""Router statistics of one tree micro-batch under sequence parallel, at the router (the local spec
cannot run sequence parallel, so no model here): two ranks route the two halves of its slots with
megatron-core's reductions over their TP group (gloo), against one router that routes all of them
alone; same logits, same weights.

    torchrun --nproc-per-node 2 tests/scripts/router_stats_sp.py

Compared: the gradient of the logits (each rank's rows; aux, seq-aux and global-aux losses, z-loss
and a probability-weighted stand-in for the experts' loss), the logged values (each rank's share,
summed over the group) and the per-expert counts (expert-bias counts summed; global-aux counts as
they are). ``unweighted``: upstream routers on the same split, each slot counted once.
Prints ``ROUTERSP rank=R grad=... logged=... counts=... unweighted_grad=...``; exits non-zero on a
mismatch.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.compat import apply_compat_patches
from megatron_tree.mcore.router_stats import _slot_weights, tree_padding_mask, weighted_router_statistics
from megatron_tree.runtime import cpu_mode, init_distributed

TOL = 1e-5
EXPERTS = 6


def router(group, solo, *, sequence_parallel: bool, weighted: bool = True):
    """A TopKRouter (sigmoid scores, top-2) with every statistic on, over ``group`` (tp = tp_cp = tp_dp_cp;
    cp = ``solo``, this rank alone)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[0.3, 0.2, 0.1], moe_z_loss_coeff=0.1, calculate_per_token_loss=True,
        tensor_model_parallel_size=group.size(), sequence_parallel=sequence_parallel, use_cpu_initialization=True,
        add_bias_linear=False,
    )  # fmt: skip
    pgs = ProcessGroupCollection(tp=group, cp=solo, tp_cp=group, tp_dp_cp=group)
    r = TopKRouter(config, pg_collection=pgs)
    r.set_layer_number(1)
    if weighted:
        for patch in weighted_router_statistics(r, _slot_weights):
            patch.apply()
    return r


def route(r, logits: torch.Tensor, mask: torch.Tensor | None, upstream_grad: torch.Tensor) -> dict:
    """Gradient of ``logits`` [t, 1, E], logged values and counts of one training routing call."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from scripts.router_stats_parity import _logged

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(()))
    _logged()
    logits = logits.detach().clone().requires_grad_()
    probs, _ = r.routing(logits, padding_mask=mask)
    (probs * upstream_grad.reshape(probs.shape)).sum().backward()
    counts = {k: getattr(r, f"{k}_tokens_per_expert").clone().double() for k in ("local", "global")
              if getattr(r, f"{k}_tokens_per_expert") is not None}  # fmt: skip
    return dict(grad=logits.grad.double(), logged=_logged(), counts=counts)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> None:
    with apply_compat_patches(), cpu_mode():
        init_distributed(tp=2, seed=7)
        rank, world = dist.get_rank(), dist.get_world_size()
        solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
        group = dist.new_group(list(range(world)))
        rng = np.random.default_rng(0)  # the same micro-batch and logits on every rank
        prompt = rng.integers(0, 100, 9)
        seqs = [np.concatenate([prompt, rng.integers(0, 100, n)]) for n in (2, 5, 14)] + [rng.integers(0, 100, 7)]
        seqs.append(seqs[2][:12].copy())
        mb = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=200), pad_to_multiple_of=8)[0]
        t = mb.num_slots
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(t, 1, EXPERTS, generator=gen)
        upstream_grad = torch.randn(t, 1, EXPERTS, generator=gen)  # stands in for the experts' loss
        mask = tree_padding_mask(mb).transpose(0, 1)  # [T, 1], as MoELayer hands it over

        ref = route(router(solo, solo, sequence_parallel=False), logits, mask, upstream_grad)
        part = slice(rank * t // world, (rank + 1) * t // world)
        # GPTModel gives each sequence-parallel rank its part of the mask (a view of it, for b = 1).
        sp = route(router(group, solo, sequence_parallel=True), logits[part], mask[part], upstream_grad[part])
        # (no padding mask: megatron-core's expert-bias count fails on one, [N, E] & [N])
        unweighted = route(router(group, solo, sequence_parallel=True, weighted=False), logits[part], None,
                           upstream_grad[part])  # fmt: skip
        for run in (sp, unweighted):
            for values in (run["logged"], {k: v for k, v in run["counts"].items() if k == "local"}):
                for v in values.values():
                    dist.all_reduce(v, group=group)

        def errors(run):
            return dict(
                grad=rel(run["grad"], ref["grad"][part]),
                logged=max((rel(run["logged"][k], v) for k, v in ref["logged"].items()), default=0.0),
                counts=max((rel(run["counts"][k], v) for k, v in ref["counts"].items()), default=0.0),
            )

        got, off = errors(sp), errors(unweighted)
        assert sp["logged"].keys() == ref["logged"].keys() == {
            "load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss"
        }, sp["logged"].keys()  # fmt: skip
        fields = " ".join(f"{k}={v:.3e}" for k, v in got.items())
        print(f"ROUTERSP rank={rank} slots={t} {fields} unweighted_grad={off['grad']:.3e} "
              f"unweighted_counts={off['counts']:.3e}", flush=True)  # fmt: skip
        ok = max(got.values()) < TOL and max(off["grad"], off["counts"]) > 0.1
        dist.barrier()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""One training step of a tiny Qwen3-MoE with Megatron's router statistics on: tree micro-batches
vs the same micro-batches' sequences run flat, with the same grouping, through

* the upstream (causal) model: each micro-batch's sequences one row each, padding masked
  (``GPTModel(..., padding_mask=)``) — Megatron's own statistics of those tokens;
* the tree model on the sequences laid out as separate chains (no sharing, multiplicity 1).

Compared, per case (``CASES``): the loss, every parameter's gradient (max |diff| / max |ref| per
parameter), the values logged to Megatron's aux-loss tracker, and the per-expert token counts
the routers keep (``local_tokens_per_expert`` for expert bias, ``global_tokens_per_expert``).
``unweighted`` is the tree step of a model whose routers count every slot once (the behaviour
without multiplicity weighting); it must be far off.

    torchrun --nproc-per-node 2 tests/scripts/router_stats_parity.py --ep 2 --ckpt DIR
    torchrun --nproc-per-node 1 tests/scripts/router_stats_parity.py --ckpt DIR --dump D1
    torchrun --nproc-per-node 2 tests/scripts/router_stats_parity.py --cp 2 --ckpt DIR --dump D2

Under context parallel (``--cp``) each step is the CP ranks' steps combined (:func:`combine_ranks`);
Megatron's own model cannot run CP on the CPU, so the in-job reference is the chains, and ``--dump``
saves each case's tree and unweighted steps (``D/CASE.pt``, rank 0) for a test to :func:`compare` with
the one-rank job's tree step (which matches the rows).

Runs on CPU (gloo) and on GPUs (NCCL; fp32 exactness there needs NVIDIA_TF32_OVERRIDE=0).

Prints one ``ROUTERSTATS rank=R case=C ...`` line per case and exits non-zero on a mismatch.
The functions are also used in-process by ``tests/mcore/test_moe_router_stats.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from unittest import mock

import numpy as np
import torch

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.ops.logprobs import vocab_parallel_logprobs
from megatron_tree.ops.losses import sft_loss
from megatron_tree.core.packing import build_micro_batch

TOL = 1e-5

# TransformerConfig overrides of each case; coefficients are large so that a wrong statistic shows.
CASES = {
    "aux_loss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.5),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.5),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.5),
    "z_loss": dict(moe_router_load_balancing_type="none", moe_z_loss_coeff=0.1),
    "expert_bias": dict(
        moe_router_load_balancing_type="none", moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"
    ),
    "all": dict(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[0.3, 0.2, 0.1],
        moe_z_loss_coeff=0.1,
    ),
}


def batch(rng: np.random.Generator, vocab: int) -> list[np.ndarray]:
    """Prompt groups (short samples before a long one), a duplicate, a prefix of another
    sequence, and an unshared sequence."""
    seqs = []
    for g in range(3):
        prompt = rng.integers(0, vocab, 9 + 2 * g)
        for n in (2, 5, 14 + g):
            seqs.append(np.concatenate([prompt, rng.integers(0, vocab, n)]))
    seqs.append(seqs[1].copy())
    seqs.append(seqs[5][:7].copy())
    seqs.append(rng.integers(0, vocab, 11))
    return seqs


def loss_fn(logprobs, mb):
    loss, metrics = sft_loss(logprobs, mb.cu_targets, reduction="sum")
    return loss, metrics["normalizer"]


def build(path: str, case: str, *, tree: bool = True, weighted: bool = True, recompute: str = "none"):
    """Model chunks for ``case`` (DDP-wrapped, fp32); ``weighted=False``: tree model whose
    routers are left as upstream's (each slot counted once)."""
    from megatron_tree.mcore.bridge import build_model

    kwargs = dict(
        recompute=recompute,
        extra_args=dict(attention_dropout=0.0, hidden_dropout=0.0, **CASES[case]),
        wrap_with_ddp=True,
        ddp_config=dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
    )
    # mbridge maps no name for the expert-bias buffer: load the checkpoint into a model
    # without it and copy the weights over.
    bias = CASES[case].get("moe_router_enable_expert_bias", False)
    _clear_tracker()  # its entries are sized by the layer count of the model that made them
    with mock.patch("megatron_tree.mcore.rope.weigh_router_statistics", lambda gpt: None) if not weighted else nullcontext():
        chunks = build_model(path, tree=tree, load_weights=not bias, **kwargs)[1]
    if bias:
        kwargs["extra_args"] = dict(attention_dropout=0.0, hidden_dropout=0.0)
        source = build_model(path, tree=tree, **kwargs)[1]
        for chunk, src in zip(chunks, source):
            missing, unexpected = chunk.module.load_state_dict(src.module.state_dict(), strict=False)
            assert not unexpected and all(k.endswith("expert_bias") for k in missing), (missing, unexpected)
    return chunks


def _clear_tracker() -> None:
    """Drop every entry of Megatron's MoE aux-loss tracker."""
    try:  # megatron-core >= 0.18
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().metrics.clear()
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()


def _logged() -> dict[str, torch.Tensor]:
    """Per-layer values in Megatron's MoE aux-loss tracker (then zeroed)."""
    try:  # megatron-core >= 0.18
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        entries = {k: e.values for k, e in get_moe_metrics_tracker().metrics.items()}
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        entries = {k: e["values"] for k, e in get_moe_layer_wise_logging_tracker().items()}
    out = {k: v.detach().clone().double() for k, v in entries.items()}
    for v in entries.values():
        v.zero_()
    return out


def _step(model, run) -> dict:
    """Loss, gradients by name, logged values and router token counts of one step ``run()``."""
    from megatron.core.transformer.moe.router import TopKRouter

    counts, hooks = {}, []
    for c, chunk in enumerate(model):
        chunk.zero_grad_buffer()
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter):
                def snap(mod, args, out, key=f"{c}.{name}"):
                    for buf in ("local_tokens_per_expert", "global_tokens_per_expert"):
                        if getattr(mod, buf, None) is not None:
                            counts[f"{key}.{buf}"] = getattr(mod, buf).detach().clone().double()
                hooks.append(module.register_forward_hook(snap))
    _logged()
    try:
        losses = run()
    finally:
        for h in hooks:
            h.remove()
    num = torch.zeros(2, dtype=torch.float64)
    for item in losses:  # none on pipeline stages before the last
        num += item["loss"].double().cpu()
    grads = {f"{c}.{n}": p.main_grad.detach().clone().double() for c, ch in enumerate(model) for n, p in ch.named_parameters()}
    return dict(loss=float(num[0] / num[1]) if losses else 1.0, grads=grads, logged=_logged(), counts=counts)


def tree_step(model, mbs) -> dict:
    from megatron_tree.mcore.schedule import tree_forward_backward

    return _step(model, lambda: tree_forward_backward(model, mbs, loss_fn))


def rows_step(model, seqs: list[np.ndarray], groups: list[list[int]]) -> dict:
    """One step of the upstream model: micro-batch i holds ``seqs[j] for j in groups[i]``, one
    right-padded row each, padding masked (no mask where no row is padded); same per-token
    loss and normalisation."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model[0].parameters()).device

    def items():
        for ids in groups:
            lens = [len(seqs[j]) for j in ids]
            tokens = torch.zeros(len(ids), max(lens), dtype=torch.long)
            for r, j in enumerate(ids):
                tokens[r, : lens[r]] = torch.as_tensor(seqs[j])
            pad = torch.arange(max(lens))[None] >= torch.tensor(lens)[:, None]
            yield tokens.to(device), pad.to(device) if pad.any() else None, lens

    def forward_step(data_iterator, chunk):
        tokens, pad, lens = next(data_iterator)
        b, width = tokens.shape
        positions = torch.arange(width, device=device)[None].expand(b, width)
        output = chunk(tokens, positions, None, padding_mask=pad)

        def loss_func(logits):
            slots = torch.cat([r * width + torch.arange(n - 1, device=device) for r, n in enumerate(lens)])
            labels = torch.cat([tokens[r, 1:n] for r, n in enumerate(lens)])
            loss = -vocab_parallel_logprobs(logits.reshape(b * width, -1), slots, labels).sum()
            count = torch.tensor(labels.numel(), dtype=torch.int, device=device)
            return loss, count, {"loss": torch.stack([loss.detach(), count.float()])}

        return output, loss_func

    def run():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=items(),
            model=model[0],
            num_microbatches=len(groups),
            seq_length=max(len(s) for s in seqs),
            micro_batch_size=1,
            forward_only=False,
        )

    return _step(model, run)


def compare(got: dict, want: dict) -> dict[str, float]:
    """Relative errors: loss, worst parameter gradient, worst logged value, worst token count."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    assert got["grads"].keys() == want["grads"].keys() and got["counts"].keys() == want["counts"].keys()
    assert got["logged"].keys() == want["logged"].keys()
    return dict(
        loss=abs(got["loss"] - want["loss"]) / abs(want["loss"]),
        grad=max(rel(got["grads"][k], v) for k, v in want["grads"].items()),
        logged=max((rel(got["logged"][k], v) for k, v in want["logged"].items()), default=0.0),
        counts=max((rel(got["counts"][k], v) for k, v in want["counts"].items()), default=0.0),
    )


def run_case(
    path: str, case: str, seqs: list[np.ndarray], *, max_tokens: int, recompute: str = "none", rows: bool = True
) -> dict:
    """Errors of the tree step (and of the flat chains, and of unweighted routers) against the
    upstream row step, for one case. Micro-batches are padded to a multiple of 8 slots.
    ``rows=False`` (pipeline parallel: rows of varying shape cannot cross stages): the chains
    are the reference.

    Expert bias alone adds no loss, and its token counts add up over the step: its reference
    runs one sequence per micro-batch (megatron-core's expert-bias count breaks on a padding
    mask: ``[N, E] & [N]``). Unweighted routers get no padding mask (as before weighting).
    """
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=max_tokens), pad_to_multiple_of=8)
    groups = [mb.sequence_ids for mb in mbs]
    bias = CASES[case].get("moe_router_enable_expert_bias", False)
    _clear_tracker()  # its entries are sized by the layer count of the model that made them
    # A fresh model per step: finalizing a step with expert bias updates the bias.
    tree = whole_step(tree_step(build(path, case, recompute=recompute), mbs))
    chains_mbs = [build_micro_batch(seqs, g, share_prefixes=False) for g in groups]
    chains = whole_step(tree_step(build(path, case, recompute=recompute), chains_mbs))
    with mock.patch("megatron_tree.mcore.schedule.tree_padding_mask", lambda mb, shard=None: None):
        unweighted = whole_step(tree_step(build(path, case, weighted=False, recompute=recompute), mbs))
    ref = chains
    if rows:
        ref = rows_step(build(path, case, tree=False), seqs, [[j] for j in range(len(seqs))] if bias else groups)
    errors = dict(tree=compare(tree, ref), unweighted=compare(unweighted, ref))
    if rows:
        errors["chains"] = compare(chains, ref)
    shared = sum(mb.num_original_tokens for mb in mbs) / sum(mb.num_tokens for mb in mbs)
    return dict(mbs=len(mbs), shared=shared, steps=dict(tree=tree, unweighted=unweighted), **errors)


def whole_step(step: dict) -> dict:
    """``step`` under context parallel: combined with the other CP ranks' (:func:`combine_ranks`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return step
    steps = [None] * cp
    dist.all_gather_object(steps, step, group=ps.get_context_parallel_group())
    return combine_ranks(steps)


def combine_ranks(steps: list[dict]) -> dict:
    """One step from the steps of the context-parallel ranks of one data-parallel rank (rank order):
    its loss and gradients (the same on every CP rank), the per-expert counts (a rank's expert-bias
    counts are its slots' share: summed; the global aux loss's are all-reduced: rank 0's) and the
    logged values (each rank logs its share: summed)."""
    first = steps[0]
    counts = {k: sum(s["counts"][k] for s in steps) if k.endswith("local_tokens_per_expert") else v
              for k, v in first["counts"].items()}  # fmt: skip
    logged = {k: sum(s["logged"][k] for s in steps) for k in first["logged"]}
    return dict(loss=first["loss"], grads=first["grads"], counts=counts, logged=logged)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context parallel size (the chains are the reference)")
    ap.add_argument("--dump", help="directory: each case's tree and unweighted steps, per rank")
    ap.add_argument("--ckpt", required=True, help="directory for the tiny HF checkpoint (shared by ranks)")
    ap.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.runtime import cpu_mode, init_distributed, save_tiny_hf_checkpoint

    ok = True
    with apply_compat_patches(), cpu_mode():
        init_distributed(ep=args.ep, pp=args.pp, cp=args.cp, seed=7)
        path = save_tiny_hf_checkpoint("qwen3_moe", args.ckpt, num_hidden_layers=2)
        rank = dist.get_rank()
        # Same lengths on every data-parallel rank (so the row batches have one shape), different tokens.
        seqs = batch(np.random.default_rng(ps.get_data_parallel_rank()), 160)
        for case in args.cases:
            r = run_case(path, case, seqs, max_tokens=48, recompute=args.recompute, rows=args.pp == args.cp == 1)
            if args.dump and rank == 0:
                os.makedirs(args.dump, exist_ok=True)
                torch.save(r["steps"], os.path.join(args.dump, f"{case}.pt"))
            kinds = [k for k in ("tree", "chains", "unweighted") if k in r]
            fields = " ".join(f"{k}_{m}={v:.3e}" for k in kinds for m, v in r[k].items())
            print(f"ROUTERSTATS rank={rank} case={case} mbs={r['mbs']} shared={r['shared']:.2f} {fields}", flush=True)
            ok &= all(v < TOL for k in kinds[:-1] for v in r[k].values())
            ok &= max(r["unweighted"].values()) > 1e-2
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

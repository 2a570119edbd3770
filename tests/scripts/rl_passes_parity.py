"""Every model pass of an RL step on trees vs each sequence alone (CPU gloo or GPUs, fp32):

- forward-only log-probs and entropies (``tree_forward_only``) of a language model;
- a critic (mbridge ``make_value_model``, its value head saved with ``bridge.save_weights`` and
  loaded back): forward-only per-token values and per-sequence scores, and one training step
  of the clipped value loss through ``tree_forward_backward(head="values")`` (loss, gradients).

The reference is the same model on one sequence per micro-batch through the same schedule, and,
without pipeline or expert parallel, also the upstream (causal) model called on each sequence alone.

    torchrun --nproc-per-node 2 tests/scripts/rl_passes_parity.py --tp 2 --ckpt DIR
    torchrun --nproc-per-node 2 tests/scripts/rl_passes_parity.py --pp 2 --ckpt DIR
    torchrun --nproc-per-node 2 tests/scripts/rl_passes_parity.py --ckpt DIR      # DP 2, unequal trees
    torchrun --nproc-per-node 2 tests/scripts/rl_passes_parity.py --ep 2 --arch qwen3_moe --ckpt DIR
    torchrun --nproc-per-node 2 tests/scripts/rl_passes_parity.py --cp 2 --ckpt DIR

Prints ``RLPASSES rank=R logprobs=.. entropy=.. values=.. scores=.. critic_loss_rel=.. critic_grad_rel=..``
(max abs errors, relative for the critic) and exits non-zero above ``--tol``. With Transformer
Engine (GPUs) also the flat path Megatron users run (upstream models, THD-packed sequences:
``flat_forward_only`` / ``flat_forward_backward``) against the same reference, ``PATH rank=R
te_thd_flat_fp32 ...``. ``--bf16`` runs every path again in bf16 against the fp32 per-sequence
results (``PATH ... tree_bf16 / flat_bf16 / te_thd_flat_bf16``) and fails unless the tree's error
is at most 2x the worst flat path's, per quantity (on GPUs set ``NVIDIA_TF32_OVERRIDE=0`` for fp32).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.ops.losses import value_loss
from megatron_tree.core.packing import build_micro_batch
from megatron_tree.compat import apply_compat_patches
from megatron_tree.runtime import cpu_mode, init_distributed, save_hf_config, save_tiny_hf_checkpoint
from schedule_parity import branching_batch


def per_seq(seed: int, sid: int, n: int, scale: float = 1.0) -> torch.Tensor:
    """Fixed random ``[n]`` per (seed, sequence id): the same for a sequence however it is packed."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 100_003 + sid)) * scale


def max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.numel()) if a else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context parallel size")
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--ckpt", required=True, help="directory for the tiny HF checkpoints (shared by ranks)")
    ap.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--bf16", action="store_true", help="also run every pass in bf16; each path against the fp32 "
                    "per-sequence results, the tree's error at most 2x the flat paths' worst")
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config
    from megatron_tree.mcore.bridge import build_model
    from megatron_tree.core.platform import have_transformer_engine
    from megatron_tree.mcore.forward_only import flat_forward_only, tree_forward_only
    from megatron_tree.ops.logprobs import vocab_parallel_logprobs
    from megatron_tree.mcore.schedule import flat_forward_backward, tree_forward_backward

    cuda = torch.cuda.is_available()
    with apply_compat_patches(), cpu_mode():
        init_distributed(tp=args.tp, pp=args.pp, ep=args.ep, vpp=args.vpp, cp=args.cp, seed=7)
        rank, device = dist.get_rank(), torch.device("cuda" if cuda else "cpu")
        path = save_tiny_hf_checkpoint(args.arch, os.path.join(args.ckpt, "policy"), num_hidden_layers=4)

        def build(hf_path, *, tree=True, value=False, bf16=False):
            return build_model(
                hf_path, tree=tree, bf16=bf16, recompute=args.recompute, wrap_with_ddp=True,
                extra_args=dict(attention_dropout=0.0, hidden_dropout=0.0),
                ddp_config=dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
                value_head=value,
            )  # fmt: skip

        # A critic from the policy's weights, its value head drawn here, saved with the bridge and
        # loaded back: the models under test read the head from that checkpoint.
        bridge, critic = build(path, value=True)
        initial = torch.randn(1, bridge.hf_config.hidden_size, generator=torch.Generator().manual_seed(0))
        head = per_seq(3, 0, bridge.hf_config.hidden_size, 0.3)[None]
        for chunk in critic:
            for name, param in chunk.named_parameters():
                if name.endswith("output_layer.weight"):  # the same fixed-seed draw on every rank
                    torch.testing.assert_close(param.detach().cpu(), initial * bridge.config.init_method_std)
                    param.data.copy_(head.to(param))
        value_path = os.path.join(args.ckpt, "critic")
        bridge.save_weights(critic, value_path)
        dist.barrier()
        exported = {k: v for k, v in bridge.export_weights(critic) if k == "lm_head.weight"}
        assert torch.equal(exported["lm_head.weight"].cpu(), head), "value head not exported as lm_head.weight [1, H]"
        _, critic = build(value_path, value=True)
        for chunk in critic:
            for name, param in chunk.named_parameters():
                if name.endswith("output_layer.weight"):
                    assert torch.equal(param.detach().cpu(), head), "value head not loaded back by the bridge"
        _, policy = build(path)

        dp, dp_rank, dp_group = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group()
        seqs = branching_batch(bridge.hf_config.vocab_size, np.random.default_rng(0))
        shares = [[i for i in range(len(seqs)) if i % dp == r] for r in range(dp)]
        if dp > 1:  # unequal trees per rank: rank 0 also takes the whole multi-turn conversation
            conv = list(range(len(seqs) - 4, len(seqs)))
            shares = [[i for i in s if i not in conv] for s in shares]
            shares[0] += conv
        local = [seqs[i] for i in shares[dp_rank]]
        group = args.pp if args.vpp else 1  # interleaved PP: a multiple of PP micro-batches
        spec = MicroBatchSpec(max_tokens_per_mb=48, n_mbs=group, n_mbs_divisor=group)
        tree_mbs = pack_trees(local, spec, dp_group=dp_group if dp > 1 else None)
        seq_mbs = [build_micro_batch(local, [i]) for i in range(len(local))]
        count = torch.tensor([len(seq_mbs)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        seq_mbs += [build_micro_batch(local, []) for _ in range(-(-int(count) // group) * group - len(seq_mbs))]
        seq_mbs = seq_mbs[::-1]  # reversed: the results must come back in the caller's order anyway

        lp, ent = tree_forward_only(policy, tree_mbs, with_entropy=True)
        ref_lp, ref_ent = tree_forward_only(policy, seq_mbs, with_entropy=True)
        values = tree_forward_only(critic, tree_mbs, head="values")
        ref_values = tree_forward_only(critic, seq_mbs, head="values")
        scores = tree_forward_only(critic, tree_mbs, head="scores")
        ref_scores = tree_forward_only(critic, seq_mbs, head="scores")
        errors = {
            "logprobs": max_err(lp, ref_lp), "entropy": max_err(ent, ref_ent),
            "values": max_err(values, ref_values), "scores": max_err([scores], [ref_scores]),
        }  # fmt: skip
        # Also the upstream causal models, each sequence alone (not under EP: the ranks' sequences differ;
        # not under sequence parallel: a lone sequence's length need not split over TP; not under CP:
        # megatron-core's own attention has no context parallel).
        if args.pp == 1 and args.ep == 1 and args.cp == 1 and not get_model_config(policy[0]).sequence_parallel:
            tp_group = ps.get_tensor_model_parallel_group() if args.tp > 1 else None
            flat_policy, flat_critic = build(path, tree=False)[1][0], build(value_path, tree=False, value=True)[1][0]
            with torch.no_grad():
                for i, seq in enumerate(local):
                    ids = torch.as_tensor(seq, device=device)[None]
                    pos = torch.arange(ids.shape[1], device=device)[None]
                    want_lp, want_ent = vocab_parallel_logprobs(
                        flat_policy(ids, pos, None)[0], pos[0, :-1], ids[0, 1:], tp_group=tp_group, with_entropy=True
                    )
                    want_values = flat_critic(ids, pos, None)[0, :, 0]
                    for key, got, want in [("logprobs", lp[i], want_lp), ("entropy", ent[i], want_ent),
                                           ("values", values[i], want_values[:-1]),
                                           ("scores", scores[i : i + 1], want_values[-1:])]:  # fmt: skip
                        errors[key] = max(errors[key], (got - want).abs().max().item() if got.numel() else 0.0)

        refused = 0
        if args.pp == 1:  # refusals raise on every rank alike (before any collective, or on every last stage)
            for call, match in [
                (lambda: tree_forward_only(critic, tree_mbs + tree_mbs[:1], head="values"), "not each of"),
                (lambda: tree_forward_only(policy, tree_mbs, head="value"), "head must be one of"),
                (lambda: tree_forward_only(critic, tree_mbs, head="scores", with_entropy=True), "needs head='logprobs'"),
                (lambda: tree_forward_only(policy, tree_mbs, head="values"), "make_value_model"),
                (lambda: build(save_hf_config(args.arch, os.path.join(args.ckpt, "tied"), tie_word_embeddings=True),
                               value=True), "needs untied embeddings"),
            ]:  # fmt: skip
                try:
                    call()
                except ValueError as exc:
                    refused += match in str(exc)
            assert refused == 5, refused

        # One critic training step, tree vs one sequence per micro-batch: clipped value loss on
        # old values (the forward-only ones, moved per sequence) and random returns.
        old = [v + per_seq(5, shares[dp_rank][i], v.numel(), 0.3).to(v) for i, v in enumerate(values)]
        returns = [per_seq(6, shares[dp_rank][i], v.numel()).to(v) for i, v in enumerate(values)]

        def critic_loss(values, mb):
            if not mb.sequence_ids:
                return values.sum(), 0
            cat = lambda xs: torch.cat([xs[i] for i in mb.sequence_ids])  # noqa: E731
            loss, metrics = value_loss(values, cat(old), cat(returns), mb.cu_targets, clip_eps=0.2, reduction="sum")
            return loss, metrics["normalizer"]

        def step(mbs, critic=critic, run=tree_forward_backward, loss_fn=critic_loss, **head):
            for chunk in critic:
                chunk.zero_grad_buffer()
            losses = run(critic, mbs, loss_fn, **(head or {"head": "values"}))
            total = torch.zeros(2, dtype=torch.float64, device=device)
            for item in losses:
                total += item["loss"].to(total)
            dist.all_reduce(total)
            return float(total[0] / total[1]), torch.cat([p.main_grad.flatten().double() for c in critic for p in c.parameters()])

        tree_loss, tree_grad = step(tree_mbs)
        seq_loss, seq_grad = step(seq_mbs)
        errors["critic_loss_rel"] = abs(tree_loss - seq_loss) / abs(seq_loss)
        errors["critic_grad_rel"] = float((tree_grad - seq_grad).abs().max() / seq_grad.abs().max().clamp(min=1e-30))
        # An actor step with an entropy bonus (loss_fn gets (logprobs, entropy)): fixed random weights per token.
        weights = [per_seq(7, shares[dp_rank][i], x.numel()).to(x) for i, x in enumerate(lp)]

        def actor_loss(outputs, mb):
            logprobs, entropy = outputs
            if not mb.sequence_ids:
                return logprobs.sum() + entropy.sum(), 0
            return (torch.cat([weights[i] for i in mb.sequence_ids]) * logprobs).sum() - 0.1 * entropy.sum(), logprobs.numel()

        (_, tree_actor_grad), (_, seq_actor_grad) = (
            step(mbs, policy, loss_fn=actor_loss, with_entropy=True) for mbs in (tree_mbs, seq_mbs)
        )
        errors["actor_entropy_grad_rel"] = float((tree_actor_grad - seq_actor_grad).abs().max() / seq_actor_grad.abs().max())
        clipped = sum(int(((v - o).abs() > 0.2).sum()) for v, o in zip(values, old))
        print(f"RLPASSES rank={rank} " + " ".join(f"{k}={v:.3e}" for k, v in errors.items())
              + f" tree_tokens={sum(m.num_tokens for m in tree_mbs)} seqs={len(local)} clipped={clipped} refused={refused}"
              + f" max|logprob|={max_err(lp, [0 * x for x in lp]):.2f} max|value|={max_err(values, [0 * x for x in values]):.2f}",
              flush=True)
        ok = all(v <= args.tol for v in errors.values()) and float(seq_grad.abs().max()) > 0

        # With Transformer Engine (GPUs): the flat path Megatron users run, upstream models on THD-packed
        # sequences. With --bf16: every path in bf16 against the fp32 per-sequence results.
        want = dict(logprobs=ref_lp, entropy=ref_ent, values=ref_values, scores=[ref_scores])
        thd = cuda and have_transformer_engine() and args.cp == 1
        thd_mbs = pack_trees(local, spec, dp_group=dp_group if dp > 1 else None, share_prefixes=False)

        def all_passes(policy, critic, mbs, forward_only, run):
            got_lp, got_ent = forward_only(policy, mbs, with_entropy=True)
            got = dict(logprobs=got_lp, entropy=got_ent, values=forward_only(critic, mbs, head="values"),
                       scores=[forward_only(critic, mbs, head="scores")])
            errs = {key: max_err(got[key], want[key]) for key in want}
            loss, grad = step(mbs, critic, run)
            errs["critic_loss_rel"] = abs(loss - seq_loss) / abs(seq_loss)
            errs["critic_grad_rel"] = float((grad - seq_grad).abs().max() / seq_grad.abs().max())
            return errs

        paths = {}
        for bf16 in [False, True] if args.bf16 else [False]:
            kind = "bf16" if bf16 else "fp32"
            if bf16:
                policy, critic = build(path, bf16=True)[1], build(value_path, value=True, bf16=True)[1]
                paths["tree_bf16"] = all_passes(policy, critic, tree_mbs, tree_forward_only, tree_forward_backward)
                paths["flat_bf16"] = all_passes(policy, critic, seq_mbs, tree_forward_only, tree_forward_backward)
            if thd:
                policy, critic = build(path, tree=False, bf16=bf16)[1], build(value_path, tree=False, value=True, bf16=bf16)[1]
                paths[f"te_thd_flat_{kind}"] = all_passes(policy, critic, thd_mbs, flat_forward_only, flat_forward_backward)
        for name, errs in paths.items():
            print(f"PATH rank={rank} {name} " + " ".join(f"{k}={v:.3e}" for k, v in errs.items()), flush=True)
        if thd:
            ok = ok and all(v <= args.tol for v in paths["te_thd_flat_fp32"].values())
        if args.bf16:  # FlashAttention's rule: the tree within 2x the worst flat bf16 path, per quantity
            flats = [errs for name, errs in paths.items() if name.endswith("bf16") and name != "tree_bf16"]
            ok = ok and all(v <= 2 * max(f[k] for f in flats) for k, v in paths["tree_bf16"].items())
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

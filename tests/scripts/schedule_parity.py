"""One training step through megatron-core's schedule: tree micro-batches vs one sequence per
micro-batch, same model, same sequences; loss and gradients must agree (relative 1e-5).

    torchrun --nproc-per-node 2 tests/scripts/schedule_parity.py --tp 2 --ckpt DIR
    torchrun --nproc-per-node 2 tests/scripts/schedule_parity.py --pp 2 [--vpp 2] --ckpt DIR
    torchrun --nproc-per-node 2 tests/scripts/schedule_parity.py --ep 2 --arch qwen3_moe --ckpt DIR
    torchrun --nproc-per-node 2 tests/scripts/schedule_parity.py --cp 2 --ckpt DIR --dump grads_cp2.pt
    torchrun --nproc-per-node 2 tests/scripts/schedule_parity.py --chunk 8 --ckpt DIR   # trees in chunks of 8 slots

Runs on CPU (gloo, fp32) and on GPUs (NCCL). With Transformer Engine (GPUs) it also runs the flat
path Megatron users run (the upstream model, THD-packed micro-batches through cuDNN attention,
``flat_forward_backward``) and compares the tree step with it. ``--bf16`` reports each path's
loss, gradient and log-prob errors against the fp32 flat step and asserts the tree's are at most 2x the flat paths'
worst (``bf16_within_flat_error``).
``--cp 2`` runs both steps under context parallel (each micro-batch's slots split over 2 ranks);
``--dump FILE`` saves the tree step's loss and gradients (rank 0) so a test can compare runs of
different parallel layouts. ``--chunk N`` packs the tree step with ``chunk_trees=True`` and N slots per
micro-batch (less than every sequence: each runs in chunks that read their ancestors' keys and values). With DP > 1 the ranks get unequal numbers of trees; the model is wrapped in Megatron's DDP
and gradients go through ``finalize_model_grads`` (per-token normalisation over all ranks).
Prints ``PARITY rank=R loss_rel=... grad_rel=...`` and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.compat import apply_compat_patches
from megatron_tree.ops.losses import sft_loss
from megatron_tree.core.packing import build_micro_batch
from megatron_tree.runtime import cpu_mode, init_distributed, save_tiny_hf_checkpoint


def branching_batch(vocab: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Prompts with short first samples and a long last one (siblings before a long branch),
    a duplicate, a prefix of another sequence, and a multi-turn chain with a fork."""
    seqs = []
    for g in range(3):
        prompt = rng.integers(0, vocab, 10 + 3 * g)
        for n in (2, 3, 17 + 2 * g):
            seqs.append(np.concatenate([prompt, rng.integers(0, vocab, n)]))
    seqs.append(seqs[0].copy())
    seqs.append(seqs[4][:12].copy())
    turn = rng.integers(0, vocab, 8)
    for _ in range(3):
        turn = np.concatenate([turn, rng.integers(0, vocab, 5)])
        seqs.append(turn)
    seqs.append(np.concatenate([seqs[-2], rng.integers(0, vocab, 9)]))
    return seqs


def loss_fn(logprobs, mb):
    loss, metrics = sft_loss(logprobs, mb.cu_targets, reduction="sum")
    return loss, metrics["normalizer"]


def bf16_within_flat_error(rank, step, build, local, divisor, dp_group, runs) -> bool:
    """FlashAttention's rule for one bf16 step: each path's loss, gradients and log-probs against the fp32 reference
    (the flat step of an fp32 model, each sequence its own micro-batch); the tree's errors at most 2x the worst flat
    path's (flat chains, the same reordered, packed several to a micro-batch, TE THD where it runs). Prints
    ``BF16VSFP32 rank=R <metric> <path>=<error> ...`` per metric. ``runs``: name -> (model, micro-batches, loss,
    gradients) of the steps already taken."""
    from megatron_tree.mcore.forward_only import flat_forward_only, tree_forward_only

    model, flat_mbs = runs["flat"][:2]
    runs = dict(runs, flat_reordered=(model, flat_mbs[::-1], *step(flat_mbs[::-1])))
    packed = pack_trees(local, MicroBatchSpec(max_tokens_per_mb=48, n_mbs=divisor, n_mbs_divisor=divisor),
                        dp_group=dp_group, share_prefixes=False)
    runs["flat_packed"] = (model, packed, *step(packed))
    ref_model = build(False)[1]
    ref_loss, ref_grad = step(flat_mbs, model=ref_model)

    def logprobs(name, model, mbs):
        lps = (flat_forward_only if name == "te_thd_flat" else tree_forward_only)(model, mbs)
        return torch.cat([lp.double() for lp in lps])

    ref_lp = logprobs("flat", ref_model, flat_mbs)
    errors = {"loss": {}, "grad": {}, "logprob": {}}
    for name, (model, mbs, loss, grad) in runs.items():
        errors["loss"][name] = abs(loss - ref_loss) / abs(ref_loss)
        errors["grad"][name] = float((grad - ref_grad).abs().max() / ref_grad.abs().max())
        errors["logprob"][name] = float((logprobs(name, model, mbs) - ref_lp).abs().max())
    ok = True
    for metric, by_path in errors.items():
        worst_flat = max(v for k, v in by_path.items() if k != "tree")
        ok = ok and by_path["tree"] <= 2 * worst_flat
        print(f"BF16VSFP32 rank={rank} {metric} " + " ".join(f"{k}={v:.3e}" for k, v in by_path.items())
              + f" tree/worst_flat={by_path['tree'] / max(worst_flat, 1e-30):.2f}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context parallel size")
    ap.add_argument("--dump", help="save the tree step's loss and gradients here (rank 0)")
    ap.add_argument("--etp", type=int, help="expert tensor parallel size (default: TP), GPUs only")
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--ckpt", required=True, help="directory for the tiny HF checkpoint (shared by ranks)")
    ap.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--chunk", type=int, help="pack with MicroBatchSpec(chunk_trees=True) and this max_tokens_per_mb")
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    from megatron_tree.mcore.bridge import build_model
    from megatron_tree.core.platform import have_transformer_engine
    from megatron_tree.mcore.schedule import flat_forward_backward, tree_forward_backward

    cuda = torch.cuda.is_available()
    # Runtime needs the compat patches too (MoE on megatron-core 0.16.1 without TE), so they
    # stay open for the whole run, not only while the model is built.
    with apply_compat_patches(), cpu_mode():
        init_distributed(tp=args.tp, pp=args.pp, ep=args.ep, vpp=args.vpp, cp=args.cp, etp=args.etp, seed=7)
        path = save_tiny_hf_checkpoint(args.arch, args.ckpt, num_hidden_layers=args.layers)
        def build(bf16: bool, tree: bool = True):
            return build_model(
                path, tree=tree, bf16=bf16, recompute=args.recompute, extra_args=dict(attention_dropout=0.0, hidden_dropout=0.0),
                wrap_with_ddp=True,
                ddp_config=dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
            )

        bridge, model = build(args.bf16)
        config = get_model_config(model[0])

        dp, dp_rank, dp_group = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group()
        seqs = branching_batch(bridge.hf_config.vocab_size, np.random.default_rng(0))
        # Unequal work per DP rank: rank r gets every sequence i with i % dp == r, except that
        # rank 0 also takes the whole multi-turn conversation (more trees there).
        shares = [[i for i in range(len(seqs)) if i % dp == r] for r in range(dp)]
        if dp > 1:
            conv = list(range(len(seqs) - 4, len(seqs)))
            shares = [[i for i in s if i not in conv] for s in shares]
            shares[0] += conv
        local = [seqs[i] for i in shares[dp_rank]]
        divisor = (config.microbatch_group_size_per_vp_stage or args.pp) if args.vpp else 1

        spec = MicroBatchSpec(max_tokens_per_mb=args.chunk or 48, n_mbs=divisor, n_mbs_divisor=divisor,
                              chunk_trees=args.chunk is not None)
        tree_mbs = pack_trees(local, spec, dp_group=dp_group if dp > 1 else None)
        flat_mbs = [build_micro_batch(local, [i]) for i in range(len(local))]
        count = torch.tensor([len(flat_mbs)], device="cuda" if cuda else "cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        k = -(-int(count) // divisor) * divisor
        flat_mbs += [build_micro_batch(local, []) for _ in range(k - len(flat_mbs))]

        def step(mbs, model=model, run=tree_forward_backward):
            for chunk in model:
                chunk.zero_grad_buffer()
            losses = run(model, mbs, loss_fn)
            num = torch.zeros(2, dtype=torch.float64, device="cuda" if cuda else "cpu")
            for item in losses:
                num += item["loss"].to(num)
            dist.all_reduce(num)
            grads = torch.cat([p.main_grad.flatten().double() for c in model for p in c.parameters()])
            return float(num[0] / num[1]), grads.clone()

        rank = dist.get_rank()
        tree_loss, tree_grad = step(tree_mbs)
        if args.dump and rank == 0 and args.pp == 1:
            torch.save({"loss": tree_loss, "grads": tree_grad}, args.dump)
        if args.cp > 1 and args.ep == 1:  # every CP rank ends the step with the same full gradients (EP shards experts)
            spread = tree_grad.clone()
            dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=ps.get_context_parallel_group())
            cp_same = bool(torch.equal(spread, tree_grad))
            print(f"CP rank={rank} cp_ranks_equal_grads={cp_same}", flush=True)
        flat_loss, flat_grad = step(flat_mbs)
        loss_rel = abs(tree_loss - flat_loss) / abs(flat_loss)
        grad_rel = float((tree_grad - flat_grad).abs().max() / flat_grad.abs().max().clamp(min=1e-30))
        def again(chunk):  # the chunk runs its forward twice (in expert parallel's order under EP)
            return chunk.recompute_uniform if args.ep > 1 else chunk.recompute

        print(
            f"PARITY rank={rank} tree_mbs={len(tree_mbs)} flat_mbs={len(flat_mbs)} loss={tree_loss:.7f} "
            f"flat_loss={flat_loss:.7f} loss_rel={loss_rel:.3e} grad_rel={grad_rel:.3e} "
            f"tree_tokens={sum(m.num_tokens for m in tree_mbs)} flat_tokens={sum(m.num_tokens for m in flat_mbs)} "
            f"run_again={[(m.chunk.group, m.chunk.index) for m in tree_mbs if m.chunk and again(m.chunk)]}",
            flush=True,
        )
        # With Transformer Engine, also the flat path Megatron users run: the upstream model, each
        # sequence a THD segment of packed micro-batches through cuDNN fused attention.
        thd = cuda and have_transformer_engine() and args.cp == 1  # the THD flat path has no CP
        if thd:
            thd_model = build(args.bf16, tree=False)[1]
            thd_mbs = pack_trees(local, MicroBatchSpec(max_tokens_per_mb=48, n_mbs=divisor, n_mbs_divisor=divisor),
                                 dp_group=dp_group if dp > 1 else None, share_prefixes=False)
            thd_loss, thd_grad = step(thd_mbs, model=thd_model, run=flat_forward_backward)
            thd_loss_rel = abs(tree_loss - thd_loss) / abs(thd_loss)
            thd_grad_rel = float((tree_grad - thd_grad).abs().max() / thd_grad.abs().max().clamp(min=1e-30))
            print(f"THD rank={rank} tree_vs_te_thd_flat loss_rel={thd_loss_rel:.3e} grad_rel={thd_grad_rel:.3e} "
                  f"thd_mbs={len(thd_mbs)}", flush=True)
        if args.bf16:
            bf16_ok = bf16_within_flat_error(rank, step, build, local, divisor, dp_group if dp > 1 else None, {
                "tree": (model, tree_mbs, tree_loss, tree_grad),
                "flat": (model, flat_mbs, flat_loss, flat_grad),
                **({"te_thd_flat": (thd_model, thd_mbs, thd_loss, thd_grad)} if thd else {}),
            })
        ok = bf16_ok if args.bf16 else (loss_rel < args.tol and grad_rel < args.tol and float(flat_grad.abs().max()) > 0)
        ok = ok and (args.cp == 1 or args.ep > 1 or cp_same)
        if thd and not args.bf16:
            ok = ok and thd_loss_rel < args.tol and thd_grad_rel < args.tol
        if dp > 1:
            from megatron_tree.mcore.chunk_schedule import schedule_steps

            steps = len(schedule_steps(tree_mbs))  # the chunks of a tree are one step
            n = torch.tensor([steps], device="cuda" if cuda else "cpu")
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=dp_group)
            ok = ok and int(n) == steps
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

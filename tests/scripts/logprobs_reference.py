"""Plain-PyTorch per-sequence reference for ``gather_tree_logprobs``, shared by the TP=1
pytest and the TP=2 torchrun script.

The reference never reads ``mb.logprob_slots`` / ``mb.logprob_labels``: it finds the slot
of every prefix from the layout itself (``input_ids`` and the interval ``attention_mask``),
then takes ``torch.log_softmax`` of each original sequence's rows over the full vocab.
"""

from __future__ import annotations

import torch

from megatron_tree import MicroBatchSpec, TreeMicroBatch, pack_trees
from megatron_tree.ops.logprobs import gather_tree_logprobs

# Branching trees whose later branches are long, chains, stars, duplicates, 1-token sequences.
BATCHES = {
    "grpo": [[5, 1, 2] + [3] * 9, [5, 1, 2, 4], [5, 1, 2, 4, 7, 7, 1, 0, 2, 6, 6], [5, 1, 0, 1, 2, 3, 4, 5, 6]],
    "multi_turn": [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 0, 1, 2], [1, 2, 3, 8, 8, 8, 8, 8, 8]],
    "duplicates_and_singletons": [[3, 3, 3], [3, 3, 3], [9], [9], [2, 9, 1], [2, 9, 1, 1, 1, 1]],
    "star_and_chain": [[0, k, k + 1] for k in range(1, 9)] + [list(range(10, 0, -1)) * 2],
}


def micro_batches(seqs: list[list[int]], max_tokens: int) -> list[TreeMicroBatch]:
    """pack_trees with padding, so padding rows are exercised too."""
    return pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=max_tokens), pad_to_multiple_of=8)


def prefix_slots(mb: TreeMicroBatch) -> dict[tuple[int, ...], int]:
    """Slot of each prefix (tuple of tokens) laid out in ``mb``, from the interval encoding."""
    ids, end = mb.input_ids[0].tolist(), mb.attention_mask[0].tolist()
    ancestors: list[int] = []
    slots = {}
    for j in range(mb.num_tokens):
        while ancestors and end[ancestors[-1]] <= j:
            ancestors.pop()
        ancestors.append(j)
        slots[tuple(ids[i] for i in ancestors)] = j
    return slots


def reference(
    logits: torch.Tensor, mb: TreeMicroBatch, seqs: list[list[int]], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence ``(logprobs [N], entropy [N])`` from full-vocab ``logits [1, T, V]``."""
    slot_of = prefix_slots(mb)
    lps, ents = [], []
    for sid in mb.sequence_ids:
        s = seqs[sid]
        rows = [slot_of[tuple(s[: t + 1])] for t in range(len(s) - 1)]
        logp = torch.log_softmax(logits[0, rows] / temperature, dim=-1)
        lps.append(logp[torch.arange(len(rows)), torch.tensor(s[1:], dtype=torch.long)])
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps), torch.cat(ents)


def compare(
    seqs: list[list[int]],
    *,
    max_tokens: int,
    vocab: int,
    temperature: float,
    dtype: torch.dtype,
    seed: int,
    tp_group=None,
    chunk_rows: int | None = None,
) -> dict[str, float]:
    """Max abs errors of values, entropy and logits grads vs the reference, over all micro-batches.

    Logits are drawn from ``seed`` on every rank alike; this rank keeps its vocab shard.
    Grads: fp32 logits give the absolute error (``grad``); bf16 logits give the error wrt the
    fp32 reference divided by that of plain ``torch.log_softmax`` run in bf16
    (``grad_vs_plain``, FlashAttention's rule). The loss mixes logprobs and entropy with
    random weights; ``grad_lp_only`` / ``grad_ent_only`` use one output alone.
    """
    tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    rank = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
    gen = torch.Generator().manual_seed(seed)
    errors = dict.fromkeys(["logprobs", "entropy", "grad", "grad_vs_plain", "grad_lp_only", "grad_ent_only"], 0.0)
    for mb in micro_batches(seqs, max_tokens):
        full = (3 * torch.randn(1, mb.num_slots, vocab, generator=gen)).to(dtype)
        shard = vocab // tp
        local = full[..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
        before = local.detach().clone()
        n = mb.logprob_slots.numel()
        w, u = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

        ref_in = full.float().requires_grad_()
        ref_lp, ref_ent = reference(ref_in, mb, seqs, temperature)
        for key, (a, b) in {"grad": (w, u), "grad_lp_only": (w, 0 * u), "grad_ent_only": (0 * w, u)}.items():
            ref_in.grad = None
            (ref_lp * a + ref_ent * b).sum().backward(retain_graph=True)
            ref_grad = ref_in.grad[..., rank * shard : (rank + 1) * shard]

            local.grad = None
            if key == "grad_lp_only":
                lp = gather_tree_logprobs(local, mb, tp_group=tp_group, temperature=temperature, chunk_rows=chunk_rows)
                (lp * a).sum().backward()
            else:
                lp, ent = gather_tree_logprobs(
                    local, mb, tp_group=tp_group, temperature=temperature, with_entropy=True, chunk_rows=chunk_rows
                )
                loss = (ent * b).sum() if key == "grad_ent_only" else (lp * a + ent * b).sum()
                loss.backward()
                errors["entropy"] = max(errors["entropy"], (ent.detach() - ref_ent.detach()).abs().max().item())
            errors["logprobs"] = max(errors["logprobs"], (lp.detach() - ref_lp.detach()).abs().max().item())
            assert local.grad.dtype == dtype and local.grad.shape == local.shape
            err = (local.grad.float() - ref_grad).abs().max().item()
            if dtype == torch.float32:
                errors[key] = max(errors[key], err)
            elif key == "grad":
                plain_in = full.clone().requires_grad_()
                plain_lp, plain_ent = reference(plain_in, mb, seqs, temperature)
                (plain_lp * a + plain_ent * b).sum().backward()
                plain_grad = plain_in.grad[..., rank * shard : (rank + 1) * shard].float()
                plain_err = (plain_grad - ref_grad).abs().max().item()
                errors["grad_vs_plain"] = max(errors["grad_vs_plain"], err / plain_err)
        if not torch.equal(local.detach(), before):
            raise AssertionError("gather_tree_logprobs modified the caller's logits")
    return errors

"""Tree attention vs dense-mask, causal and flat attention, forward + backward, on one CUDA GPU.

    PYTHONUNBUFFERED=1 python benchmarks/attention_bench.py --out benchmarks/results

Workloads (built with the real packer, ``pack_trees``, the fullest micro-batch): GRPO-like
(prompts 1-4k, 8-16 samples, responses 0.2-2k), multi-turn agent trajectories and a no-sharing
batch at T = 32768 slots; long agentic trajectories (``long_multi_turn``: 4k system prompt,
24-32 turns of 1-3k tokens, trajectories of 30k-100k tokens) at T = 131072 slots, where the flat
and dense-mask methods are skipped (millions of flat tokens; a [T, T] mask). bf16, 16 query heads, 8 KV heads,
head dim 128, batch 1. Methods, each timed forward and forward + backward with CUDA events
(median of ``--iters`` calls queued back to back, as a training step issues them, after ``--warmup``):

  flex_tree     ``flex_tree_attention`` over the T slots (block mask built once; its build
                time is reported apart, with ``create_block_mask`` over the mask_mod for scale)
  fa4_tree      ``fa4_tree_attention``: FlashAttention-4's block-sparse CuTe kernels over the same
                tiles (needs flash-attn-4 and a Hopper/Blackwell GPU; its block tables' build time
                is reported apart, ``fa4_mask_build_ms``, once per micro-batch for all layers)
  cudnn_flex_tree  cuDNN frontend's interval-mask flex attention (``megatron_tree.attention.cudnn_flex``, raw:
                no PROVEN table): its varlen call, each tree of the micro-batch one THD sequence (tiled from its own
                first slot), each query's root path as intervals local to its tree, timed on Megatron's token-major
                q / k / v (needs nvidia-cudnn-frontend and a Hopper/Blackwell GPU; the segments, intervals and mask
                plan build time is reported apart, ``cudnn_flex_mask_build_ms``, once per micro-batch for all layers,
                next to the tile ceiling of the per-tree tiling, ``cudnn_flex_tile_ceiling``, and at the kernels' own
                64-slot x 128-key tiles, ``cudnn_flex_tile_ceiling_64x128``)
  dense_sdpa    SDPA (memory-efficient backend) with the dense [T, T] bool tree mask
  causal_flash  SDPA flash backend, causal over all T slots (the per-pair reference)
  causal_cudnn  SDPA cuDNN backend, causal over all T slots
  causal_fa4    FlashAttention-4 (``flash_attn.cute.flash_attn_func``), causal over all T slots
  flat_varlen   every original sequence causal on its own, packed varlen
                (``torch.nn.attention.varlen``); flex with a document mask if that fails
  flat_te_thd   the same flat sequences through Transformer Engine's cuDNN fused attention in THD
                (what Megatron's sequence packing runs; needs TE)

Per-pair efficiency of a method = (its useful (query, key) pairs / its time) over the same
ratio for causal flash on T slots (``per_pair_efficiency_vs_causal_flash``), and over the best
ratio of the dense kernels (causal flash / cuDNN, flat varlen / TE THD) on the workload
(``per_pair_efficiency_vs_fastest``, ``fastest_dense``). Useful pairs: visible pairs of the tree mask for
flex_tree and dense_sdpa, sum of L(L+1)/2 over sequences for flat, T(T+1)/2 for causal.
Also: relative errors (vs float64) of flex_tree in fp32 and bf16 next to dense SDPA in
bf16, cudnn_flex with the forward's GQA heads in tiles of their own (``cudnn_flex_tree_unpacked``: the
frontend's ``pack_gqa=False``) beside the backend's call, and flex variants (block sizes, kernel options) on the GRPO
workload; a variant the kernel refuses (e.g. block sizes below 128 on sm90, torch 2.11) is recorded with its error.
Writes ``attention_<tag>.json`` and ``attention_<tag>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask

from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.attention import cudnn_flex
from megatron_tree.attention.conformance import forward_backward, relative_errors
from megatron_tree.attention.cudnn_flex import cudnn_flex_available, cudnn_flex_tree_mask
from megatron_tree.attention.fa4 import fa4_available, fa4_tree_attention, fa4_tree_mask
from megatron_tree.attention.flex import (_block_sizes, classify_blocks, flex_tree_attention, flex_tree_mask,
                                          padded_length, tree_block_mask)
from megatron_tree.core.flops import micro_batch_work
from megatron_tree.core.masks import dense_tree_mask
from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch, no_sharing_batch

HEADS, KV_HEADS, HEAD_DIM, SLOTS = 16, 8, 128, 32768

VARIANTS = {
    "bs128": dict(block_size=128),
    "bs128_tma": dict(block_size=128, kernel_options={"USE_TMA": True}),
    "bs128_fwd128x128": dict(
        block_size=128, kernel_options={"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2}
    ),
    "bs128_fwd_tma": dict(block_size=128, kernel_options={"fwd_USE_TMA": True}),
    "bs128_fwd_tma_128x128": dict(
        block_size=128,
        kernel_options={
            "fwd_USE_TMA": True, "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2,
        },
    ),
    "bs128_bwd_stages2": dict(block_size=128, kernel_options={"bwd_num_stages": 2}),
    "bs128_bwd_stages4": dict(block_size=128, kernel_options={"bwd_num_stages": 4}),
    "bs128_bwd_warps4": dict(block_size=128, kernel_options={"bwd_num_warps": 4}),
    "bs128_bwd64": dict(
        block_size=128,
        kernel_options={"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64},
    ),
    "bs128x64": dict(block_size=(128, 64), kernel_options={"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64}),
    "bs64": dict(
        block_size=64,
        kernel_options={
            "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4,
            "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4,
        },
    ),
}


def workloads(seed: int) -> dict[str, list[np.ndarray]]:
    """Name -> rollout batch (list of 1-D token arrays)."""
    rng = np.random.default_rng(seed)
    return {
        "grpo": grpo_batch(
            rng, n_prompts=8, samples=(8, 16), prompt_len=(1024, 4096), response_len=(200, 2000), vocab=150000
        ),
        "multi_turn": multi_turn_batch(
            rng, n_conversations=8, turns=(8, 24), turn_len=(50, 400), fork_prob=0.2, system_len=1500, vocab=150000
        ),
        "no_sharing": no_sharing_batch(rng, n=64, length=(200, 2000), vocab=150000),
        "long_multi_turn": multi_turn_batch(
            rng, n_conversations=2, turns=(24, 32), turn_len=(1000, 3000), fork_prob=0.2, system_len=4000, vocab=150000
        ),
    }


LONG_WORKLOADS = {"long_multi_turn": 131072}
"""Workloads run at more slots than ``SLOTS``, without the flat and dense-mask methods."""


def fullest_micro_batch(seqs: list[np.ndarray], slots: int):
    """The micro-batch with the most unique tokens when ``seqs`` are packed into ``slots``-slot micro-batches, its
    slots padded to a whole 128-slot tile (padding it to ``slots`` would time masked tiles that hold
    no useful pair: 10k of the 32k slots on multi-turn)."""
    mbs = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=slots), pad_to_multiple_of=128)
    return max(mbs, key=lambda mb: mb.num_tokens)


def doc_subtree_end(seq_lens: list[int], device) -> torch.Tensor:
    """Interval encoding of disjoint causal sequences (document mask): int32 [sum(seq_lens)]."""
    ends = np.repeat(np.cumsum(seq_lens), seq_lens)
    return torch.as_tensor(ends, dtype=torch.int32, device=device)


def cuda_time(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` between CUDA events, the ``iters`` calls queued back to back.

    No host sync between calls (as in a training step, where the host launches ahead of the GPU):
    a kernel's launch cost hides behind the previous call's GPU work unless the host is the slower
    side, in which case the gaps count.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def wall_time(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` on the host clock, synchronising after each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_fwd_bwd(attn, inputs: list[torch.Tensor], grad_out: torch.Tensor, args) -> dict[str, float]:
    """{'fwd_ms', 'fwd_bwd_ms'} of ``attn(*inputs)`` with gradients w.r.t. every input."""

    def fwd():
        return attn(*inputs)

    def fwd_bwd():
        for x in inputs:
            x.grad = None
        attn(*inputs).backward(grad_out)

    return {
        "fwd_ms": cuda_time(fwd, args.warmup, args.iters),
        "fwd_bwd_ms": cuda_time(fwd_bwd, args.warmup, args.iters),
    }


def token_major(x: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``x`` [b, h, s, d] laid out as Megatron's [s, b, h, d] tensors are (what ``tree_attention``
    passes its backend: those permuted to [b, h, s, d]), same values and shape."""
    return x.detach().permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def leaf(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=torch.float32, generator=gen).to(dtype).requires_grad_()


def bf16_inputs(t: int, dev, gen) -> tuple[torch.Tensor, ...]:
    """bf16 leaves q [1, HEADS, t, HEAD_DIM], k / v [1, KV_HEADS, t, HEAD_DIM] and an output gradient like q."""
    q = leaf((1, HEADS, t, HEAD_DIM), torch.bfloat16, dev, gen)
    k, v = (leaf((1, KV_HEADS, t, HEAD_DIM), torch.bfloat16, dev, gen) for _ in range(2))
    return q, k, v, torch.randn(q.shape, device=dev, generator=gen).to(torch.bfloat16)


def fa4_harness_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The FA4 harnesses' start: add ``--out``, parse, exit with the reason where FA4 cannot run, and import
    Transformer Engine first where it is installed (its cuDNN symbols), as :func:`main` does."""
    from megatron_tree.core.platform import have_transformer_engine
    from megatron_tree.attention.fa4 import fa4_unavailable_reason

    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    reason = fa4_unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    have_transformer_engine()
    return args


def fa4_tree_step(seqs: list[np.ndarray], slots: int, dev, token_major: bool = False):
    """``step()``: one ``fa4_tree_attention`` forward + backward (q / k / v gradients cleared first) on the fullest
    micro-batch of ``seqs`` at ``slots``, bf16 inputs seeded 0 (head-major, or token-major as Megatron's
    [T, b, h, d] permuted), warmed up three times."""
    gen = torch.Generator(device=dev).manual_seed(0)
    end = fullest_micro_batch(seqs, slots).attention_mask[0].to(device=dev, dtype=torch.int32)
    q, k, v, g = bf16_inputs(end.shape[0], dev, gen)
    if token_major:
        q, k, v = (token_major(x).requires_grad_() for x in (q, k, v))
    mask = fa4_tree_mask(end)

    def step():
        for x in (q, k, v):
            x.grad = None
        fa4_tree_attention(q, k, v, mask).backward(g)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return step


def sdpa_gqa(backend, **kw):
    """SDPA on [b, h, T, d] with ``backend``; expands K/V heads when the backend refuses ``enable_gqa``."""

    def attn(q, k, v):
        with sdpa_kernel(backend):
            try:
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            except RuntimeError:
                rep = q.shape[1] // k.shape[1]
                return F.scaled_dot_product_attention(
                    q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), **kw
                )

    return attn


def varlen_attention(cu_seqlens: torch.Tensor, max_len: int):
    """Causal varlen attention over packed q [N, h, d], k/v [N, hkv, d], or None if unavailable."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = "enable_gqa" in params

    def attn(q, k, v):
        if gqa:
            return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, enable_gqa=True, **kw)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kw)

    return attn


def error_line(exc: Exception) -> str:
    """``"<type>: <first line of its message>"``: what a row records of a call the kernels refused."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


CUDNN_FLEX_TILE = (64, 128)
"""The (query slots, keys) tile cuDNN frontend 1.32.0's SM90 kernels run at this bench's shape (d = 128, GQA 2:1): the
backward's ``m_block_size`` 64 by ``n_block_size`` 128, and the forward's 128-row tile packing the two query heads of a
K/V head (``pack_gqa``), 64 slots each."""


def segment_tile_ceiling(end: torch.Tensor, cu_seqlens: torch.Tensor, tree_pairs: int,
                         block_size: int | tuple[int, int] = 128) -> float:
    """:func:`tile_ceiling` of a varlen call over the segments ``cu_seqlens`` of ``end`` (``subtree_end`` int [T]):
    each segment tiled from its own first slot (its last tile ragged), against causal attention on the T slots."""
    bounds = zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
    visited = sum(visited_tiles(end[a:b] - a, block_size)[1] for a, b in bounds)
    return tile_ceiling(tree_pairs, visited, end.shape[0], block_size)


def visited_tiles(end: torch.Tensor, block_size: int | tuple[int, int] = 128) -> tuple[int, int]:
    """``(partial, visited)`` tiles of ``subtree_end`` int [T] tiled from its slot 0 by ``block_size`` (``b`` for b x b,
    or (query slots, keys)): the tiles holding a query slot and a key slot, the last ones filled with self-attending
    slots (as padding is)."""
    t, (bq, bk) = end.shape[0], _block_sizes(block_size)
    lcm = math.lcm(bq, bk)
    n = -(-t // lcm) * lcm
    partial, full = classify_blocks(torch.cat([end, torch.arange(t + 1, n + 1, device=end.device, dtype=end.dtype)]),
                                    (bq, bk))
    partial, full = (int(x[: -(-t // bq), : -(-t // bk)].sum()) for x in (partial, full))
    return partial, partial + full


def block_stats(end: torch.Tensor, block_size) -> dict[str, int]:
    partial, full = classify_blocks(end, block_size)
    nq, nk = partial.shape
    return {"partial_blocks": int(partial.sum()), "full_blocks": int(full.sum()), "all_blocks": nq * nk}


def tile_ceiling(tree_pairs: int, visited_blocks: int, slots: int, block_size: int | tuple[int, int] = 128) -> float:
    """The per-useful-pair efficiency against causal attention on the same ``slots`` that a tree kernel reaches if it
    runs every tile it visits as fast as the causal kernel runs its tiles of the same shape (``block_size``: b for
    b x b, or (query slots, keys)): the tree's useful pairs per visited tile pair over the causal mask's (query tile r
    of ``slots (slots + 1) / 2`` pairs visits the key tiles up to its last row's). Tiles cut by a node's boundary hold
    masked pairs, so a tree kernel's ``per_pair_efficiency_vs_*`` over this is its speed per computed tile against the
    dense kernel's."""
    bq, bk = _block_sizes(block_size)
    last_rows = torch.arange(bq, -(-slots // bq) * bq + 1, bq).clamp(max=slots) - 1
    causal = slots * (slots + 1) / 2 / (int((last_rows // bk + 1).sum()) * bq * bk)
    return tree_pairs / (visited_blocks * bq * bk) / causal


def bench_workload(name, seqs, args, dev, gen) -> dict:
    long = name in LONG_WORKLOADS
    mb = fullest_micro_batch(seqs, LONG_WORKLOADS.get(name, SLOTS))
    end = mb.attention_mask[0].to(device=dev, dtype=torch.int32)
    t = end.shape[0]
    row = {
        "workload": name,
        "slots": t,
        "unique_tokens": mb.num_tokens,
        "original_tokens": mb.num_original_tokens,
        "sequences": len(mb.seq_lens),
        "tree_pairs": micro_batch_work(mb)[1],
        "flat_pairs": sum(n * (n + 1) // 2 for n in mb.seq_lens),
        "causal_pairs": t * (t + 1) // 2,
        **block_stats(end, 128),
    }
    row["tile_ceiling"] = tile_ceiling(row["tree_pairs"], row["partial_blocks"] + row["full_blocks"], t)
    q, k, v, g = bf16_inputs(t, dev, gen)

    row["block_mask_build_ms"] = wall_time(lambda: tree_block_mask(end.clone()), 3, args.iters)
    end_long = end.long()
    row["create_block_mask_ms"] = None if long else wall_time(
        lambda: create_block_mask(
            lambda b, h, qi, ki: (ki <= qi) & (qi < end_long[ki]), None, None, t, t, device=dev, BLOCK_SIZE=128
        ),
        1,
        3,
    )
    times = {}
    print(f"[{name}] T={t} unique={mb.num_tokens} original={mb.num_original_tokens}", flush=True)
    flex_mask = flex_tree_mask(end)  # once per micro-batch, as the backend's prepare
    times["flex_tree"] = time_fwd_bwd(lambda q, k, v: flex_tree_attention(q, k, v, flex_mask), [q, k, v], g, args)
    print(f"  flex_tree {times['flex_tree']}", flush=True)
    if fa4_available():
        from flash_attn.cute.interface import flash_attn_func

        row["fa4_mask_build_ms"] = wall_time(lambda: fa4_tree_mask(end.clone()), 3, args.iters)
        prepared = fa4_tree_mask(end)
        times["fa4_tree"] = time_fwd_bwd(lambda q, k, v: fa4_tree_attention(q, k, v, prepared), [q, k, v], g, args)
        print(f"  fa4_tree {times['fa4_tree']} (mask build {row['fa4_mask_build_ms']:.2f} ms)", flush=True)

        def causal_fa4(q, k, v):
            return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)[0].transpose(1, 2)

        times["causal_fa4"] = time_fwd_bwd(causal_fa4, [q, k, v], g, args)
        print(f"  causal_fa4 {times['causal_fa4']}", flush=True)
    if cudnn_flex_available():
        cudnn_mask = cudnn_flex_tree_mask(end)
        row["cudnn_flex_intervals"] = cudnn_mask.intervals.shape[1] // 2 + 1
        row["cudnn_flex_segments"] = len(cudnn_mask.cu_seqlens) - 1
        row["cudnn_flex_tile_ceiling"] = segment_tile_ceiling(end, cudnn_mask.cu_seqlens, row["tree_pairs"])
        row["cudnn_flex_tile_ceiling_64x128"] = segment_tile_ceiling(end, cudnn_mask.cu_seqlens, row["tree_pairs"],
                                                                     CUDNN_FLEX_TILE)

        def cudnn_prepare():  # segments, intervals and the mask plan with backward: once per micro-batch for all layers
            mask = cudnn_flex_tree_mask(end.clone())
            mask.plan(*(x.transpose(1, 2) for x in (q, k, v)), True)

        cudnn_prepare()  # compiles the plan kernels
        row["cudnn_flex_mask_build_ms"] = wall_time(cudnn_prepare, 1, args.iters)
        # On Megatron's token-major q / k / v and output gradient (the kernels' THD views contiguous, as in training)
        times["cudnn_flex_tree"] = time_fwd_bwd(
            lambda q, k, v: cudnn_flex._flex(q, k, v, cudnn_mask, HEAD_DIM ** -0.5),
            [token_major(x).requires_grad_() for x in (q, k, v)], token_major(g), args)
        print(f"  cudnn_flex_tree {times['cudnn_flex_tree']} ({row['cudnn_flex_segments']} sequences, "
              f"{row['cudnn_flex_intervals']} intervals, mask build {row['cudnn_flex_mask_build_ms']:.2f} ms, tile "
              f"ceiling {row['cudnn_flex_tile_ceiling']:.3f}, at its 64 x 128 tiles "
              f"{row['cudnn_flex_tile_ceiling_64x128']:.3f})", flush=True)
        # The same call with the forward's query heads in tiles of their own (pack_gqa=False): by default the frontend
        # packs the query heads of a K/V head into one 128-row forward tile (GQA 2:1: 64 slots x 2 heads)
        from cudnn.flex_attention import create_mask_plan

        unpacked = cudnn_flex_tree_mask(end)
        tm = [token_major(x).requires_grad_() for x in (q, k, v)]
        segments = dict(cu_seqlens_q=unpacked.cu_seqlens, cu_seqlens_k=unpacked.cu_seqlens,
                        max_seqlen_q=unpacked.max_seqlen, max_seqlen_k=unpacked.max_seqlen)
        unpacked.plans[(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM, torch.bfloat16, True)] = create_mask_plan(
            unpacked.intervals, *(x.transpose(1, 2).squeeze(0) for x in tm), **segments, pack_gqa=False,
            build_backward=True)
        times["cudnn_flex_tree_unpacked"] = time_fwd_bwd(
            lambda q, k, v: cudnn_flex._flex(q, k, v, unpacked, HEAD_DIM ** -0.5), tm, token_major(g), args)
        with torch.no_grad():
            out_packed, out_unpacked = (cudnn_flex._flex(*tm, m, HEAD_DIM ** -0.5) for m in (cudnn_mask, unpacked))
        diff = (out_unpacked - out_packed).float().norm() / out_packed.float().norm()
        row["cudnn_flex_unpacked_rel_diff"] = diff.item()
        print(f"  cudnn_flex_tree_unpacked {times['cudnn_flex_tree_unpacked']} (rel diff to packed "
              f"{row['cudnn_flex_unpacked_rel_diff']:.1e})", flush=True)
    if not args.skip_dense and not long:
        mask = dense_tree_mask(end)
        times["dense_sdpa"] = time_fwd_bwd(sdpa_gqa(SDPBackend.EFFICIENT_ATTENTION, attn_mask=mask), [q, k, v], g, args)
        print(f"  dense_sdpa {times['dense_sdpa']}", flush=True)
        del mask
    for method, backend in (("causal_flash", SDPBackend.FLASH_ATTENTION), ("causal_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            times[method] = time_fwd_bwd(sdpa_gqa(backend, is_causal=True), [q, k, v], g, args)
            print(f"  {method} {times[method]}", flush=True)
        except RuntimeError as exc:
            row[f"{method}_error"] = str(exc).splitlines()[0]
    if not long:
        times.update(bench_flat(mb.seq_lens, row, args, dev, gen))
        times.update(bench_te_thd(mb.seq_lens, args, dev, gen))
    row["times"] = times
    pairs = {"flex_tree": row["tree_pairs"], "dense_sdpa": row["tree_pairs"], "fa4_tree": row["tree_pairs"],
             "cudnn_flex_tree": row["tree_pairs"], "cudnn_flex_tree_unpacked": row["tree_pairs"],
             "causal_flash": row["causal_pairs"], "causal_cudnn": row["causal_pairs"], "causal_fa4": row["causal_pairs"]}
    pairs.update({m: row["flat_pairs"] for m in times if m.startswith("flat")})
    ref = row["causal_pairs"] / times["causal_flash"]["fwd_bwd_ms"]
    row["per_pair_efficiency_vs_causal_flash"] = {
        m: pairs[m] / tm["fwd_bwd_ms"] / ref for m, tm in times.items()
    }
    dense = {m: pairs[m] / times[m]["fwd_bwd_ms"] for m in DENSE_KERNELS if m in times}
    row["fastest_dense"] = max(dense, key=dense.get)
    row["per_pair_efficiency_vs_fastest"] = {
        m: pairs[m] / tm["fwd_bwd_ms"] / dense[row["fastest_dense"]] for m, tm in times.items()
    }
    return row


DENSE_KERNELS = ("causal_flash", "causal_cudnn", "causal_fa4", "flat_varlen", "flat_te_thd")
"""The dense kernels a tree kernel is measured against (per useful pair, forward + backward)."""


def bench_te_thd(seq_lens, args, dev, gen) -> dict:
    """The flat sequences through TE's cuDNN fused attention, THD (Megatron's packed sequences, as megatron-core's
    TE spec calls it: ``padding_causal``, whatever shapes our own chains backend is proven on); {} without TE."""
    from megatron_tree.core.platform import have_transformer_engine

    if not have_transformer_engine():
        return {}
    from transformer_engine.pytorch import DotProductAttention

    n, longest = sum(seq_lens), max(seq_lens)
    q, k, v, g = bf16_inputs(n, dev, gen)
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(seq_lens)]), dtype=torch.int32, device=dev)
    te = DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=KV_HEADS, qkv_format="thd",
                             attn_mask_type="padding_causal", softmax_scale=HEAD_DIM**-0.5)

    def thd(q, k, v):  # [1, heads, s, d] -> TE's [s, heads, d] and back
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
        out = te(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                 max_seqlen_kv=longest)
        return out.view(n, HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0)

    out = {"flat_te_thd": time_fwd_bwd(thd, [q, k, v], g, args)}
    print(f"  flat_te_thd {out['flat_te_thd']}", flush=True)
    return out


def bench_flat(seq_lens, row, args, dev, gen) -> dict:
    """Flat baseline: every original sequence causal on its own, packed one after another."""
    n = sum(seq_lens)
    bf16 = torch.bfloat16
    q = leaf((n, HEADS, HEAD_DIM), bf16, dev, gen)
    k, v = (leaf((n, KV_HEADS, HEAD_DIM), bf16, dev, gen) for _ in range(2))
    g = torch.randn(q.shape, device=dev, generator=gen).to(bf16)
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(seq_lens)]), dtype=torch.int32, device=dev)
    attn = varlen_attention(cu, max(seq_lens))
    if attn is not None:
        try:
            out = {"flat_varlen": time_fwd_bwd(attn, [q, k, v], g, args)}
            print(f"  flat_varlen {out['flat_varlen']}", flush=True)
            return out
        except (RuntimeError, TypeError) as exc:
            row["flat_varlen_error"] = str(exc).splitlines()[0]
    end = doc_subtree_end(seq_lens, dev)
    row["flat_flex_doc_slots"] = padded_length(n)

    doc_mask = flex_tree_mask(end)

    def flex_doc(q, k, v):
        return flex_tree_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], doc_mask)

    out = {"flat_flex_doc": time_fwd_bwd(flex_doc, [q, k, v], g.transpose(0, 1)[None], args)}
    print(f"  flat_flex_doc {out['flat_flex_doc']}", flush=True)
    return out


def bench_variants(seqs, names, args, dev, gen) -> list[dict]:
    """fwd / fwd+bwd ms of flex_tree_attention variants (block sizes, kernel options) on one workload."""
    mb = fullest_micro_batch(seqs, SLOTS)
    end = mb.attention_mask[0].to(device=dev, dtype=torch.int32)
    t = end.shape[0]
    q, k, v, g = bf16_inputs(t, dev, gen)
    ref = flex_tree_attention(q, k, v, flex_tree_mask(end)).float()
    rows = []
    for name in names:
        kw = VARIANTS[name]
        row = {"variant": name, **{k_: str(v_) for k_, v_ in kw.items()}, **block_stats(end, kw["block_size"])}
        try:
            t0 = time.perf_counter()
            variant_mask = flex_tree_mask(end, kw["block_size"])
            options = {"kernel_options": kw["kernel_options"]} if "kernel_options" in kw else {}
            out = flex_tree_attention(q, k, v, variant_mask, **options)
            out.backward(g)
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            row["rel_diff_vs_bs128"] = ((out.float() - ref).norm() / ref.norm()).item()
            row.update(time_fwd_bwd(lambda q, k, v: flex_tree_attention(q, k, v, variant_mask, **options), [q, k, v], g,
                                    args))
        except Exception as exc:  # a variant the kernel refuses is reported, not fatal
            row["error"] = error_line(exc)
        print(f"  variant {row}", flush=True)
        rows.append(row)
    return rows


def accuracy(dev, gen) -> dict:
    """Relative errors vs float64 dense SDPA: flex fp32, flex bf16 and dense SDPA bf16 (out, dq, dk, dv); FA4 and
    cuDNN flex bf16 where they run."""
    rng = np.random.default_rng(1)
    seqs = grpo_batch(rng, n_prompts=3, samples=(4, 8), prompt_len=(200, 800), response_len=(50, 400), vocab=150000)
    mb = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=4000))[0]
    end = mb.attention_mask[0].to(device=dev, dtype=torch.int32)
    t = end.shape[0]
    base = [torch.randn(s, device=dev, generator=gen) for s in
            ((1, HEADS, t, HEAD_DIM), (1, KV_HEADS, t, HEAD_DIM), (1, KV_HEADS, t, HEAD_DIM), (1, HEADS, t, HEAD_DIM))]
    mask = dense_tree_mask(end)

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    flex_mask = flex_tree_mask(end)

    def flex(q, k, v):
        return flex_tree_attention(q, k, v, flex_mask)

    ref = forward_backward(dense, base, torch.float64)

    def err(fn, dtype):  # out / dq / dk / dv errors of fn in dtype against the fp64 dense reference
        return relative_errors(forward_backward(fn, base, dtype), ref)

    result = {"slots": t, "flex_fp32": err(flex, torch.float32), "flex_bf16": err(flex, torch.bfloat16),
              "dense_bf16": err(dense, torch.bfloat16)}
    if fa4_available():
        prepared = fa4_tree_mask(end)
        result["fa4_bf16"] = err(lambda q, k, v: fa4_tree_attention(q, k, v, prepared), torch.bfloat16)
    if cudnn_flex_available():
        cudnn_mask = cudnn_flex_tree_mask(end)
        result["cudnn_flex_bf16"] = err(lambda q, k, v: cudnn_flex._flex(q, k, v, cudnn_mask, HEAD_DIM ** -0.5),
                                        torch.bfloat16)
    return result


def plot(result: dict, path: str) -> None:
    """Two panels per workload: fwd+bwd ms (log) and per-pair efficiency vs causal flash."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["workloads"]
    methods = ["fa4_tree", "cudnn_flex_tree", "flex_tree", "dense_sdpa", "causal_flash", "causal_cudnn", "causal_fa4", "flat_varlen",
               "flat_flex_doc", "flat_te_thd"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j for j, r in enumerate(rows) if m in r["times"]]
        if not xs:
            continue
        ms = [rows[j]["times"][m]["fwd_bwd_ms"] for j in xs]
        eff = [rows[j]["per_pair_efficiency_vs_fastest"][m] for j in xs]
        axes[0].bar([x + i * width for x in xs], ms, width, label=m)
        axes[1].bar([x + i * width for x in xs], eff, width, label=m)
    for ax, title in zip(axes, ("fwd+bwd time (ms, log)", "useful pairs / s vs the fastest dense kernel")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
        ax.set_xticklabels([f"{r['workload']}\nT={r['slots']}\nuniq={r['unique_tokens']}" for r in rows], fontsize=8)
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[1].axhline(0.85, color="k", ls="--", lw=1)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"Tree attention on {result['device']}: bf16, {HEADS} heads, {KV_HEADS} KV heads, d={HEAD_DIM}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", nargs="*", default=["grpo", "multi_turn", "no_sharing", "long_multi_turn"])
    ap.add_argument("--variants", nargs="*", default=[n for n in VARIANTS if n != "bs128"], choices=list(VARIANTS))
    ap.add_argument("--skip-dense", action="store_true", help="skip SDPA with the dense [T, T] mask")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench.py needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "batch": 1,
                   "warmup": args.warmup, "iters": args.iters},
    }
    from megatron_tree.core.platform import have_transformer_engine

    # TE loads the system cuDNN; import it before SDPA's cuDNN backend loads torch's own copy.
    have_transformer_engine()
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"attention_{args.tag}.json")
    result["accuracy"] = accuracy(dev, gen)
    print("accuracy", json.dumps(result["accuracy"]), flush=True)
    batches = workloads(args.seed)
    result["workloads"] = []
    for name in args.workloads:
        result["workloads"].append(bench_workload(name, batches[name], args, dev, gen))
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if args.variants:
        result["variants_grpo"] = bench_variants(batches["grpo"], ["bs128", *args.variants], args, dev, gen)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, f"attention_{args.tag}.png"))
    print(f"\n{'workload':11s} {'method':14s} {'fwd ms':>8s} {'fwd+bwd ms':>10s} {'pairs/s vs flash':>16s} "
          f"{'vs fastest':>10s}")
    for r in result["workloads"]:
        for m, tm in r["times"].items():
            eff, best = r["per_pair_efficiency_vs_causal_flash"][m], r["per_pair_efficiency_vs_fastest"][m]
            print(f"{r['workload']:11s} {m:14s} {tm['fwd_ms']:8.2f} {tm['fwd_bwd_ms']:10.2f} {eff:16.2f} {best:10.2f}")
        print(f"{r['workload']:11s} fastest dense kernel: {r['fastest_dense']}; tile ceiling (per pair, every visited "
              f"128x128 tile as fast as causal's): {r['tile_ceiling']:.3f}")
        print(f"{r['workload']:11s} block mask build: flex {r['block_mask_build_ms']:.2f} ms, "
              f"fa4 {r.get('fa4_mask_build_ms') or float('nan'):.2f} ms, create_block_mask "
              f"{r['create_block_mask_ms'] or float('nan'):.2f} ms")


if __name__ == "__main__":
    main()

"""Attention conformance: every tree attention backend, forward and backward, against the dense fp64 reference.

For each backend and each call shape of a grid (head dims 64 .. 256, 192 with v 128 as in MLA; MHA
and GQA 2:1, 4:1; bf16, fp16, fp32), on branching trees whose last tile is ragged, and under
context-parallel query slots (a scattered half of the slots as queries), it compares out, dQ, dK, dV
with fp64 SDPA (math kernel) on the dense tree mask, and holds each to the rule of
:func:`accept`: relative error at most ``K`` times the dense kernel's own error at that precision.

Two ways to call a backend, both recorded:

* ``routed``: as training calls it (:func:`megatron_tree.attention.tree_attention` with the backend
  named): runs where the backend's ``PROVEN`` table fits the call, else refused. A routed call
  that runs must pass; a refusal is the backend declining a shape it is not proven on.
* ``raw``: the kernel itself on the exact shape, no table, no padding (FA4's, FlexAttention's and cuDNN
  frontend's flex kernels): the evidence that proves a shape (add it to the backend's ``PROVEN``) or shows why it
  is not trusted.

``python -m megatron_tree.attention.conformance --out results.json`` runs the grid on this machine's
GPU and writes every row (a JSON list) and a table; ``--window W`` runs it with a sliding window of W
path tokens (the evidence for a backend's windowed table, e.g. ``flex.PROVEN_WINDOWED``); ``tests/attention/test_attention_conformance.py`` runs
the routed rows (and, on CPU, the rule against a backend with a broken backward).

Shape legend: T = slots, Tq = query rows, h / hkv = query / key-value heads, d / dv = q-k / v head dims.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from megatron_tree.attention.shapes import AttentionShape, device_generation
from megatron_tree.core.masks import dense_tree_mask
from megatron_tree.core.microbatch_spec import MicroBatchSpec
from megatron_tree.core.packing import pack_trees
from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch

__all__ = ["K", "FLOOR", "Row", "accept", "conformance_tree", "forward_backward", "head_dim_grid", "main",
           "relative_errors", "run_conformance"]

K = 2.0
"""A backend's relative error may be at most ``K`` times the dense kernel's at the same precision (FlashAttention's rule)."""

FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-5}
"""Added to the bound, for errors too small to compare as ratios (fp32 kernels agree to ~1e-7)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GRADS = ("out", "dq", "dk", "dv")


def head_dim_grid() -> list[tuple[int, int]]:
    """``(d, dv)`` of the grid: every head dim of the models users train, and MLA's 192 / 128."""
    return [(d, d) for d in (64, 72, 80, 96, 104, 112, 128)] + [(192, 128), (256, 256)]


def conformance_tree(kind: str, max_tokens: int, device: torch.device | str) -> torch.Tensor:
    """``subtree_end`` int32 [T] of one branching micro-batch: ``"grpo"`` (siblings after long shared
    prompts) or ``"multi_turn"`` (deep trees of short turns); T is not a multiple of 128."""
    rng = np.random.default_rng(7)
    if kind == "grpo":
        seqs = grpo_batch(rng, n_prompts=2, samples=(4, 8), prompt_len=(max_tokens // 10, max_tokens // 3),
                          response_len=(max_tokens // 150 + 1, max_tokens // 8), vocab=1000)
    else:
        seqs = multi_turn_batch(rng, n_conversations=3, turns=(4, 10), turn_len=(5, max_tokens // 25),
                                fork_prob=0.4, system_len=max_tokens // 15, vocab=1000)
    end = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=max_tokens))[0].attention_mask[0]
    if end.shape[0] % 128 == 0:  # a ragged last tile
        end = end[:-1].clamp(max=end.shape[0] - 1)
    return end.to(device)


def accept(errors: dict[str, float], dense_errors: dict[str, float], dtype: torch.dtype, k: float = K) -> list[str]:
    """The rule: each of out / dq / dk / dv within ``k`` x the dense kernel's error plus :data:`FLOOR`.
    Returns the violations (empty: accepted)."""
    floor = FLOOR[dtype]
    return [
        f"{name}: rel err {errors[name]:.3g} > {k:g} x dense {dense_errors[name]:.3g} + {floor:g}"
        for name in GRADS
        if not errors[name] <= k * dense_errors[name] + floor  # NaN fails
    ]


@dataclass
class Row:
    """One (backend, mode, shape, tree) result. ``status``: ``pass``, ``FAIL`` (ran, broke the rule),
    ``refused`` (routed: the backend declined the shape), ``error`` (raw: the kernel raised)."""

    backend: str
    mode: str
    tree: str
    head_dim: int
    v_head_dim: int
    gqa_ratio: int
    dtype: str
    device: str
    status: str
    errors: dict = field(default_factory=dict)
    dense_errors: dict = field(default_factory=dict)
    message: str = ""
    seconds: float = 0.0
    window: int | None = None


def relative_errors(xs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> dict[str, float]:
    """``{"out", "dq", "dk", "dv": ||x - ref|| / ||ref||}`` (Frobenius norms, in fp64) of ``xs`` against ``refs``, both
    in :data:`GRADS` order: the errors :func:`accept` compares."""
    return {n: ((x.double() - r).norm() / r.norm()).item() for n, x, r in zip(GRADS, xs, refs)}


def forward_backward(fn: Callable, base: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """out, dq, dk, dv of ``fn(q, k, v)`` on ``base = (q, k, v, grad_out)`` cast to ``dtype``."""
    q, k, v = (x.detach().to(dtype, copy=True).requires_grad_() for x in base[:3])
    out = fn(q, k, v)
    out.backward(base[3].to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _inputs(t: int, tq: int, heads: int, kv_heads: int, d: int, dv: int, device, seed: int) -> list[torch.Tensor]:
    """q [1, h, Tq, d], k [1, hkv, T, d], v [1, hkv, T, dv], grad_out [1, h, Tq, dv] in fp64, bf16- and
    fp16-representable (so every precision sees the same inputs)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = ((1, heads, tq, d), (1, kv_heads, t, d), (1, kv_heads, t, dv), (1, heads, tq, dv))
    return [(torch.randn(s, device=device, generator=g) * 0.5).bfloat16().double() for s in shapes]


def _megatron_layout(fn: Callable) -> Callable:
    """A ``[1, h, T, d]`` attention from :func:`~megatron_tree.attention.tree_attention`'s ``[T, 1, h, d]`` one."""

    def attend(q, k, v):
        t, h, dv = q.shape[2], q.shape[1], v.shape[-1]
        out = fn(*(x.permute(2, 0, 1, 3) for x in (q, k, v)))  # [Tq, 1, h * dv]
        return out.view(t, 1, h, dv).permute(1, 2, 0, 3)

    return attend


_RAW_KERNELS = ("flex", "fa4", "cudnn_flex")
"""The backends whose kernels ``raw`` mode runs without their tables."""


def _raw(backend: str, end: torch.Tensor, slots: torch.Tensor | None, scale: float,
         window: int | None = None) -> Callable | None:
    """The backend's kernel on the exact shape (no ``PROVEN`` table, no padding); None for backends without one."""
    if backend == "flex":
        from megatron_tree.attention.flex import flex_tree_attention, flex_tree_mask

        mask = flex_tree_mask(end, query_slots=slots, window=window)
        return lambda q, k, v: flex_tree_attention(q, k, v, mask, softmax_scale=scale)
    if backend == "fa4":
        from megatron_tree.attention.fa4 import WINDOW_REFUSAL, _flash, fa4_tree_mask

        if window is not None:
            raise ValueError(WINDOW_REFUSAL)

        mask = fa4_tree_mask(end, slots)
        return lambda q, k, v: _flash(q, k, v, mask, scale)
    if backend == "cudnn_flex":
        from megatron_tree.attention.cudnn_flex import WINDOW_REFUSAL, _flex, cudnn_flex_tree_mask

        if window is not None:
            raise ValueError(WINDOW_REFUSAL)
        mask = cudnn_flex_tree_mask(end, slots)
        return lambda q, k, v: _flex(q, k, v, mask, scale)
    return None


def _routed(backend: str, end: torch.Tensor, slots: torch.Tensor | None, scale: float,
            window: int | None = None) -> Callable:
    """The backend as training calls it (query slots: the rank's share under context parallel, one process)."""
    from megatron_tree.attention import PREPARED_MASKS, get_tree_attention_backend

    impl = get_tree_attention_backend(backend)

    if slots is None:
        from megatron_tree.attention import tree_attention

        return _megatron_layout(
            lambda q, k, v: tree_attention(q, k, v, end[None], scale=scale, backend=backend, window=window)
        )

    def attend(q, k, v):  # the CP path of tree_attention after its all-gather: the rank's queries, all keys
        shape = AttentionShape.of(q, k, v, windowed=window is not None)
        reason = impl.refusal(shape, batch=1, dropout_p=0.0)
        if reason is None and window is not None and not impl.windowed:
            reason = f"the {backend} backend takes no sliding window"
        if reason is not None:
            raise ValueError(reason)
        PREPARED_MASKS.clear()
        extra = {} if window is None else {"window": window}
        return impl.attend(q, k, v, impl.prepare(end[None], slots, **extra), scale=scale, dropout_p=0.0)

    return attend


def run_conformance(
    backends: Sequence[str],
    *,
    head_dims: Sequence[tuple[int, int]] | None = None,
    gqa_ratios: Sequence[int] = (1, 2, 4),
    dtypes: Sequence[str] = ("bf16", "fp16", "fp32"),
    trees: Sequence[str] = ("grpo", "multi_turn", "grpo_query_slots"),
    modes: Sequence[str] = ("routed", "raw"),
    max_tokens: int = 3000,
    heads: int = 8,
    device: torch.device | str | None = None,
    progress: Callable[[Row], None] | None = None,
    window: int | None = None,
) -> list[Row]:
    """Every (backend, mode, tree, head dims, GQA ratio, dtype) of the grid; returns the rows.

    ``trees``: ``grpo`` / ``multi_turn`` (every slot a query) and ``grpo_query_slots`` (context
    parallel: a random half of the slots as queries, all slots as keys). ``heads`` query heads,
    ``heads / ratio`` key/value heads. The fp64 reference and the dense kernel's error are computed
    once per (tree, shape, dtype). ``window``: every call with that sliding window (None: the plain tree mask).
    """
    from megatron_tree.attention import PREPARED_MASKS

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    generation = device_generation(device)
    rows: list[Row] = []

    def emit(row: Row) -> None:
        rows.append(row)
        if progress is not None:
            progress(row)

    for tree in trees:
        end = conformance_tree(tree.removesuffix("_query_slots"), max_tokens, device)
        t = end.shape[0]
        slots = None
        if tree.endswith("_query_slots"):
            slots = torch.randperm(t, generator=torch.Generator().manual_seed(3))[: t // 2].to(device)
        tq = t if slots is None else slots.numel()
        mask = dense_tree_mask(end, slots, window)
        for (d, dv), ratio in ((dims, r) for dims in (head_dims or head_dim_grid()) for r in gqa_ratios):
            base = _inputs(t, tq, heads, heads // ratio, d, dv, device, seed=d * 10 + ratio)
            scale = 1.0 / math.sqrt(d)

            def dense(q, k, v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                        enable_gqa=True)

            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                ref = forward_backward(dense, base, torch.float64)
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                dense_errors = relative_errors(forward_backward(dense, base, dtype), ref)
                for backend in backends:
                    for mode in modes:
                        fn = _routed(backend, end, slots, scale, window) if mode == "routed" else None
                        if mode == "raw":
                            if backend not in _RAW_KERNELS or (backend == "flex" and not device.type == "cuda"):
                                continue
                            try:
                                fn = _raw(backend, end, slots, scale, window)
                            except Exception as exc:  # FA4 not runnable here
                                emit(Row(backend, mode, tree, d, dv, ratio, dtype_name, generation, "error",
                                         message=f"{type(exc).__name__}: {exc}"[:400], window=window))
                                continue
                        PREPARED_MASKS.clear()
                        start = time.perf_counter()
                        row = Row(backend, mode, tree, d, dv, ratio, dtype_name, generation, "pass",
                                  dense_errors=dense_errors, window=window)
                        try:
                            errors = relative_errors(forward_backward(fn, base, dtype), ref)
                        except Exception as exc:
                            row.status = "refused" if mode == "routed" else "error"
                            row.message = f"{type(exc).__name__}: {exc}"[:400]
                        else:
                            row.errors = errors
                            problems = accept(errors, dense_errors, dtype)
                            if problems:
                                row.status, row.message = "FAIL", "; ".join(problems)
                        row.seconds = round(time.perf_counter() - start, 3)
                        emit(row)
    return rows


def _line(row: Row) -> str:
    dims = f"{row.head_dim}" + ("" if row.v_head_dim == row.head_dim else f"/v{row.v_head_dim}")
    worst = max(((e / (row.dense_errors[n] or 1e-30), n) for n, e in row.errors.items()), default=None)
    ratio = f"worst {worst[1]} {worst[0]:.2f}x dense" if worst else row.message[:120]
    tree = row.tree if row.window is None else f"{row.tree} w={row.window}"
    return (f"{row.backend:6} {row.mode:6} {tree:17} d={dims:7} gqa={row.gqa_ratio} {row.dtype:4} "
            f"{row.device:5} {row.status:7} {ratio}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the grid, print a line per row, write the rows as JSON. Exit 1 if a routed row FAILs."""
    parser = argparse.ArgumentParser(prog="python -m megatron_tree.attention.conformance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--backends", nargs="+", default=["dense", "flex", "fa4", "auto"])
    parser.add_argument("--head-dims", nargs="+", default=None, metavar="D[/DV]",
                        help="head dims (d, or d/dv); default: 64 72 80 96 104 112 128 192/128 256")
    parser.add_argument("--gqa-ratios", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--heads", type=int, default=8,
                        help="query heads (each GQA ratio must divide it; 35 gives ratios 5 and 7)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16", "fp32"])
    parser.add_argument("--trees", nargs="+", choices=["grpo", "multi_turn", "grpo_query_slots"],
                        default=["grpo", "multi_turn", "grpo_query_slots"])
    parser.add_argument("--modes", nargs="+", choices=["routed", "raw"], default=["routed", "raw"])
    parser.add_argument("--window", type=int, default=None,
                        help="a sliding window of this many path tokens on every call (default: none)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="slots of each test tree, about (default: 3000 on a GPU, 300 on the CPU)")
    args = parser.parse_args(argv)
    bad = [r for r in args.gqa_ratios if r < 1 or args.heads % r]
    if bad:
        parser.error(f"--gqa-ratios {bad} do not divide --heads {args.heads}")
    dims = None
    if args.head_dims:
        dims = [tuple(int(x) for x in s.split("/")) if "/" in s else (int(s), int(s)) for s in args.head_dims]
    from megatron_tree.core.platform import have_transformer_engine

    have_transformer_engine()  # TE loads the system cuDNN: import it before SDPA's cuDNN runs
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    import importlib.metadata

    for package in ("flash-attn-4", "nvidia-cudnn-frontend"):
        try:
            meta[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            meta[package] = None
    done: list[Row] = []
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "k": K, "rows": []}, f)

    def record(row: Row) -> None:  # rewrite the file after every row: a run cut short keeps what it measured
        done.append(row)
        print(_line(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "k": K, "rows": [asdict(r) for r in done]}, f, indent=1)

    rows = run_conformance(args.backends, head_dims=dims, gqa_ratios=args.gqa_ratios, dtypes=args.dtypes,
                           trees=args.trees, modes=args.modes, heads=args.heads, window=args.window,
                           max_tokens=args.max_tokens or (3000 if torch.cuda.is_available() else 300),
                           progress=record)
    failed = [r for r in rows if r.mode == "routed" and r.status == "FAIL"]
    print(f"{len(rows)} rows, routed: {sum(r.status == 'pass' for r in rows if r.mode == 'routed')} pass, "
          f"{sum(r.status == 'refused' for r in rows if r.mode == 'routed')} refused, {len(failed)} FAIL; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

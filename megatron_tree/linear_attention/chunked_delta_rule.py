"""The chunked gated delta rule with flash-linear-attention's ``chunk_gated_delta_rule`` semantics.

Shape legend: B = batch rows, T = tokens per row, H = heads, Kd = query/key head dim, Vd = value
head dim, N = sequences (B, or ``len(cu_seqlens) - 1``), C = chunks of ``CHUNK`` tokens, n_j = sequences
that have a chunk j.

The recurrence, per sequence and head, state ``S`` [Kd, Vd] (zero or ``initial_state``)::

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule: write the part of v_t that S misses)
    o_t = scale * S^T q_t

Chunked (WY / UT form): in a chunk with in-chunk cumulative log decay ``G`` and start state ``S0``,
``U = (I + A)^-1 (beta V - beta exp(G) K S0)`` with ``A[r, s] = beta_r exp(G_r - G_s) k_r.k_s`` (s < r),
so ``U = U0 - W S0`` where ``U0``, ``W`` need no state; then
``O = scale (exp(G) Q S0 + (QK^T * exp(G_r - G_s), s <= r) U)`` and
``S_end = exp(G_last) S0 + (exp(G_last - G) K)^T U``. Everything but ``U`` and ``S_end`` runs for all
chunks at once; a Python loop over the chunk index j carries the states (``U`` and ``S_end`` of the
n_j sequences with a chunk j, one batched matmul each). One-token sequences (a tree micro-batch's padding slots,
one-token segments) take the closed form of one step instead of a 64-row chunk each.

flash-linear-attention's Triton kernels (``fla.ops.gated_delta_rule``) run only for the input dtypes of
:data:`FLA_DTYPES`, on CUDA, where fla imports: none yet, as no GPU test has compared them. On the H200 host
(triton 3.6) fla 0.6.0 refuses itself: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results
for gated chunk_bwd_dqkwg (see #640)" (``benchmarks/fla_probe.py``); our first tree test there stopped at an
illegal memory access in its varlen backward. Elsewhere the PyTorch path below (autograd backward; fp64
math for fp64 inputs, the exactness checks, else fp32, the chunk decays in fp64 always), exact on CPU and GPU.
fp32 never goes to fla: its Triton dots take TF32."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from megatron_tree.linear_attention.checks import check_finite, check_floating, check_shape, compute_dtype

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
except ImportError:
    _fla_chunk_gated_delta_rule = None

__all__ = ["CHUNK", "FLA_DTYPES", "chunk_gated_delta_rule", "unchecked_chunk_gated_delta_rule"]

FLA_DTYPES: tuple[torch.dtype, ...] = ()
"""Input dtypes that run on fla's kernels on CUDA: those a GPU run of ``tests/linear_attention -m gpu`` with
``MEGATRON_TREE_FLA_CHECK=1`` passed (a tree through fla within 2x the error of fla on each root path alone,
against the fp32 PyTorch path). None yet: the first run (fla 0.6.0, H200, triton 3.6) stopped at an illegal
memory access in fla's varlen backward."""

CHUNK = 64


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over ``q``, ``k`` [B, T, H, Kd], ``v`` [B, T, H, Vd], ``g`` (log decay, <= 0) and
    ``beta`` [B, T, H] (module docstring), as ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.

    ``scale`` defaults to ``Kd ** -0.5`` (no l2 norm is applied here). ``initial_state`` [N, H, Kd, Vd]
    (fp32 preferred; fp64 with fp64 inputs) starts each sequence, zero if None. With ``cu_seqlens`` (int [N+1],
    B == 1) each range ``[cu_seqlens[n], cu_seqlens[n+1])`` of the T tokens is an independent sequence. Returns
    ``o`` [B, T, H, Vd] in q's dtype and, if ``output_final_state``, the final states [N, H, Kd, Vd] in
    ``compute_dtype(q.dtype)`` (fp64 for fp64 q, else fp32; None if not asked for). Differentiable in q, k, v, g,
    beta and initial_state.
    """
    lengths = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return unchecked_chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                            lengths=lengths)


def unchecked_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    lengths: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_gated_delta_rule` on inputs already checked, with the sequence ``lengths`` [N] on the host
    (``cu_seqlens`` on the host, or B times T): fla's kernels for bf16 / fp16 on CUDA where fla imports, else
    PyTorch."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if _fla_chunk_gated_delta_rule is not None and q.is_cuda and q.dtype in FLA_DTYPES:
        return _fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    b, t, h, _ = q.shape
    dtype = compute_dtype(q.dtype)
    flat = [x.reshape((b * t, h) + x.shape[3:]).to(dtype) for x in (q, k, v, g, beta)]
    o, final = _torch_path(*flat, scale=scale, initial_state=initial_state, lengths=lengths,
                           output_final_state=output_final_state)
    return o.reshape(v.shape).to(q.dtype), final


@dataclass(frozen=True)
class _ChunkPlan:
    """Where each token goes in the chunked layout. Chunks are ordered by (chunk index j, sequence rank),
    sequences ranked by descending chunk count, so the n_j sequences with a chunk j are ranks 0..n_j-1
    and their chunks j are rows ``[sum(steps[:j]), sum(steps[:j + 1]))``.

    token      [C, CHUNK] int64  token of each chunk position, ``T`` (a zero row) past a sequence's end.
    row        [T]        int64  position of each token in the flattened [C * CHUNK] layout.
    by_rank    [N]        int64  sequence of each rank.
    rank       [N]        int64  rank of each sequence.
    steps      list[int]  n_j for each chunk index j (host).
    """

    token: torch.Tensor
    row: torch.Tensor
    by_rank: torch.Tensor
    rank: torch.Tensor
    steps: list[int]


def _plan(lengths: tuple[int, ...], device: torch.device) -> _ChunkPlan:
    lens = np.asarray(lengths, np.int64)
    n = lens.shape[0]
    total = int(lens.sum())
    starts = np.cumsum(lens) - lens
    chunks = -(-lens // CHUNK)
    by_rank = np.argsort(-chunks, kind="stable")
    rank = np.empty(n, np.int64)
    rank[by_rank] = np.arange(n)
    seq = np.repeat(np.arange(n), chunks)
    index = np.arange(seq.shape[0]) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    order = np.lexsort((rank[seq], index))
    seq, index = seq[order], index[order]
    pos = starts[seq, None] + index[:, None] * CHUNK + np.arange(CHUNK)
    inside = pos < (starts + lens)[seq, None]
    row = np.empty(total, np.int64)
    row[pos[inside]] = np.flatnonzero(inside)

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return _ChunkPlan(token=dev(np.where(inside, pos, total)), row=dev(row), by_rank=dev(by_rank), rank=dev(rank),
                      steps=np.bincount(index).tolist())


def _torch_path(q, k, v, g, beta, *, scale, initial_state, lengths, output_final_state):
    """``q``, ``k`` [T, H, Kd], ``v`` [T, H, Vd], ``g``, ``beta`` [T, H] of N packed sequences, all of one dtype (fp32
    or fp64, the math's) -> (o [T, H, Vd], final states [N, H, Kd, Vd] or None) in it. One-token sequences (a
    tree's padding slots, single-token segments) in closed form, the others chunked: a chunk of 64 rows per
    one-token sequence would multiply their work by 64."""
    lens = np.asarray(lengths, np.int64)
    single = lens == 1
    if not single.any():
        o, final = _chunked_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state, lengths=lengths)
        return o, final if output_final_state else None
    device = q.device
    one = torch.from_numpy((np.cumsum(lens) - 1)[single]).to(device)  # the token of each one-token sequence
    rest = torch.from_numpy(np.flatnonzero(np.repeat(~single, lens))).to(device)
    by_kind = [torch.from_numpy(np.flatnonzero(single)).to(device), torch.from_numpy(np.flatnonzero(~single)).to(device)]
    s0 = [None, None] if initial_state is None else [initial_state.to(q.dtype)[i] for i in by_kind]
    o1, f1 = _one_token(q[one], k[one], v[one], g[one], beta[one], scale=scale, initial_state=s0[0],
                        output_final_state=output_final_state)
    if rest.numel():
        o2, f2 = _chunked_torch(q[rest], k[rest], v[rest], g[rest], beta[rest], scale=scale, initial_state=s0[1],
                                lengths=tuple(lens[~single].tolist()))
    else:
        o2, f2 = o1[:0], (f1[:0] if output_final_state else None)
    o = torch.cat([o1, o2])[_inverse(torch.cat([one, rest]))]
    final = torch.cat([f1, f2])[_inverse(torch.cat(by_kind))] if output_final_state else None
    return o, final


def _one_token(q, k, v, g, beta, *, scale, initial_state, output_final_state):
    """The rule on n one-token sequences (``q``, ``k`` [n, H, Kd], ``v`` [n, H, Vd], ``g``, ``beta`` [n, H], state
    ``initial_state`` [n, H, Kd, Vd] or zero): ``u = beta (v - exp(g) S0^T k)``, ``o = scale (exp(g) S0^T q +
    (k.q) u)``, final ``exp(g) S0 + k u^T`` (if asked for)."""
    decay = g.exp()[..., None]
    if initial_state is None:
        u = beta[..., None] * v
        # g acts on the zero state only: a zero gradient, kept in the graph as the chunked path keeps it
        o = scale * (k * q).sum(-1, keepdim=True) * u + 0.0 * decay
    else:
        u = beta[..., None] * (v - decay * torch.einsum("nhkv,nhk->nhv", initial_state, k))
        o = scale * (decay * torch.einsum("nhkv,nhk->nhv", initial_state, q) + (k * q).sum(-1, keepdim=True) * u)
    if not output_final_state:
        return o, None
    final = k[..., :, None] * u[..., None, :]
    return o, final if initial_state is None else final + decay[..., None] * initial_state


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of ``order`` (int64 [n])."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    return inverse


def _chunk_decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_decays` of ``g`` computed in fp64 (forward and backward), returned in g's dtype: in fp32 the
    differences of G cancel (|G| grows along the chunk), which was the chunked rule's largest rounding, at a chunk's
    end, and moved with where a tree's segments start chunks (H200, Qwen3-Next's head sizes, fp32 vs fp64: dA_log
    6.7e-5 -> 1.6e-7, dg 1.7e-5 -> 4.3e-7; ``tests/linear_attention/test_fp64_scan.py``). The tensors are
    elementwise, a small share of the rule's work."""
    return tuple(x.to(g.dtype) for x in _decays(g.double()))


def _decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decay factors of each chunk from ``g`` [C, H, CHUNK] (log decays, zero past a sequence's end), with G the
    in-chunk cumulative sum of g, in g's dtype: ``exp(G_r - G_s)`` [C, H, CHUNK, CHUNK] (0 for s > r), ``exp(G)``,
    ``exp(G_last - G)`` [C, H, CHUNK] and ``exp(G_last)`` [C, H, 1]."""
    log_decay = g.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=g.device).tril()
    pair = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, -math.inf).exp()
    last = log_decay[..., -1:]
    return pair, log_decay.exp(), (last - log_decay).exp(), last.exp()


def _chunked_torch(q, k, v, g, beta, *, scale, initial_state, lengths):
    """``q``, ``k`` [T, H, Kd], ``v`` [T, H, Vd], ``g``, ``beta`` [T, H] of N packed sequences, all fp32 or all fp64 ->
    (o [T, H, Vd], final states [N, H, Kd, Vd]), both in that dtype."""
    plan = _plan(lengths, q.device)
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]

    def chunked(x):  # [T, H, ...] -> [C, H, CHUNK, ...], zeros past each sequence's end
        padded = torch.cat([x, x.new_zeros((1,) + x.shape[1:])])
        return padded[plan.token].movedim(1, 2)

    q, k, v, g, beta = map(chunked, (q, k, v, g, beta))
    pair_decay, from_start, to_end, whole = _chunk_decays(g)
    k_beta = k * beta[..., None]
    a = ((k_beta @ k.mT) * pair_decay).tril(-1)
    rhs = torch.cat([v * beta[..., None], k_beta * from_start[..., None]], -1)
    u0, w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    attn = (q @ k.mT) * pair_decay * scale
    q_decayed = q * (from_start * scale)[..., None]
    k_to_end = k * to_end[..., None]
    chunk_decay = whole[..., None]  # [C, H, 1, 1]

    n = len(lengths)
    state = (q.new_zeros(n, h, dk, dv) if initial_state is None else initial_state.to(q.dtype))[plan.by_rank]
    done, start_states, new_values = [], [], []
    first = 0
    for count in plan.steps:
        done.append(state[count:])
        state = state[:count]
        rows = slice(first, first + count)
        first += count
        u = u0[rows] - w[rows] @ state
        start_states.append(state)
        new_values.append(u)
        state = state * chunk_decay[rows] + k_to_end[rows].mT @ u
    done.append(state)
    final = torch.cat(done[::-1])[plan.rank]  # blocks finished later hold lower ranks
    o = q_decayed @ torch.cat(start_states) + attn @ torch.cat(new_values)  # [C, H, CHUNK, Vd]
    return o.movedim(1, 2).reshape(-1, h, dv)[plan.row], final


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> tuple[int, ...]:
    """Shapes, dtypes and finiteness of :func:`chunk_gated_delta_rule`'s inputs; returns the host lengths [N]."""
    check_floating(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    check_shape("q", q, (None, None, None, None), "[B, T, H, Kd]")
    b, t, h, dk = q.shape
    check_shape("k", k, (b, t, h, dk), "[B, T, H, Kd] like q")
    check_shape("v", v, (b, t, h, None), "[B, T, H, Vd] like q")
    check_shape("g", g, (b, t, h), "[B, T, H] like q")
    check_shape("beta", beta, (b, t, h), "[B, T, H] like q")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; cast them")
    devices = {x.device for x in (q, k, v, g, beta, initial_state, cu_seqlens) if x is not None}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if t == 0:
        raise ValueError(f"q has no tokens (shape {tuple(q.shape)}); pass T >= 1")
    if cu_seqlens is None:
        lengths = (t,) * b
    else:
        if cu_seqlens.is_floating_point() or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be an int tensor [N+1] with N >= 1, got shape "
                             f"{tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}")
        if b != 1:
            raise ValueError(f"with cu_seqlens the batch must be one packed row (B == 1), got B = {b}; "
                             f"flatten the rows into one")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != t or any(x > y for x, y in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T = {t} (offsets of the packed sequences), got {cu}")
        lengths = tuple(y - x for x, y in zip(cu, cu[1:]))
    if initial_state is not None:
        check_shape("initial_state", initial_state, (len(lengths), h, dk, v.shape[3]), "[N, H, Kd, Vd]")
    check_finite(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    return lengths

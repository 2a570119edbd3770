"""Trees and per-path references for the linear-attention tests: every slot's result must equal a run
of its root path alone (the path of any leaf below it).

Shape legend: T = slots, H = heads, Kd / Vd = key / value head dims, D = conv channels.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from forests import dfs_layout, random_subtree_end


FLA_OFF = ("fla is off (chunked_delta_rule.FLA_DTYPES is empty: fla 0.6.0 refuses itself on Hopper with triton < 3.7.1, "
           "'incorrect results for gated chunk_bwd_dqkwg', and its first H200 run stopped at an illegal memory access in "
           "its varlen backward); MEGATRON_TREE_FLA_CHECK=1 runs this check")


def handmade_subtree_end() -> torch.Tensor:
    """int32 [T]: a prompt of 70 with two short siblings before a 200-token branch and a strict prefix of
    it (30); a 20-chain with a 2-token branch at every depth; a single node; a 300-chain (several chunks);
    3 padding slots."""
    prompt = list(range(1000, 1070))
    seqs = [prompt + [1, 2, 3], prompt + [4], prompt + list(range(5000, 5200)), prompt[:30]]
    comb = list(range(2000, 2020))
    seqs += [comb[:d] + [9000 + d, 9100 + d] for d in range(20)] + [comb]
    seqs += [[7777], list(range(3000, 3300))]
    end, _ = dfs_layout(seqs, padding=3)
    return end


def tree_cases() -> dict[str, torch.Tensor]:
    """name -> subtree_end int32 [T]: the handmade forest and random DFS forests (segment lengths of all sizes)."""
    return {
        "handmade": handmade_subtree_end(),
        "random-bushy": random_subtree_end(random.Random(1), 150, num_pad=2, p_extend=0.8),
        "random-long": random_subtree_end(random.Random(2), 400, num_pad=1, p_extend=0.97),
        "single-node": torch.tensor([1], dtype=torch.int32),
        "chain-200": torch.tensor([200] * 200, dtype=torch.int32),
    }


def ancestors_or_self(subtree_end: torch.Tensor, i: int) -> np.ndarray:
    """Slots on the root path of slot i, root first, straight from the definition (j <= i < end[j])."""
    end = subtree_end.reshape(-1).numpy()
    return np.flatnonzero((np.arange(end.shape[0]) <= i) & (end > i))


def leaf_paths(subtree_end: torch.Tensor) -> tuple[list[np.ndarray], np.ndarray]:
    """(root path of every leaf, owner [T]: the leaf whose path computes each slot's reference)."""
    end = subtree_end.reshape(-1).numpy()
    leaves = np.flatnonzero(end == np.arange(end.shape[0]) + 1)
    paths = [ancestors_or_self(subtree_end, int(leaf)) for leaf in leaves]
    owner = np.full(end.shape[0], -1)
    for n, path in enumerate(paths):
        free = owner[path] < 0
        owner[path[free]] = n
    assert (owner >= 0).all()
    return paths, owner


def per_path(fn, subtree_end: torch.Tensor, inputs: list[torch.Tensor], weight: torch.Tensor):
    """Run ``fn`` (per-sequence: inputs [L, ...] -> out [L, ...]) along every leaf's root path.

    Returns (out [T, ...] with each slot from its owner's path, loss = sum of out * weight where each slot
    counts once, on its owner's path); gradients of the loss flow into ``inputs`` through every path.
    """
    paths, owner = leaf_paths(subtree_end)
    out = [None] * owner.shape[0]
    loss = 0.0
    for n, path in enumerate(paths):
        idx = torch.from_numpy(path)
        y = fn(*(x[idx] for x in inputs))
        mine = torch.from_numpy(owner[path] == n)
        loss = loss + (y[mine] * weight[idx[mine]].to(y.dtype)).sum()
        for p in np.flatnonzero(owner[path] == n):
            out[path[p]] = y[p]
    return torch.stack(out), loss


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def gdn_inputs(t: int, heads: int = 3, dk: int = 8, dv: int = 12, seed: int = 0, dtype=torch.float32):
    """q, k (unit norm, as Qwen3-Next feeds them) [T, H, Kd], v [T, H, Vd], g (slow decay, some exactly 0)
    and beta [T, H], fp32 leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1)
    v = torch.randn(t, heads, dv, generator=gen)
    g = -0.1 * torch.rand(t, heads, generator=gen) * (torch.rand(t, heads, generator=gen) > 0.1)
    beta = torch.rand(t, heads, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]

"""Trees and per-path references for the linear-attention tests: every slot's result must equal a run
of its root path alone (the path of any leaf below it).

Shape legend: T = slots, H = heads, Kd / Vd = key / value head dims, D = conv channels, K = conv width,
P = slots of all root paths laid end to end.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
import torch.nn.functional as F
from forests import dfs_layout, random_subtree_end

import megatron_tree.linear_attention.chunked_delta_rule as chunk_module
from megatron_tree.linear_attention import TreeScanLayout, packed_scan_layout, tree_causal_conv1d, tree_gated_delta_rule


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


SCAN_GRADS = ("dx", "da", "db", "dconv_w", "dA_log", "ddt_bias")
"""Names of :func:`scan_results`' gradients, in :func:`scan_inputs`' order."""


def scan_inputs(t: int, heads: int, dk: int, dv: int, kernel: int, seed: int = 0, dtype=torch.float64,
                device="cpu") -> list[torch.Tensor]:
    """Leaves of :func:`gdn_scan`, requiring grad: x [T, D] (D = H (2 Kd + Vd)), a, b [T, H] (decay and beta
    pre-activations), conv_w [D, K], A_log, dt_bias [H] (Qwen3-Next's ranges: A in [1, 16], dt_bias 1)."""
    gen = torch.Generator().manual_seed(seed)
    d = heads * (2 * dk + dv)
    x = torch.randn(t, d, generator=gen)
    a, b = torch.randn(t, heads, generator=gen), torch.randn(t, heads, generator=gen)
    conv_w = torch.randn(d, kernel, generator=gen) / kernel ** 0.5
    a_log = torch.empty(heads).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.ones(heads)
    return [z.to(device, dtype).requires_grad_() for z in (x, a, b, conv_w, a_log, dt_bias)]


def gdn_scan(layout: TreeScanLayout, x, a, b, conv_w, a_log, dt_bias, heads: int, dk: int) -> torch.Tensor:
    """Gated DeltaNet's scan as ``TreeGatedDeltaNet`` runs it, without the projections, on ``layout``:
    q, k, v = split(silu(conv(x))) with q, k l2-normed; g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b)
    (:func:`scan_inputs`' shapes) -> o [T, H, Vd] in x's dtype."""
    t = x.shape[0]
    y = F.silu(tree_causal_conv1d(x, conv_w, None, layout))
    q, k, v = y.split([heads * dk, heads * dk, y.shape[1] - 2 * heads * dk], -1)
    q, k = (F.normalize(z.reshape(t, heads, dk), dim=-1) for z in (q, k))
    g = -a_log.exp() * F.softplus(a + dt_bias)
    return tree_gated_delta_rule(q, k, v.reshape(t, heads, -1), g, b.sigmoid(), layout)


def path_layout(subtree_end: torch.Tensor, conv_kernel: int) -> tuple[torch.Tensor, torch.Tensor, TreeScanLayout]:
    """Every leaf's root path alone, the paths laid end to end in one row (THD, no sharing): (slot of each position
    int64 [P], owned bool [P]: the one position per slot whose path computes that slot's reference, the packed
    :class:`TreeScanLayout` of the paths), on the host."""
    paths, owner = leaf_paths(subtree_end)
    cu = torch.tensor([0, *np.cumsum([p.shape[0] for p in paths])])
    owned = np.concatenate([owner[p] == n for n, p in enumerate(paths)])
    index = torch.from_numpy(np.concatenate(paths))
    return index, torch.from_numpy(owned), packed_scan_layout(cu, conv_kernel=conv_kernel)


def scan_results(layout, inputs, weight, heads: int, dk: int, paths=None) -> list[torch.Tensor]:
    """[o [T, H, Vd], then the gradient of each of ``inputs`` (:func:`scan_inputs`)] of the loss sum(o * weight):
    the tree's scan on ``layout``, or with ``paths`` (:func:`path_layout`'s index and owned, ``layout`` its packed
    layout) each root path alone, every slot's output (and loss term) taken from its owning path."""
    if paths is None:
        o = gdn_scan(layout, *inputs, heads=heads, dk=dk)
    else:
        index, owned = paths
        x, a, b = (z[index] for z in inputs[:3])
        o_paths = gdn_scan(layout, x, a, b, *inputs[3:], heads=heads, dk=dk)
        o = o_paths.new_empty((inputs[0].shape[0],) + o_paths.shape[1:])
        o[index[owned]] = o_paths[owned]
    return [o.detach(), *torch.autograd.grad((o * weight.to(o.dtype)).sum(), inputs)]


@contextlib.contextmanager
def decays_in_input_dtype():
    """Inside the block the chunked rule's decay factors (``chunked_delta_rule._chunk_decays``: the in-chunk cumulative
    log decay and its exps) are computed in the input's dtype (``_decays`` alone), as before the library moved them
    to fp64: the fault that shows fp32's cancellation there (a test of the tests, not a mode of the library)."""
    real = chunk_module._chunk_decays
    chunk_module._chunk_decays = chunk_module._decays
    try:
        yield
    finally:
        chunk_module._chunk_decays = real

"""A tree cut into chunks (``megatron_tree.core.chunks``) scanned chunk by chunk: the causal conv and the gated delta
rule of every slot, and every input's gradient, equal those of the whole tree scanned at once, when each chunk
starts the slots hanging from earlier chunks from the conv windows and states those chunks handed out
(``tree_conv_windows``, ``output_states``) and passes them on differentiably. Zeroed carried states are far off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gdn_trees import gdn_inputs, rel_err

from megatron_tree.core.chunks import build_chunks
from megatron_tree.linear_attention import tree_causal_conv1d, tree_conv_windows, tree_gated_delta_rule, tree_scan_layout

D = 5


def branching_sequences() -> list[np.ndarray]:
    """A 20-token prompt with two short siblings laid out before a 90-token branch (more than one 64-token scan
    chunk), a branch off that one deep down, a duplicate, a strict prefix, and a second root's 30-token chain."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 1000, 20).tolist()
    long = prompt + [3] + rng.integers(10, 1000, 90).tolist()
    seqs = [prompt + [1, 7], prompt + [2, 8, 9], long, long[:80] + [4] + rng.integers(10, 1000, 20).tolist(),
            list(long), prompt[:12], rng.integers(10, 1000, 30).tolist()]
    return [np.asarray(s) for s in seqs]


def _scan(x, conv_w, q, k, v, g, beta, layout, windows=None, states=None):
    y = tree_causal_conv1d(x, conv_w, None, layout, windows)
    if not layout.state_exports.size:
        return y, tree_gated_delta_rule(q, k, v, g, beta, layout, initial_states=states), None, None
    o, kept = tree_gated_delta_rule(q, k, v, g, beta, layout, initial_states=states, output_states=True)
    return y, o, tree_conv_windows(x, layout, windows), kept


def _chunked(inputs, seqs, kernel, capacity, zero_carried=False):
    """(conv out [G, D], delta-rule out [G, H, Vd], chunk count) scanning the chunks in order."""
    x, conv_w, q, k, v, g, beta = inputs
    chunks = build_chunks(seqs, list(range(len(seqs))), capacity, 0)
    kept, ys, os_ = [], [], []
    a = 0
    for mb in chunks:
        info, t = mb.chunk, mb.num_tokens
        layout = tree_scan_layout(mb.context_mask, conv_kernel=kernel, context=info.context_len,
                                  state_exports=info.state_exports)
        assert layout.carried_parents.shape[0] == len(info.carried)
        windows = states = None
        if info.carried:
            windows = torch.stack([kept[s][0][row] for s, row in info.carried])
            states = torch.stack([kept[s][1][row] for s, row in info.carried])
            states = torch.zeros_like(states) if zero_carried else states
        own = slice(a, a + t)
        y, o, w, st = _scan(x[own], conv_w, q[own], k[own], v[own], g[own], beta[own], layout, windows, states)
        kept.append((w, st))
        ys.append(y)
        os_.append(o)
        a += t
    return torch.cat(ys), torch.cat(os_), len(chunks)


@pytest.mark.parametrize("kernel,capacity,dtype", [(4, 24, torch.float32), (2, 9, torch.float32),
                                                  (4, 24, torch.float64)])
def test_chunks_equal_the_whole_tree(kernel, capacity, dtype):
    """fp32 within 1e-5; fp64 (carried states and windows in fp64) within 1e-11."""
    seqs = branching_sequences()
    whole = build_chunks(seqs, list(range(len(seqs))), 10_000, 0)[0]
    t = whole.num_tokens
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, D, generator=gen).to(dtype).requires_grad_()
    conv_w = torch.randn(D, kernel, generator=gen).to(dtype).requires_grad_()
    inputs = [x, conv_w, *gdn_inputs(t, seed=2, dtype=dtype)]
    wy, wo = (w.to(dtype) for w in (torch.randn(t, D, generator=gen), torch.randn(t, 3, 12, generator=gen)))

    layout = tree_scan_layout(whole.attention_mask, conv_kernel=kernel)
    y_ref, o_ref, _, _ = _scan(*inputs, layout)
    grads_ref = torch.autograd.grad((y_ref * wy).sum() + (o_ref * wo).sum(), inputs)
    y, o, count = _chunked(inputs, seqs, kernel, capacity)
    grads = torch.autograd.grad((y * wy).sum() + (o * wo).sum(), inputs)
    errors = {"y": rel_err(y, y_ref), "o": rel_err(o, o_ref)}
    errors |= {f"d{n}": rel_err(a, b) for n, a, b in zip("x conv q k v g beta".split(), grads, grads_ref)}
    print(f"K={kernel}, {dtype}, {count} chunks of <= {capacity}: {max(errors.values()):.3g}")
    assert count > 5 and max(errors.values()) < (1e-11 if dtype == torch.float64 else 1e-5), errors
    if kernel == 4 and dtype == torch.float32:
        _, o_zero, _ = _chunked(inputs, seqs, kernel, capacity, zero_carried=True)
        print(f"zeroed carried states: {rel_err(o_zero, o_ref):.3g}")
        assert rel_err(o_zero, o_ref) > 1e-2


def test_bad_carried_inputs_are_refused():
    seqs = branching_sequences()
    mb = build_chunks(seqs, list(range(len(seqs))), 24, 0)[1]
    info = mb.chunk
    layout = tree_scan_layout(mb.context_mask, conv_kernel=4, context=info.context_len,
                              state_exports=info.state_exports)
    t, r = layout.num_slots, layout.num_carried
    q, k, v, g, beta = gdn_inputs(t)
    with pytest.raises(ValueError, match=f"carries {r} states .* initial_states must be \\[R, H, Kd, Vd\\] with R = {r}, got None"):
        tree_gated_delta_rule(q, k, v, g, beta, layout)
    with pytest.raises(ValueError, match=f"carried_windows must be \\[R, K-1, D\\] with R = {r}, got None"):
        tree_causal_conv1d(torch.zeros(t, D), torch.zeros(D, 4), None, layout)
    with pytest.raises(ValueError, match="context slots must be a root path"):
        tree_scan_layout(torch.tensor([1, 3, 3]), conv_kernel=4, context=2)
    with pytest.raises(ValueError, match="state_exports must be ascending own slots"):
        tree_scan_layout(mb.context_mask, conv_kernel=4, context=info.context_len, state_exports=(t,))

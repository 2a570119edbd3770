"""Hypothesis strategies, a brute-force trie and random DFS forests (``subtree_end``) for tests of the tree data model."""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import strategies as st

VOCAB = 7  # small vocab: many accidental shared prefixes and duplicates


@st.composite
def grpo_batches(draw, max_prompts=4, max_samples=6, max_prompt=12, max_response=10):
    """Prompts x samples: each sample = its prompt + a response (responses may be empty,
    repeat each other, or share their start)."""
    seqs = []
    for _ in range(draw(st.integers(1, max_prompts))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_prompt))
        for _ in range(draw(st.integers(1, max_samples))):
            seqs.append(prompt + draw(st.lists(st.integers(0, VOCAB - 1), max_size=max_response)))
    return seqs


@st.composite
def multi_turn_batches(draw, max_convs=3, max_turns=5, max_turn_len=6):
    """Conversations where each turn's sequence extends the previous one, with forks
    (a turn may restart from an earlier turn)."""
    seqs = []
    for _ in range(draw(st.integers(1, max_convs))):
        history = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_turn_len))]
        for _ in range(draw(st.integers(1, max_turns))):
            base = history[draw(st.integers(0, len(history) - 1))]
            nxt = base + draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_turn_len))
            history.append(nxt)
        seqs.extend(history)
    return seqs


random_batches = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), min_size=1, max_size=12)
any_batch = st.one_of(grpo_batches(), multi_turn_batches(), random_batches)


def brute_force_trie(seqs):
    """Reference layout: dict trie, DFS pre-order with children by token. Returns
    (tokens, depth, ancestors-or-self dense bool [T, T] (query, key), path slots per sequence)."""
    root = {}
    for s in seqs:
        node = root
        for tok in s:
            node = node.setdefault(tok, {})
    tokens, depth, parent, slot_of = [], [], [], {}

    def visit(node, d, par, key):
        for tok in sorted(node):
            slot = len(tokens)
            tokens.append(tok)
            depth.append(d)
            parent.append(par)
            slot_of[key + (tok,)] = slot
            visit(node[tok], d + 1, slot, key + (tok,))

    visit(root, 0, -1, ())
    t = len(tokens)
    anc = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    paths = [[slot_of[tuple(s[: d + 1])] for d in range(len(s))] for s in seqs]
    return np.array(tokens), np.array(depth), anc, paths

def random_subtree_end(rng: random.Random, num_tokens: int, num_pad: int = 0, p_extend: float = 0.85) -> torch.Tensor:
    """int32 [num_tokens + num_pad]: a random DFS-ordered forest, then padding slots (end = j + 1).

    Each new slot's parent lies on the path from a root to the previous slot (DFS pre-order):
    with probability ``p_extend`` it extends the current chain, otherwise it closes a random
    number of open nodes first (closing all of them starts a new root).
    """
    end = [0] * num_tokens
    path: list[int] = []
    for i in range(num_tokens):
        if path and rng.random() > p_extend:
            for _ in range(rng.randint(1, len(path))):
                end[path.pop()] = i
        path.append(i)
    for j in path:
        end[j] = num_tokens
    end += [num_tokens + k + 1 for k in range(num_pad)]
    return torch.tensor(end, dtype=torch.int32)

def dfs_layout(seqs: list[list[int]], padding: int = 0) -> tuple[torch.Tensor, list[list[int]]]:
    """Trie of ``seqs`` in DFS pre-order: subtree_end int32 [T] and each sequence's slot path."""
    root: dict = {}
    for s in seqs:
        node = root
        for tok in s:
            node = node.setdefault(tok, {})
    ends: list[int] = []
    slot_of: dict[int, int] = {}

    def visit(children: dict) -> None:
        for child in children.values():
            slot = len(ends)
            slot_of[id(child)] = slot
            ends.append(-1)
            visit(child)
            ends[slot] = len(ends)

    visit(root)
    paths = []
    for s in seqs:
        node, path = root, []
        for tok in s:
            node = node[tok]
            path.append(slot_of[id(node)])
        paths.append(path)
    ends += [len(ends) + i + 1 for i in range(padding)]
    return torch.tensor(ends, dtype=torch.int32), paths


def pad_end(end: torch.Tensor, length: int) -> torch.Tensor:
    """Append padding slots (end = j + 1) up to ``length``."""
    t = end.shape[0]
    return torch.cat([end, torch.arange(t + 1, length + 1, dtype=end.dtype)])

"""Synthetic rollout batches shaped like RL post-training data (for demos and benchmarks).

Each function returns a list of 1-D int64 numpy token sequences; token ids are drawn
uniformly from ``[0, vocab)``, so sequences share exactly the prefixes built in.
"""

from __future__ import annotations

import numpy as np


def grpo_batch(
    rng: np.random.Generator,
    *,
    n_prompts: int,
    samples: int | tuple[int, int],
    prompt_len: tuple[int, int],
    response_len: tuple[int, int],
    vocab: int,
) -> list[np.ndarray]:
    """GRPO: ``n_prompts`` prompts, each sampled ``samples`` times (an int, or a [lo, hi] range);
    sequence = prompt + its own response. Lengths uniform in the inclusive ranges given."""
    out = []
    for _ in range(n_prompts):
        prompt = rng.integers(0, vocab, rng.integers(prompt_len[0], prompt_len[1] + 1))
        n = samples if isinstance(samples, int) else int(rng.integers(samples[0], samples[1] + 1))
        for _ in range(n):
            response = rng.integers(0, vocab, rng.integers(response_len[0], response_len[1] + 1))
            out.append(np.concatenate([prompt, response]))
    return out


def multi_turn_batch(
    rng: np.random.Generator,
    *,
    n_conversations: int,
    turns: tuple[int, int],
    turn_len: tuple[int, int],
    fork_prob: float,
    system_len: int,
    vocab: int,
) -> list[np.ndarray]:
    """Agent trajectories (tau-bench-like): each conversation starts with a system prompt;
    every turn appends a message to the previous turn's context and is one training
    sequence. With probability ``fork_prob`` a turn instead branches from a random
    earlier turn (a retry / alternative tool call)."""
    out = []
    for _ in range(n_conversations):
        history = [rng.integers(0, vocab, system_len)]
        for _ in range(int(rng.integers(turns[0], turns[1] + 1))):
            base = history[int(rng.integers(0, len(history)))] if rng.random() < fork_prob else history[-1]
            msg = rng.integers(0, vocab, rng.integers(turn_len[0], turn_len[1] + 1))
            history.append(np.concatenate([base, msg]))
        out.extend(history[1:])
    return out


def no_sharing_batch(rng: np.random.Generator, *, n: int, length: tuple[int, int], vocab: int) -> list[np.ndarray]:
    """``n`` independent sequences (distinct first tokens, so nothing is shared)."""
    if n > vocab:
        raise ValueError(f"no_sharing_batch needs n <= vocab to give distinct first tokens, got n={n}, vocab={vocab}")
    firsts = rng.permutation(vocab)[:n]
    return [
        np.concatenate([[f], rng.integers(0, vocab, int(rng.integers(length[0], length[1] + 1)) - 1)]).astype(np.int64)
        for f in firsts
    ]

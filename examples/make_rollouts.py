"""Write a small GRPO-shaped rollout file (JSONL or Parquet) in the launcher's schema.

    python examples/make_rollouts.py --out /tmp/rollouts.jsonl
    python examples/make_rollouts.py --out /tmp/rollouts.parquet --prompts 16
    python examples/train_tree.py --config configs/tiny_qwen3.yaml --data-path /tmp/rollouts.jsonl --loss grpo

``--prompts`` prompts, each sampled ``--samples`` times: one row per sample with ``input_ids``
(prompt + response, ids in ``[0, vocab)``), ``loss_mask`` (1 on the response), ``group``
(the prompt) and ``reward`` (the share of response tokens below ``vocab / 2``); GRPO
advantages are left to the launcher. The schema is in the README ("Rollout data").
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def make_rollouts(*, prompts: int = 8, samples: int = 4, vocab: int = 160, prompt_len: tuple[int, int] = (16, 48),
                  response_len: tuple[int, int] = (4, 24), seed: int = 0) -> list[dict]:
    """The rows (JSON-able dicts), prompt by prompt."""
    rng = np.random.default_rng(seed)
    rows = []
    for group in range(prompts):
        prompt = rng.integers(0, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1)))
        for _ in range(samples):
            response = rng.integers(0, vocab, int(rng.integers(response_len[0], response_len[1] + 1)))
            rows.append({
                "input_ids": np.concatenate([prompt, response]).tolist(),
                "loss_mask": [0] * len(prompt) + [1] * len(response),
                "group": group,
                "reward": float((response < vocab // 2).mean()),
            })
    return rows


def write_rollouts(rows: list[dict], path: str, *, rows_per_group: int = 16) -> None:
    """``rows`` to ``path``: ``.jsonl`` one object per line, ``.parquet`` (pyarrow) in row groups
    of ``rows_per_group`` rows."""
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    elif path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=rows_per_group)
    else:
        raise ValueError(f"--out {path!r} must end in .jsonl or .parquet")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output file, .jsonl or .parquet")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (groups)")
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--vocab", type=int, default=160, help="token ids in [0, vocab) (the tiny configs' vocabulary)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = make_rollouts(prompts=args.prompts, samples=args.samples, vocab=args.vocab, seed=args.seed)
    write_rollouts(rows, args.out)
    print(f"wrote {len(rows)} rollouts ({args.prompts} groups of {args.samples}) to {args.out}")


if __name__ == "__main__":
    main()

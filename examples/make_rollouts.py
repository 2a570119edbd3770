"""Write a small GRPO-shaped rollout file (JSONL or Parquet) in the launcher's schema.

    python examples/make_rollouts.py --out /tmp/rollouts.jsonl
    python examples/make_rollouts.py --out /tmp/rollouts.parquet --prompts 16
    python examples/train_tree.py --config configs/tiny_qwen3.yaml --data-path /tmp/rollouts.jsonl --loss grpo
    python examples/make_rollouts.py --out /tmp/vl_rollouts.jsonl --images   # configs/tiny_qwen2_5_vl.yaml, tiny_glm4v.yaml

``--prompts`` prompts, each sampled ``--samples`` times: one row per sample with ``input_ids``
(prompt + response, ids in ``[0, vocab)``), ``loss_mask`` (1 on the response), ``group``
(the prompt) and ``reward`` (the share of response tokens below ``vocab / 2``); GRPO
advantages are left to the launcher. The schema is in the README ("Rollout data").

``--images``: every prompt starts with an image of random pixels (the tiny Qwen2.5-VL's and GLM-4V's: a 4 x 4 grid
of patches of 3 x 2 x 4 x 4 values, 4 placeholder tokens between its vision start and end tokens), saved as ``.npz``
beside the output file (``<out>.images/``) and named in each row's ``images``; text ids stay below the special tokens.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from megatron_tree.runtime.tiny_models import QWEN2_5_VL_TOKENS

IMAGE_GRID, IMAGE_PATCH = (1, 4, 4), 3 * 2 * 4 * 4  # the tiny Qwen2.5-VL's vision tower: merge 2 x 2 -> 4 tokens


def make_rollouts(*, prompts: int = 8, samples: int = 4, vocab: int = 160, prompt_len: tuple[int, int] = (16, 48),
                  response_len: tuple[int, int] = (4, 24), seed: int = 0, image_dir: str | None = None) -> list[dict]:
    """The rows (JSON-able dicts), prompt by prompt; ``image_dir``: every prompt starts with an image saved there
    (module docstring), text ids then below the image placeholder token."""
    rng = np.random.default_rng(seed)
    top = QWEN2_5_VL_TOKENS["image_token_id"] if image_dir else vocab
    rows = []
    for group in range(prompts):
        prompt = rng.integers(0, top, int(rng.integers(prompt_len[0], prompt_len[1] + 1)))
        images = {}
        if image_dir:
            path = os.path.join(image_dir, f"prompt{group}.npz")
            np.savez(path, pixel_values=rng.standard_normal((int(np.prod(IMAGE_GRID)), IMAGE_PATCH), np.float32),
                     grid_thw=np.asarray(IMAGE_GRID))
            tokens = QWEN2_5_VL_TOKENS
            block = [tokens["vision_start_token_id"], *[tokens["image_token_id"]] * 4, tokens["vision_end_token_id"]]
            prompt = np.concatenate([block, prompt])
            images = {"images": [os.path.relpath(path, os.path.dirname(image_dir))]}
        for _ in range(samples):
            response = rng.integers(0, top, int(rng.integers(response_len[0], response_len[1] + 1)))
            rows.append({
                "input_ids": np.concatenate([prompt, response]).tolist(),
                "loss_mask": [0] * len(prompt) + [1] * len(response),
                "group": group,
                "reward": float((response < vocab // 2).mean()),
                **images,
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
    ap.add_argument("--images", action="store_true", help="image prompts for the tiny Qwen2.5-VL / GLM-4V (docstring)")
    args = ap.parse_args()
    image_dir = None
    if args.images:
        image_dir = f"{args.out}.images"
        os.makedirs(image_dir, exist_ok=True)
    rows = make_rollouts(prompts=args.prompts, samples=args.samples, vocab=args.vocab, seed=args.seed,
                         image_dir=image_dir)
    write_rollouts(rows, args.out)
    print(f"wrote {len(rows)} rollouts ({args.prompts} groups of {args.samples}) to {args.out}")


if __name__ == "__main__":
    main()

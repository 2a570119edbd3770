"""attention_bench.tile_ceiling: 1 on a causal chain; below 1 by exactly the masked share of the visited tiles."""

import sys

import torch
from dist_utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from attention_bench import block_stats, tile_ceiling  # noqa: E402


def _ceiling(end: torch.Tensor, block: int) -> float:
    t = end.numel()
    pairs = int((end - torch.arange(t)).sum())  # key k is seen by queries k .. end[k] - 1
    stats = block_stats(end, block)
    return tile_ceiling(pairs, stats["partial_blocks"] + stats["full_blocks"], t, block)


def test_a_causal_chain_is_at_the_ceiling():
    for t in (128, 512, 1024):  # the bench runs multiples of the tile (32k, 128k slots)
        assert abs(_ceiling(torch.full((t,), t), 128) - 1.0) < 1e-12


def test_two_documents_cut_inside_a_tile():
    # Two sequences of 192 slots (256-slot tiles of 128: the boundary at 192 cuts tile 1 in half).
    end = torch.tensor([192] * 192 + [384] * 192)
    pairs = 2 * 192 * 193 // 2
    # visited tiles: (0,0), (1,0) partial (rows 128-191 see cols 0-127), (1,1), (2,1) (rows 256-383 see cols 192-255),
    # (2,2): 5 tiles of 128 x 128; causal on 384 slots: 6 tiles for 384 * 385 / 2 pairs
    causal = 384 * 385 / 2 / (6 * 128 * 128)
    expected = pairs / (5 * 128 * 128) / causal
    assert abs(_ceiling(end, 128) - expected) < 1e-12 and expected < 1

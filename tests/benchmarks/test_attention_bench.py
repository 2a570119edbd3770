"""attention_bench.tile_ceiling: 1 on a causal chain; below 1 by exactly the masked share of the visited tiles, square
or rectangular (counted against a brute force).
tile_layouts.relayout: the layouts it counts are the same forest; tile_layouts.root_paths: its node and tile counts;
cudnn_flex_kernel_profile and cudnn_flex_call_host: their refusal where the kernels cannot run;
cudnn_flex_kernel_profile's phases of a call, on the kernel names an H100 profile gave."""

import importlib
import random
import sys

import pytest
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


def test_rectangular_tiles_count_as_a_brute_force_does():
    """``visited_tiles`` / ``tile_ceiling`` at (query slots, keys) tiles, as the cuDNN flex kernels run them (64 x
    128): a tile is visited when one of its pairs is visible, counted here pair by pair on random forests and ragged
    lengths; the causal chain stays at 1."""
    from attention_bench import visited_tiles
    from forests import random_subtree_end
    from megatron_tree.core.masks import dense_tree_mask, tree_parents

    rng = random.Random(0)
    for n, tile in ((300, (64, 128)), (257, (8, 16)), (200, (16, 8)), (96, (32, 32))):
        end = random_subtree_end(rng, n, p_extend=0.7).long()
        assert (tree_parents(end) < torch.arange(n)).all()
        bq, bk = tile
        m = -(-n // (bq * bk)) * bq * bk  # padding slots after n, each seeing itself
        mask = dense_tree_mask(torch.cat([end, torch.arange(n + 1, m + 1)]))
        tiles = mask.reshape(m // bq, bq, m // bk, bk).transpose(1, 2).flatten(2)
        tiles = tiles[: -(-n // bq), : -(-n // bk)]  # the tiles holding a query slot and a key slot
        visited, partial = tiles.any(-1), tiles.any(-1) & ~tiles.all(-1)
        assert visited_tiles(end, tile) == (int(partial.sum()), int(visited.sum())), (n, tile)
        chain = torch.full((n,), n)
        assert abs(tile_ceiling(n * (n + 1) // 2, visited_tiles(chain, tile)[1], n, tile) - 1) < 1e-12


def test_tile_layouts_relayout():
    """``tile_layouts.relayout``: as packed it gives back the packer's own layout; aligned, every tree starts on a
    tile boundary behind self-attending padding; largest first, every node's children run by subtree size, largest
    first; every layout is the same forest (tree sizes kept, useful pairs kept apart from the padding's own)."""
    import numpy as np
    from megatron_tree import MicroBatchSpec, pack_trees
    from megatron_tree.core.masks import tree_parents
    from megatron_tree.core.synthetic import grpo_batch
    from tile_layouts import relayout

    seqs = grpo_batch(np.random.default_rng(3), n_prompts=3, samples=(2, 5), prompt_len=(40, 300),
                      response_len=(5, 200), vocab=50)
    mb = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=4096))[0]
    end = mb.attention_mask[0, : mb.num_tokens].numpy().astype(np.int64)
    assert np.array_equal(relayout(end, False, False), end)

    def trees(e):  # (start, size) of every tree, padding's one-slot trees apart
        parent = tree_parents(torch.as_tensor(e)).numpy()
        roots = np.flatnonzero(parent < 0)
        return [(int(r), int(e[r] - r)) for r in roots if e[r] - r > 1]

    packed = trees(end)
    assert len(packed) == 3 and any(start % 128 for start, _ in packed[1:])
    pairs = int((end - np.arange(len(end))).sum())
    for largest_first in (False, True):
        for aligned in (False, True):
            new = relayout(end, largest_first, aligned)
            got = trees(new)
            assert sorted(size for _, size in got) == sorted(size for _, size in packed)
            assert int((new - np.arange(len(new))).sum()) - (len(new) - len(end)) == pairs
            if aligned:
                assert all(start % 128 == 0 for start, _ in got)
            if largest_first:
                assert [size for _, size in got] == sorted((size for _, size in packed), reverse=True)
                parent = tree_parents(torch.as_tensor(new)).numpy()
                size = new - np.arange(len(new))
                for p in np.unique(parent[parent >= 0]):
                    kids = size[np.flatnonzero(parent == p)]  # in slot order
                    assert np.all(np.diff(kids) <= 0)


def test_segment_tile_ceiling_counts_each_tree_from_its_own_tile():
    """One chain is one segment: the ceiling of the packed layout. The bench's 32k GRPO micro-batch (two trees and the
    padding), tiled per tree: 0.930 against 0.913 packed (docs/results.md). Tiling per tree is not always better: each
    segment's ragged last tile is a tile of its own."""
    from attention_bench import SLOTS, fullest_micro_batch, segment_tile_ceiling, workloads
    from megatron_tree.attention.cudnn_flex import tree_segments
    from megatron_tree.core.flops import micro_batch_work

    one = torch.full((512,), 512, dtype=torch.int32)
    assert segment_tile_ceiling(one, tree_segments(one), 512 * 513 // 2) == _ceiling(one, 128)
    mb = fullest_micro_batch(workloads(0)["grpo"], SLOTS)
    end = mb.attention_mask[0].to(torch.int32)
    cu = tree_segments(end)
    assert len(cu) == 4 and cu[-2] == mb.num_tokens  # two trees, then the padding
    pairs = micro_batch_work(mb)[1]
    assert (round(_ceiling(end, 128), 3), round(segment_tile_ceiling(end, cu, pairs), 3)) == (0.913, 0.930)
    # at the kernels' own tiles (64 query slots x 128 keys) fewer masked pairs are computed
    assert round(segment_tile_ceiling(end, cu, pairs, (64, 128)), 3) == 0.944


def test_token_major_is_megatrons_layout():
    """The bench feeds cuDNN flex Megatron's layout: the same values, and the backend's THD view ([b, s, h, d] -> [s, h,
    d]) contiguous, as in training (head-major tensors give a strided view the kernels run slower on)."""
    from attention_bench import token_major

    x = torch.randn(1, 4, 10, 8, requires_grad=True)
    y = token_major(x)
    assert torch.equal(x, y) and not y.requires_grad and y.transpose(1, 2)[0].is_contiguous()
    assert not x.transpose(1, 2)[0].is_contiguous()


def test_tile_layouts_root_paths_counts_each_node_as_a_bottom_right_causal_sequence(monkeypatch):
    """``tile_layouts.root_paths`` on a prompt with three samples and a second tree: five nodes (the first sample
    continues the prompt), seven keys copied (the prompt's 3 before each later sample, the second root before its
    later child); with 4-slot tiles its visited tiles match a brute-force count of the copied layout's masks."""
    import numpy as np
    import tile_layouts
    from tile_layouts import root_paths

    end = np.array([9, 9, 9, 5, 5, 7, 7, 9, 9, 12, 11, 12])
    pairs = int((end - np.arange(len(end))).sum())
    row = root_paths(end, pairs)
    assert (row["nodes"], row["copied_keys"]) == (5, 7)
    # (own rows, ancestors) per node -> visited 4 x 4 tiles of each bottom-right causal [rows, ancestors + rows] mask
    nodes = [(5, 0), (2, 3), (2, 3), (2, 0), (1, 1)]
    visited = 0
    for rows, ancestors in nodes:
        seen = np.arange(ancestors + rows)[None] <= np.arange(rows)[:, None] + ancestors
        visited += len({(i // 4, j // 4) for i, j in zip(*np.nonzero(seen))})
    monkeypatch.setattr(tile_layouts, "TILE", 4)
    assert root_paths(end, pairs)["ceiling"] == tile_ceiling(pairs, visited, 12, 4)


@pytest.mark.parametrize("script", ["cudnn_flex_kernel_profile", "cudnn_flex_call_host"])
def test_cudnn_flex_benches_say_why_they_cannot_run(script, monkeypatch, tmp_path):
    """The cudnn_flex benches where its kernels cannot run (no GPU, no frontend): each exits with the backend's reason
    and writes nothing."""
    bench = importlib.import_module(script)
    monkeypatch.setattr(bench.cudnn_flex, "cudnn_flex_unavailable_reason", lambda: "no kernels here")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="no kernels here"):
        bench.main()
    assert not (tmp_path / "out").exists()


# Kernel names (as the profiler gives them, shortened) and microseconds of one GRPO call on an H100
# (benchmarks/results/te/cudnn_flex_profile_h100.txt)
_TREE = [("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunc<float>>", 40.7),
         ("kernel_cutlass_kernel_cudnnflex_attentionkernelscommonbackward_preprocess", 189.9),
         ("kernel_cutlass_kernel_cudnnflex_attentionkernelssm90bwdbackwardFlexAttentionBackward", 3406.2),
         ("kernel_cutlass_kernel_cudnnflex_attentionkernelscommonbackward_postprocess", 135.8),
         ("kernel_cutlass_kernel_cudnnflex_attentionkernelssm90fwdforwardFlexAttentionForward", 1213.6)]
_CAUSAL = [("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128", 6651.7),
           ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)", 178.7),
           ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x128x128", 18703.9),
           ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)", 138.6)]


def test_the_profile_splits_a_call_into_its_phases():
    """Each kernel lands in its phase; the attention kernels' efficiency is the pair ratio times causal's time over
    the tree's, the slot passes' share is of each call's own total."""
    bench = importlib.import_module("cudnn_flex_kernel_profile")
    assert [bench.phase(n) for n, _ in _TREE] == ["slot passes", "slot passes", "backward kernel", "slot passes",
                                                   "forward"]
    assert [bench.phase(n) for n, _ in _CAUSAL] == ["forward", "slot passes", "backward kernel", "slot passes"]
    lines = bench.phase_lines("grpo", _TREE, _CAUSAL, 0.16)
    assert lines[0] == "grpo phase forward: tree 1214 us, causal cuDNN 6652 us, per useful pair " \
        f"{0.16 * 6651.7 / 1213.6:.3f}"
    assert lines[1].endswith(f"per useful pair {0.16 * 18703.9 / 3406.2:.3f}")
    slot_share = (40.7 + 189.9 + 135.8) / sum(us for _, us in _TREE)
    assert lines[2] == (f"grpo phase slot passes: tree 366 us, causal cuDNN 317 us, {slot_share:.1%} of the tree "
                        f"call, {317.3 / sum(us for _, us in _CAUSAL):.1%} of causal's")

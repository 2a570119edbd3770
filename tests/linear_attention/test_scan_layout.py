"""tree_scan_layout: parents, conv ancestors, segments and levels against their definitions (brute force from
``subtree_end``) on the docstring example, hand-made and random forests; the validity check is exact on every
vector of up to 6 slots; ``.to`` moves every tensor; bad input is refused with the reason."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from forests import random_subtree_end
from gdn_trees import ancestors_or_self, tree_cases

from megatron_tree.linear_attention import TreeScanLayout, packed_scan_layout, tree_scan_layout

CASES = tree_cases() | {f"random-{s}": random_subtree_end(random.Random(s), 60, num_pad=s % 3, p_extend=0.7)
                        for s in range(10, 16)}


def test_docstring_example():
    layout = tree_scan_layout(torch.tensor([[5, 5, 3, 5, 5, 6, 7]], dtype=torch.int32), conv_kernel=3)
    assert layout.parent.tolist() == [-1, 0, 1, 1, 3, -1, -1]
    assert layout.conv_ancestors.T.tolist() == [[7, 7, 0, 0, 1, 7, 7], [7, 0, 1, 1, 3, 7, 7]]
    assert layout.segment_start.tolist() == [0, 2, 3, 5, 6]
    assert layout.segment_parent.tolist() == [-1, 0, 0, -1, -1]
    assert layout.segment_level.tolist() == [0, 1, 1, 0, 0]
    assert layout.level_lengths == ((2, 1, 1), (1, 2))
    assert [s.tolist() for s in layout.level_slots] == [[0, 1, 5, 6], [2, 3, 4]]
    assert [c.tolist() for c in layout.level_cu_seqlens] == [[0, 2, 3, 4], [0, 1, 3]]
    assert [p.tolist() for p in layout.level_parent] == [[], [0, 0]]
    assert layout.num_levels == 2 and layout.num_slots == 7 and layout.conv_kernel == 3


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_the_definitions(name):
    end = CASES[name]
    t = end.shape[0]
    layout = tree_scan_layout(end, conv_kernel=4)
    paths = [ancestors_or_self(end, i) for i in range(t)]
    parent = [int(p[-2]) if len(p) > 1 else -1 for p in paths]
    assert layout.parent.tolist() == parent
    for i, path in enumerate(paths):  # the 3 nearest ancestors, farthest first, T where the path is shorter
        expect = [t] * 3 + path[:-1].tolist()
        assert layout.conv_ancestors[i].tolist() == expect[-3:], i
    children = np.bincount([p for p in parent if p >= 0], minlength=t)
    seg = np.repeat(np.arange(len(layout.segment_start)), layout.segment_len)
    assert layout.segment_len.sum() == t and (layout.segment_len > 0).all()
    for i in range(1, t):  # a segment continues exactly through only children
        assert (seg[i] == seg[i - 1]) == (parent[i] == i - 1 and children[i - 1] == 1), i
    for s, start in enumerate(layout.segment_start):
        p = parent[start]
        assert layout.segment_parent[s] == (seg[p] if p >= 0 else -1)
        assert layout.segment_level[s] == (layout.segment_level[seg[p]] + 1 if p >= 0 else 0)
    assert sorted(torch.cat(layout.level_slots).tolist()) == list(range(t))
    assert (torch.cat(layout.level_slots)[layout.scan_position] == torch.arange(t)).all()
    for level in range(1, layout.num_levels):  # each segment's parent, by its index in the level above
        above = np.flatnonzero(layout.segment_level == level - 1)
        here = np.flatnonzero(layout.segment_level == level)
        assert above[layout.level_parent[level].numpy()].tolist() == layout.segment_parent[here].tolist()


def test_padding_slots_are_root_segments():
    end = tree_cases()["handmade"]
    layout = tree_scan_layout(end, conv_kernel=4)
    pad = range(end.shape[0] - 3, end.shape[0])
    assert all(layout.parent[j] == -1 and (layout.conv_ancestors[j] == end.shape[0]).all() for j in pad)
    assert set(pad) <= set(layout.segment_start[layout.segment_level == 0].tolist())


def test_the_validity_check_is_exact_on_small_vectors():
    """Every vector with j < end[j] <= T, T <= 6: accepted iff no two subtrees cross."""
    for t in range(1, 7):
        for end in itertools.product(*(range(j + 1, t + 1) for j in range(t))):
            nested = not any(i < end[j] < end[i] for j in range(t) for i in range(j + 1, t))
            try:
                tree_scan_layout(torch.tensor(end), conv_kernel=2)
                accepted = True
            except ValueError as e:
                assert "crosses an enclosing subtree" in str(e)
                accepted = False
            assert accepted == nested, end


def test_to_moves_every_tensor():
    layout = tree_scan_layout(tree_cases()["handmade"], conv_kernel=4)
    moved = layout.to("meta")
    assert isinstance(moved, TreeScanLayout) and moved.device.type == "meta"
    for name, value in vars(moved).items():
        for x in value if isinstance(value, tuple) else (value,):
            if isinstance(x, torch.Tensor):
                assert x.device.type == "meta", name
    assert moved.level_lengths == layout.level_lengths


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"subtree_end\[1\] = 1 is outside \(1, 3\]"):
        tree_scan_layout(torch.tensor([3, 1, 3]), conv_kernel=4)
    with pytest.raises(ValueError, match="crosses an enclosing subtree"):
        tree_scan_layout(torch.tensor([2, 3, 3]), conv_kernel=4)
    with pytest.raises(ValueError, match="must hold integers"):
        tree_scan_layout(torch.tensor([1.0]), conv_kernel=4)
    with pytest.raises(ValueError, match=r"\[T\] or \[1, T\] with T >= 1"):
        tree_scan_layout(torch.zeros(2, 2, dtype=torch.int32), conv_kernel=4)
    with pytest.raises(ValueError, match="conv_kernel must be an int >= 1"):
        tree_scan_layout(torch.tensor([1]), conv_kernel=0)


def test_packed_sequences_are_one_level_of_chains():
    """``packed_scan_layout``: sequences 3, 0 (empty), 1, 4 tokens packed in one row, each a root chain."""
    layout = packed_scan_layout(torch.tensor([0, 3, 3, 4, 8], dtype=torch.int32), conv_kernel=3)
    assert layout.parent.tolist() == [-1, 0, 1, -1, -1, 4, 5, 6]
    assert layout.conv_ancestors.T.tolist() == [[8, 8, 0, 8, 8, 8, 4, 5], [8, 0, 1, 8, 8, 4, 5, 6]]
    assert layout.level_lengths == ((3, 1, 4),) and layout.num_slots == 8
    with pytest.raises(ValueError, match="must rise from 0 to T >= 1"):
        packed_scan_layout(torch.tensor([0, 5, 3]), conv_kernel=3)
    with pytest.raises(ValueError, match=r"int tensor \[N\+1\]"):
        packed_scan_layout(torch.tensor([0.0, 3.0]), conv_kernel=3)

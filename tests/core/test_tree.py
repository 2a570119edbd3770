"""Tree data model: layout, depths and the interval encoding against a brute-force trie."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from forests import any_batch, brute_force_trie
from megatron_tree import build_forest
from megatron_tree.core.masks import dense_tree_mask
from megatron_tree.core.tree import as_sequences


@settings(max_examples=150, deadline=None)
@given(any_batch)
def test_forest_matches_brute_force_trie(seqs):
    forest = build_forest(as_sequences(seqs))
    tokens, depth, anc, paths = brute_force_trie(seqs)
    np.testing.assert_array_equal(forest.tokens, tokens)
    np.testing.assert_array_equal(forest.depth, depth)
    mask = dense_tree_mask(torch.from_numpy(forest.subtree_end)).numpy()
    np.testing.assert_array_equal(mask, anc)
    got = forest.path_slots(range(len(seqs)))
    np.testing.assert_array_equal(got, np.concatenate(paths))
    # every node is a chain whose tokens share one subtree end
    for s, ln in zip(forest.node_start, forest.node_len):
        assert len(set(forest.subtree_end[s : s + ln].tolist())) == 1
    assert forest.num_original_tokens == sum(map(len, seqs))


def test_docstring_example():
    f = build_forest(as_sequences([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3]]))
    assert f.tokens.tolist() == [1, 2, 3, 4, 5]
    assert f.depth.tolist() == [0, 1, 2, 2, 3]
    assert f.subtree_end.tolist() == [5, 5, 3, 5, 5]
    assert f.node_len.tolist() == [2, 1, 2]
    assert f.node_parent.tolist() == [-1, 0, 0]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_input_equals_list_input(side):
    seqs = [[3, 1, 4, 1, 5], [3, 1, 4], [2, 7]]
    width = 6
    ids = torch.full((3, width), 99)
    mask = torch.zeros(3, width, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[b, sl] = torch.tensor(s)
        mask[b, sl] = 1
    got = as_sequences(ids, mask)
    assert [g.tolist() for g in got] == seqs


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        as_sequences([[1, 2], []])
    with pytest.raises(ValueError, match="same shape"):
        as_sequences(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="row 0 is not left or right padding"):
        as_sequences(torch.zeros(1, 4, dtype=torch.long), torch.tensor([[1, 0, 1, 0]]))
    with pytest.raises(ValueError, match="row 0 is not left or right padding"):
        as_sequences(torch.zeros(1, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 0]]))
    with pytest.raises(ValueError, match="needs its attention_mask"):
        as_sequences(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="negative token id"):
        as_sequences([[1, -2]])
    with pytest.raises(ValueError, match="integer token ids"):
        as_sequences([[1.5, 2.0]])
    with pytest.raises(ValueError, match="no sequences"):
        as_sequences([])

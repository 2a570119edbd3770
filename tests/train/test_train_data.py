"""Rollout files (JSONL, Parquet): schema checks naming file/row/field, grouping into steps,
GRPO advantages, position save/restore, streaming. No Megatron."""

import json

import numpy as np
import pytest

from examples.make_rollouts import make_rollouts, write_rollouts
from megatron_tree.train.data import FileSource, SyntheticSource, file_fingerprint, grpo_advantages
from megatron_tree.train.config import DataConfig

VOCAB = 160


def source(path, batch_size=3, *, grpo=True, kl=False, max_len=256):
    return FileSource(str(path), batch_size=batch_size, vocab=VOCAB, max_len=max_len, need_advantages=grpo,
                      need_ref_logprobs=kl)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module", params=["jsonl", "parquet"])
def sample(request, tmp_path_factory):
    """The sample file of examples/make_rollouts.py: 7 groups of 4 rows, Parquet in row groups of 5."""
    rows = make_rollouts(prompts=7, samples=4, vocab=VOCAB)
    path = str(tmp_path_factory.mktemp("rollouts") / f"sample.{request.param}")
    write_rollouts(rows, path, rows_per_group=5)
    return path, rows


def test_steps_take_whole_groups_and_wrap_at_the_end_of_the_file(sample):
    path, rows = sample
    src = source(path, batch_size=3)
    sizes = [len(src.next_batch().sequences) for _ in range(4)]
    assert sizes == [12, 12, 4, 12]  # 3 + 3 + the last 1 of 7 groups, then epoch 2
    assert src.state()["epoch"] == 1
    first = source(path).next_batch()
    np.testing.assert_array_equal(first.sequences[5], rows[5]["input_ids"])
    np.testing.assert_array_equal(first.loss_mask[5], np.array(rows[5]["loss_mask"], bool))
    assert first.old_logprobs is None and first.ref_logprobs is None


def test_restored_position_continues_with_the_same_batches(sample):
    path, _ = sample
    src = source(path, batch_size=2)
    src.next_batch()
    state = json.loads(json.dumps(src.state()))  # what a checkpoint stores
    expected = [src.next_batch() for _ in range(4)]  # crosses the end of the file
    resumed = source(path, batch_size=2)
    resumed.restore(state)
    for want, got in zip(expected, [resumed.next_batch() for _ in range(4)]):
        assert len(want.sequences) == len(got.sequences)
        for a, b in zip(want.sequences, got.sequences):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(want.advantages, got.advantages)


def test_grpo_advantages_per_group():
    rewards = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 7.0])
    groups = np.array(["a", "a", "a", "b", "b", "c"])
    adv = grpo_advantages(rewards, groups)
    a = rewards[:3]
    np.testing.assert_allclose(adv[:3], (a - a.mean()) / (a.std(ddof=1) + 1e-6))
    np.testing.assert_array_equal(adv[3:], [0.0, 0.0, 0.0])  # equal rewards; a group of one


def test_given_advantages_win_and_rows_without_group_are_their_own_group(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [
        {"input_ids": [1, 2, 3], "group": 0, "reward": 1.0},
        {"input_ids": [1, 2, 4], "group": 0, "reward": 0.0},
        {"input_ids": [5, 6], "advantage": 0.25},
        {"input_ids": [7, 8], "advantage": -1.5, "extra": "ignored"},
    ])
    batch = source(path, batch_size=3).next_batch()
    assert len(batch.sequences) == 4
    np.testing.assert_allclose(batch.advantages, [0.7071063, -0.7071063, 0.25, -1.5], rtol=1e-6)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"tokens": [1, 2]}, "line 2: field 'input_ids' is missing"),
        ({"input_ids": [1.5, 2]}, "line 2: field 'input_ids' must be a non-empty list of ints"),
        ({"input_ids": 7}, "line 2: field 'input_ids' must be a non-empty list of ints, got 7"),
        ({"input_ids": []}, "field 'input_ids' must be a non-empty list of ints"),
        ({"input_ids": [1, 160]}, "line 2: token id 160 in 'input_ids' is outside the model's vocabulary [0, 160)"),
        ({"input_ids": [-1, 2]}, "token id -1 in 'input_ids' is outside"),
        ({"input_ids": list(range(20))}, "line 2: 20 tokens, more than max_tokens_per_mb=16"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "line 2: field 'loss_mask' has 1 entries but input_ids has 2"),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "field 'loss_mask' must be a non-empty list of 0/1 values"),
        ({"input_ids": [1, 2], "old_logprobs": ["a", "b"]}, "field 'old_logprobs' must be a non-empty list of finite"),
        ({"input_ids": [1, 2], "ref_logprobs": [0.0, float("nan")]}, "field 'ref_logprobs' must be a non-empty list"),
        ({"input_ids": [1, 2, 3], "old_logprobs": [0.0, -0.5, 0.25]}, "line 2: field 'old_logprobs' entry 2 is 0.25 > "
                                                                   "0, not a log-probability (log p <= 0)"),
        ({"input_ids": [1, 2], "ref_logprobs": [0.0, 1.0]}, "line 2: field 'ref_logprobs' entry 1 is 1.0 > 0"),
        ({"input_ids": [1, 2], "reward": "high"}, "line 2: field 'reward' must be a finite number, got 'high'"),
        ({"input_ids": [1, 2], "advantages": 1.0}, "line 2: field 'advantages' is not a rollout field; did you mean "
                                                   "'advantage'?"),
        ({"input_ids": [1, 2], "group": [1]}, "field 'group' must be an int or a string"),
        ({"input_ids": [1, 2]}, "line 2: loss grpo needs 'advantage' or 'reward'"),
    ],
)
def test_bad_rows_are_named(tmp_path, row, message):
    path = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": [1, 2, 3], "reward": 1.0}, row])
    with pytest.raises(ValueError) as e:
        source(path, batch_size=2, max_len=16).next_batch()
    assert message in str(e.value) and "r.jsonl" in str(e.value)


def test_file_level_mistakes(tmp_path):
    bad_json = tmp_path / "a.jsonl"
    bad_json.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1,\n')
    with pytest.raises(ValueError, match=r"a.jsonl line 2: not valid JSON"):
        source(bad_json, grpo=False).next_batch()
    split = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [1], "group": g, "advantage": 0.0} for g in "aba"])
    with pytest.raises(ValueError, match=r"b.jsonl line 3: group 'a' appeared earlier in this batch"):
        source(split).next_batch()
    no_ref = write_jsonl(tmp_path / "c.jsonl", [{"input_ids": [1, 2], "advantage": 1.0}])
    with pytest.raises(ValueError, match=r"c.jsonl line 1: train.kl_coef > 0 needs 'ref_logprobs'"):
        source(no_ref, kl=True).next_batch()
    empty = tmp_path / "d.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"d.jsonl: no rollouts in the file"):
        source(empty).next_batch()


def test_parquet_schema_is_checked(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"ids": [[1, 2]]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a.parquet: no 'input_ids' column"):
        source(tmp_path / "a.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2], [3, 4.5]]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet row 1: field 'input_ids' must be a non-empty list of ints"):
        source(tmp_path / "b.parquet", grpo=False).next_batch()


def test_damaged_files_are_one_line_naming_them(tmp_path):
    """Bytes that are not UTF-8 in a JSONL line, a file that is not Parquet, damaged Parquet pages: pyarrow's and
    json's own errors say neither the file nor the row."""
    binary = tmp_path / "a.jsonl"
    binary.write_bytes(b'{"input_ids": [1, 2]}\n\x87\xd3\x00\x01\n')
    with pytest.raises(ValueError, match=r"a.jsonl line 2: not JSON text \(it holds byte 0x87, not UTF-8\)"):
        source(binary, batch_size=2, grpo=False).next_batch()
    (tmp_path / "b.parquet").write_bytes(b"\x87 not parquet" * 20)
    with pytest.raises(ValueError, match=r"b.parquet: not a readable Parquet file \(Parquet magic bytes not found"):
        source(tmp_path / "b.parquet")
    write_rollouts(make_rollouts(prompts=2, vocab=VOCAB), str(tmp_path / "c.parquet"))
    data = bytearray((tmp_path / "c.parquet").read_bytes())
    data[100:400] = bytes(300)  # inside the first column's pages
    (tmp_path / "c.parquet").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"c.parquet: damaged Parquet data, reading from row 1 \("):
        source(tmp_path / "c.parquet", batch_size=1).next_batch()


def test_rows_are_read_as_a_stream(tmp_path):
    """A step reads only as far as it needs: a broken line far down the file is met only when reached."""
    path = tmp_path / "big.jsonl"
    rows = [{"input_ids": [i % VOCAB, 1, 2], "advantage": 0.0} for i in range(5000)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    src = source(path, batch_size=2)
    assert len(src.next_batch().sequences) == 2
    assert src.state() == {"epoch": 0, "row": 2, "offset": len(("".join(json.dumps(r) + "\n" for r in rows[:2]))),
                           "path": str(path), "fingerprint": file_fingerprint(str(path))}


def test_synthetic_source_is_seeded_per_step():
    data = DataConfig(same_batch_every_step=False, batch_size=2, samples=3)
    a, b = SyntheticSource(data, vocab=VOCAB, seed=0, need_advantages=True), None
    first, second = a.next_batch(), a.next_batch()
    b = SyntheticSource(data, vocab=VOCAB, seed=0, need_advantages=True)
    b.restore({"step": 1})
    again = b.next_batch()
    assert all(np.array_equal(x, y) for x, y in zip(second.sequences, again.sequences))
    assert not all(np.array_equal(x, y) for x, y in zip(first.sequences, second.sequences))
    assert len(first.sequences) == 6 and abs(first.advantages[:3].sum()) < 1e-9  # zero mean per prompt group


def test_a_row_that_trains_nothing_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0], "advantage": 1.0}])
    with pytest.raises(ValueError, match=r"r.jsonl line 1: field .loss_mask. marks no token after the first"):
        source(path).next_batch()


def test_a_batch_larger_than_the_file_is_refused(tmp_path):
    """README: the file is read again from the top when it ends; a batch of more groups than the file holds would
    be the whole file every step, short of its size."""
    rows = [{"input_ids": [1, 2, 3], "group": g, "advantage": 0.5} for g in (0, 0, 1, 1)]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    assert len(source(path, batch_size=2).next_batch().sequences) == 4
    with pytest.raises(ValueError, match=r"--batch-size\) 3 is more groups than .*r.jsonl holds \(2\).*--batch-size 2"):
        source(path, batch_size=3).next_batch()


def test_images_inline_or_npz_paths(tmp_path):
    """``images``: inline pixel arrays or ``.npz`` paths relative to the rollout file; each row's list in order."""
    pixels = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    np.savez(tmp_path / "img.npz", pixel_values=pixels, grid_thw=np.array([1, 4, 4]))
    inline = {"pixel_values": pixels.tolist(), "grid_thw": [1, 4, 4]}
    for suffix, first in (("jsonl", "img.npz"), ("parquet", inline)):  # a Parquet column holds one type
        rows = [{"input_ids": [1, 2], "advantage": 1.0, "images": [first, inline]},
                {"input_ids": [1, 3], "advantage": 1.0}]
        path = str(tmp_path / f"v.{suffix}")
        write_rollouts(rows, path)
        batch = source(path, batch_size=2).next_batch()
        assert [len(images) for images in batch.images] == [2, 0]
        for image in batch.images[0]:
            assert image.grid_thw == (1, 4, 4) and np.array_equal(image.pixel_values.numpy(), pixels)
    text = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2], "advantage": 1.0}])
    assert source(text, batch_size=1).next_batch().images is None


@pytest.mark.parametrize("images, message", [
    ("img.npz", "field 'images' must be a list"),
    (["img.png"], "image 0 'img.png' is not a .npz file; image files are not decoded here"),
    (["missing.npz"], "image 0: cannot read pixel_values and grid_thw from"),
    ([{"pixel_values": [[0.0]]}], "image 0 is {'pixel_values': [[0.0]]}; field 'images' holds each"),
    ([{"pixel_values": [[0.0]] * 15, "grid_thw": [1, 4, 4]}], "image 0: ImageInput.pixel_values must be a "
                                                               "[t * h * w, C] tensor (16 patches for grid (1, 4, 4))"),
])
def test_bad_images_are_named(tmp_path, images, message):
    path = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": [1, 2], "advantage": 1.0, "images": images}])
    with pytest.raises(ValueError) as e:
        source(path, batch_size=1).next_batch()
    assert message in str(e.value) and "r.jsonl line 1" in str(e.value)

"""Vision-language packing (``pack_vision_trees``): image identity in the trie, per-slot (t, h, w) positions equal to
Hugging Face's ``get_rope_index`` (Qwen2.5-VL's and GLM-4V's, the same rule for images) for every sequence through
the slot, and what is refused."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_tree import ImageInput, MicroBatchSpec, pack_vision_trees

IMG, START, END = 150, 152, 153


def _image(seed: int, grid: tuple[int, int, int]) -> ImageInput:
    gen = torch.Generator().manual_seed(seed)
    return ImageInput(torch.randn(int(np.prod(grid)), 8, generator=gen), grid)


def _block(img: ImageInput) -> list[int]:
    return [START] + [IMG] * img.num_tokens(2) + [END]


def _hf_positions(seq: list[int], images: list[ImageInput], arch: str) -> torch.Tensor:
    """Hugging Face's ``get_rope_index`` (Qwen2.5-VL's or GLM-4V's) for one sequence: ``[3, L]``."""
    import transformers
    from transformers.models.glm4v.modeling_glm4v import Glm4vModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config, model = {"qwen2_5_vl": ("Qwen2_5_VLConfig", Qwen2_5_VLModel), "glm4v": ("Glm4vConfig", Glm4vModel)}[arch]
    fake = SimpleNamespace(config=getattr(transformers, config)(), get_vision_position_ids=functools.partial(
        model.get_vision_position_ids, None))
    ids = torch.tensor(seq)[None]
    grids = torch.tensor([img.grid_thw for img in images]) if images else None
    return model.get_rope_index(fake, ids, (ids == IMG).int(), image_grid_thw=grids)[0][:, 0]


@pytest.fixture(scope="module")
def batch():
    a, b, wide, video_like = _image(0, (1, 4, 4)), _image(1, (1, 4, 4)), _image(2, (1, 2, 6)), _image(3, (2, 4, 2))
    pa, pb = _block(a) + [5, 6], _block(b) + [5, 6]
    seqs = [pa + [1, 7], pa + [2, 8, 9, 10], pb + [1, 7], pb + [2], [4] + _block(wide) + [5] + _block(a) + [6, 7],
            [4] + _block(video_like) + [9], [4, 5, 6]]
    images = [[a], [a], [b], [b], [wide, a], [video_like], []]
    return seqs, images, pack_vision_trees(seqs, images, MicroBatchSpec(max_tokens_per_mb=200), image_token_id=IMG)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "glm4v"])
def test_slot_positions_are_each_sequences_hf_positions(batch, arch):
    seqs, images, mbs = batch
    (mb,) = mbs
    end = mb.attention_mask[0]
    for k, (sid, last) in enumerate(zip(mb.sequence_ids, mb.last_slots.tolist())):
        path = torch.nonzero((torch.arange(mb.num_slots) <= last) & (end > last))[:, 0]
        torch.testing.assert_close(mb.input_ids[0, path], torch.tensor(seqs[sid]))
        torch.testing.assert_close(mb.mrope_position_ids[:, 0, path], _hf_positions(seqs[sid], images[sid], arch))


def _unique_prefixes(seqs, images=None) -> int:
    """Unique prefixes of the sequences, a placeholder told apart by its image's pixels (``images``) or not."""
    keys = []
    for k, seq in enumerate(seqs):
        own = iter(images[k]) if images else iter(())
        key, left = [], 0
        for tok in seq:
            if tok == IMG and images:
                if not left:
                    img, left, row = next(own), None, 0
                    left = img.num_tokens(2)
                key.append((img.key(), row))
                row, left = row + 1, left - 1
            else:
                key.append(tok)
        keys.append(key)
    return len({tuple(key[:i]) for key in keys for i in range(1, len(key) + 1)})


def test_equal_images_share_slots_and_different_ones_do_not(batch):
    seqs, images, mbs = batch
    (mb,) = mbs
    assert mb.num_tokens == _unique_prefixes(seqs, images) > _unique_prefixes(seqs)
    assert mb.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4], [1, 2, 6], [2, 4, 2]]  # unique, first-seen order
    assert mb.pixel_values.shape == (16 + 16 + 12 + 16, 8)
    assert mb.image_slots.numel() == 4 + 4 + 3 + 4 + 4  # a twice (under two prefixes), b, wide, video_like
    assert sorted(set(mb.image_rows.tolist())) == list(range(4 + 4 + 3 + 4))
    assert (mb.input_ids[0, mb.image_slots] == IMG).all()
    padded = mb.padded_to(mb.num_slots + 3)
    assert padded.mrope_position_ids.shape == (3, 1, mb.num_slots + 3) and padded.input_ids.shape[1] == mb.num_slots + 3
    assert padded.model_inputs().keys() == {"mrope_position_ids", "pixel_values", "image_grid_thw", "image_slots",
                                            "image_rows"}
    # a's and b's prompts hold the same ids: with a in both, they share every prompt slot
    same = pack_vision_trees(seqs[:4], [images[0]] * 4, MicroBatchSpec(max_tokens_per_mb=200), image_token_id=IMG)
    assert same[0].num_tokens == _unique_prefixes(seqs[:4]) < _unique_prefixes(seqs[:4], images[:4])


@pytest.mark.parametrize("case, match", [
    ("count", r"placeholder runs \(token 150\) hold \[4\] tokens, but its 1 image\(s\) need \[6\]"),
    ("lists", "got 2 sequences but 1 image lists"),
    ("chunks", "chunked trees with images are not supported"),
    ("too_long", r"sequence 0 has 9 tokens \(image placeholders included\), more than max_tokens_per_mb=8; chunked "
                 r"trees with images are not supported: raise max_tokens_per_mb \(--max-tokens-per-mb\) to at least 9"),
    ("grid", "must be a \\[t \\* h \\* w, C\\] tensor"),
    ("video", r"sequence 1 holds video placeholder tokens \(151\): video inputs are not supported"),
])
def test_refuses_bad_input(case, match):
    a = _image(0, (1, 4, 4))
    with pytest.raises(ValueError, match=match):
        if case == "count":
            pack_vision_trees([_block(a) + [1]], [[_image(1, (1, 4, 6))]], MicroBatchSpec(max_tokens_per_mb=64),
                              image_token_id=IMG)
        elif case == "lists":
            pack_vision_trees([[1, 2], [1, 3]], [[]], MicroBatchSpec(max_tokens_per_mb=64), image_token_id=IMG)
        elif case == "video":
            pack_vision_trees([[1, 2], [1, 151, 151]], [[], []], MicroBatchSpec(max_tokens_per_mb=64),
                              image_token_id=IMG, video_token_id=151)
        elif case in ("chunks", "too_long"):
            pack_vision_trees([_block(a) + list(range(20))] if case == "chunks" else [_block(a) + [1, 2, 3]], [[a]],
                              MicroBatchSpec(max_tokens_per_mb=8, chunk_trees=case == "chunks"), image_token_id=IMG)
        else:
            ImageInput(torch.zeros(15, 8), (1, 4, 4))

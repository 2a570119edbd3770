"""Pack vision-language prompts into tree micro-batches (no Megatron import): Qwen2.5-VL's and GLM-4V's images.

Legend: n = sequences, T = slots, I = unique images of a micro-batch, P = their patches, K = image slots,
m = the vision tower's spatial merge size. An image of grid ``(t, h, w)`` (patches) becomes ``t * h * w / m²``
placeholder tokens (``image_token_id``) in its sequence, one per merged patch, in the order the vision tower
returns them.

Sharing. The samples of one image prompt hold the same placeholders, so their image tokens are one path of the
trie. Two different images of one grid hold the same placeholder ids, so the trie is built on *keys*: a
placeholder's key is ``base + row``, its image's row among all unique images of the batch (images are identified
by a hash of their pixels and grid), ``base`` above every token id. Equal keys mean the same image and the same
merged patch; the micro-batches get the real ids back (``input_ids``, ``logprob_labels``).

Positions (Hugging Face's ``get_rope_index`` of Qwen2-VL / Qwen2.5-VL / GLM-4V, per sequence, the same for images):
text tokens have ``(p, p, p)``, ``p`` one more than the previous token's largest; an image starting at ``p`` has
``(p + i_t, p + i_h, p + i_w)`` for its merged patch ``(i_t, i_h, i_w)``, and the text after it continues from
``p + max(h, w) / m``. A token's position depends only on the tokens before it, so every sequence through a slot
gives it the same position: :attr:`VisionMicroBatch.mrope_position_ids` holds it, per slot.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from megatron_tree.core.microbatch import TreeMicroBatch
from megatron_tree.core.microbatch_spec import MicroBatchSpec
from megatron_tree.core.packing import pack_trees
from megatron_tree.core.tree import as_sequences

__all__ = ["ImageInput", "VisionMicroBatch", "mrope_positions", "pack_vision_trees"]


@dataclass(frozen=True)
class ImageInput:
    """One image as the vision tower takes it (the model's Hugging Face image processor output for one image).

    pixel_values  FloatTensor [t * h * w, C]  its patches (C = channels x temporal patch x patch²).
    grid_thw      (t, h, w)                   its grid in patches.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]

    def __post_init__(self) -> None:
        grid = tuple(int(g) for g in self.grid_thw)
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"ImageInput.grid_thw must be three positive ints (t, h, w), got {self.grid_thw!r}")
        object.__setattr__(self, "grid_thw", grid)
        pv = self.pixel_values
        if not isinstance(pv, torch.Tensor) or pv.dim() != 2 or pv.shape[0] != np.prod(grid):
            shape = tuple(pv.shape) if isinstance(pv, torch.Tensor) else type(pv).__name__
            raise ValueError(
                f"ImageInput.pixel_values must be a [t * h * w, C] tensor ({int(np.prod(grid))} patches for grid "
                f"{grid}), got {shape}; pass one image's pixel_values from the model's image processor"
            )

    def num_tokens(self, merge: int) -> int:
        """Placeholder tokens of this image in a sequence: ``t * h * w / merge²``."""
        t, h, w = self.grid_thw
        if h % merge or w % merge:
            raise ValueError(f"image grid {self.grid_thw} is not divisible by the spatial merge size {merge}")
        return t * (h // merge) * (w // merge)

    def key(self) -> bytes:
        """Identity: a hash of the grid and the pixels (equal images share their tree slots)."""
        pv = self.pixel_values.detach().to("cpu", torch.float32).contiguous()
        return hashlib.sha1(np.asarray(self.grid_thw, np.int64).tobytes() + pv.numpy().tobytes()).digest()


@dataclass(frozen=True, kw_only=True)
class VisionMicroBatch(TreeMicroBatch):
    """A :class:`TreeMicroBatch` of vision-language sequences; ``position_ids`` stay the depths.

    Extra device tensors:
      mrope_position_ids LongTensor  [3, 1, T] (t, h, w) RoPE position of each slot (module docstring; 0 for
                                               padding). Feed it to the model's mRoPE.
      pixel_values       FloatTensor [P, C]    the patches of the micro-batch's I unique images, concatenated.
      image_grid_thw     LongTensor  [I, 3]    their grids.
      image_slots        LongTensor  [K]       every image slot.
      image_rows         LongTensor  [K]       the vision tower's output row (merged patch, over the I images
                                               in order) that each image slot takes; an image laid out under
                                               two different prefixes has two slots per row.

    :meth:`model_inputs` is what the model's forward takes besides ``(input_ids, position_ids, attention_mask)``.
    """

    mrope_position_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_slots: torch.Tensor
    image_rows: torch.Tensor

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The images and the mRoPE positions, as the model's forward takes them (keywords)."""
        return dict(mrope_position_ids=self.mrope_position_ids, pixel_values=self.pixel_values,
                    image_grid_thw=self.image_grid_thw, image_slots=self.image_slots, image_rows=self.image_rows)

    def padded_to(self, length: int, pad_token_id: int = 0) -> "VisionMicroBatch":
        padded = super().padded_to(length, pad_token_id)
        extra = length - self.mrope_position_ids.shape[-1]
        if extra <= 0:
            return padded
        pad = self.mrope_position_ids.new_zeros((3, 1, extra))
        return dataclasses.replace(padded, mrope_position_ids=torch.cat([self.mrope_position_ids, pad], -1))


def _image_runs(tokens: np.ndarray, image_token_id: int, counts: list[int], seq: int) -> list[int]:
    """Start of each image's placeholder run in ``tokens``; each maximal run must hold exactly one image's tokens."""
    is_img = np.concatenate([[False], tokens == image_token_id, [False]])
    edges = np.flatnonzero(is_img[1:] != is_img[:-1])
    starts, ends = edges[0::2], edges[1::2]
    lens = (ends - starts).tolist()
    if lens != counts:
        raise ValueError(
            f"sequence {seq}: its image placeholder runs (token {image_token_id}) hold {lens} tokens, but its "
            f"{len(counts)} image(s) need {counts} (t * h * w / merge² each, in order, one run per image, runs "
            f"separated by other tokens such as <|vision_start|>); pass each sequence's images in prompt order"
        )
    return starts.tolist()


def mrope_positions(tokens: np.ndarray, starts: Sequence[int], grids: Sequence[tuple[int, int, int]],
                    merge: int) -> np.ndarray:
    """int64 ``[3, L]``: the (t, h, w) RoPE positions of one sequence (module docstring) whose images (grids in
    patches) start at ``starts``."""
    out = np.empty((3, tokens.shape[0]), np.int64)
    cur = prev = 0
    for start, (t, h, w) in zip(starts, grids):
        out[:, prev:start] = cur + np.arange(start - prev)
        cur += start - prev
        gh, gw = h // merge, w // merge
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")).reshape(3, -1)
        prev = start + grid.shape[1]
        out[:, start:prev] = cur + grid
        cur += max(gh, gw)
    out[:, prev:] = cur + np.arange(tokens.shape[0] - prev)
    return out


def pack_vision_trees(
    sequences: Sequence,
    images: Sequence[Sequence[ImageInput]],
    spec: MicroBatchSpec,
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
    video_token_id: int | None = None,
    dp_group: "torch.distributed.ProcessGroup | None" = None,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
) -> list[VisionMicroBatch]:
    """Pack vision-language sequences into tree micro-batches (:func:`~megatron_tree.core.packing.pack_trees`'s rules).

    sequences        n 1-D int token sequences, each with one run of ``image_token_id`` per image.
    images           n lists: sequence i's images (:class:`ImageInput`) in prompt order (an empty list: text).
    image_token_id   the placeholder token (HF config ``image_token_id``); ``spatial_merge_size``: the vision
                     config's.
    video_token_id   the video placeholder (HF config ``video_token_id``): a sequence holding it is refused (videos
                     are not supported).

    Equal images (pixels and grid) under equal prefixes share their slots; the vision tower runs once per unique
    image of a micro-batch. Trees larger than a micro-batch in chunks (``spec.chunk_trees``) are refused.
    """
    seqs = as_sequences(sequences)
    if len(images) != len(seqs):
        raise ValueError(f"got {len(seqs)} sequences but {len(images)} image lists; pass one list per sequence "
                         f"(an empty one for a text-only sequence)")
    merge = int(spatial_merge_size)
    base = max(int(max(s.max() for s in seqs)), image_token_id) + 1
    unique: dict[bytes, int] = {}
    pictures: list[ImageInput] = []
    first_row = [0]  # row of each unique image's first merged patch, over all unique images
    keys, starts, grids, owners = [], [], [], []
    for i, (tokens, own) in enumerate(zip(seqs, images)):
        if video_token_id is not None and (tokens == video_token_id).any():
            raise ValueError(f"sequence {i} holds video placeholder tokens ({video_token_id}): video inputs are not "
                             f"supported on trees yet; pass images (or drop the video rollouts)")
        counts = [img.num_tokens(merge) for img in own]
        run_starts = _image_runs(tokens, image_token_id, counts, i)
        key = tokens.copy()
        ids = []
        for img, start, count in zip(own, run_starts, counts):
            u = unique.setdefault(img.key(), len(pictures))
            if u == len(pictures):
                pictures.append(img)
                first_row.append(first_row[-1] + count)
            key[start:start + count] = base + first_row[u] + np.arange(count)
            ids.append(u)
        keys.append(key)
        starts.append(run_starts)
        grids.append([img.grid_thw for img in own])
        owners.append(ids)
    longest = max(range(len(keys)), key=lambda i: len(keys[i]), default=None)
    if longest is not None and len(keys[longest]) > spec.max_tokens_per_mb:
        raise ValueError(
            f"sequence {longest} has {len(keys[longest])} tokens (image placeholders included), more than "
            f"max_tokens_per_mb={spec.max_tokens_per_mb}; chunked trees with images are not supported: raise "
            f"max_tokens_per_mb (--max-tokens-per-mb) to at least {len(keys[longest])}, or truncate them"
        )
    mbs = pack_trees(keys, spec, dp_group=dp_group, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id)
    chunked = [k for k, mb in enumerate(mbs) if mb.chunk is not None]
    if chunked:
        raise ValueError(
            f"{len(chunked)} micro-batch(es) are chunks of a tree larger than max_tokens_per_mb="
            f"{spec.max_tokens_per_mb}: chunked trees with images are not supported; raise max_tokens_per_mb to "
            f"hold every prompt group whole, or pack with MicroBatchSpec(chunk_trees=False)"
        )
    image_of_row = np.repeat(np.arange(len(pictures)), np.diff(first_row))
    return [_vision_micro_batch(mb, seqs, starts, grids, owners, pictures, image_of_row, np.asarray(first_row),
                                base, image_token_id, merge) for mb in mbs]


def _vision_micro_batch(mb, seqs, starts, grids, owners, pictures, image_of_row, first_row, base, image_token_id,
                        merge) -> VisionMicroBatch:
    ids = mb.input_ids[0].numpy()
    is_img = ids >= base
    is_img[mb.num_tokens:] = False
    slots = np.flatnonzero(is_img)
    rows = ids[slots] - base
    used = sorted({u for i in mb.sequence_ids for u in owners[i]})
    counts = np.diff(first_row)[used] if used else np.zeros(0, np.int64)
    local_first = np.zeros(len(pictures), np.int64)
    local_first[used] = np.cumsum(counts) - counts
    owner = image_of_row[rows]
    local_rows = local_first[owner] + rows - first_row[owner]
    # Per slot (t, h, w) positions: each held sequence's positions along its root path.
    end = mb.attention_mask[0].numpy().astype(np.int64)
    positions = np.zeros((3, mb.num_slots), np.int64)
    slot_index = np.arange(mb.num_slots)
    for i, last in zip(mb.sequence_ids, mb.last_slots.tolist()):
        path = np.flatnonzero((slot_index <= last) & (end > last))
        positions[:, path] = mrope_positions(seqs[i], starts[i], grids[i], merge)
    dim = pictures[used[0]].pixel_values.shape[1] if used else 0
    pixel_values = (torch.cat([pictures[u].pixel_values.detach().to("cpu", torch.float32) for u in used])
                    if used else torch.zeros(0, dim))
    labels = mb.logprob_labels.numpy()
    fields = {f.name: getattr(mb, f.name) for f in dataclasses.fields(TreeMicroBatch)}
    return VisionMicroBatch(
        **fields | {"input_ids": torch.from_numpy(np.where(is_img, image_token_id, ids))[None],
                    "logprob_labels": torch.from_numpy(np.where(labels >= base, image_token_id, labels))},
        mrope_position_ids=torch.from_numpy(positions)[:, None],
        pixel_values=pixel_values,
        image_grid_thw=torch.tensor([pictures[u].grid_thw for u in used], dtype=torch.int64).reshape(-1, 3),
        image_slots=torch.from_numpy(slots),
        image_rows=torch.from_numpy(local_rows),
    )

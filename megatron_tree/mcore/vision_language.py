"""A vision-language model on tree micro-batches: a megatron-core ``GPTModel`` with mRoPE and a vision tower.

Shape legend: S = slots, b = batch (1), h = hidden size, P = patches of the micro-batch's unique images, K = image
slots. :class:`VisionLanguageModel` is the language model (a ``GPTModel`` built with
``position_embedding_type="mrope"``) with a vision tower (``visual``, Hugging Face's vision transformer of the
checkpoint: Qwen2.5-VL's, GLM-4V's) that embeds images into the first stage's input:

1. the vision tower runs once over the micro-batch's unique images (``pixel_values [P, C]``,
   ``image_grid_thw [I, 3]``), giving one row per merged patch;
2. the word embeddings ``[S, b, h]`` of the slots take those rows at the image slots (``image_slots [K]`` from
   ``image_rows [K]``: an image under two prefixes fills two slots from one row);
3. the language model runs with the tree mask and the slots' (t, h, w) positions ``mrope_position_ids
   [3, b, S]`` (:class:`~megatron_tree.core.vision_packing.VisionMicroBatch`), which megatron-core's multimodal
   RoPE reads per token.

Interleaved heads (``config.rotary_interleaved``: channel pairs ``(2i, 2i + 1)`` rotate by frequency ``i``, GLM-4V)
take their (t, h, w) angles from :class:`InterleavedMultimodalRotaryEmbedding` (megatron-core 0.16's multimodal RoPE
lays its sections out for split halves only).

The gradient of every image slot flows back into the one vision-tower pass, so the tower's gradient is the sum over
the sequences that hold the image, as in each sequence alone.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel

__all__ = ["InterleavedMultimodalRotaryEmbedding", "VisionLanguageModel", "add_vision_tower"]


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """megatron-core's ``MultimodalRotaryEmbedding`` for interleaved heads: frequency ``i`` (of the ``F`` rotated
    ones, ``inv_freq [F]``) takes its angle from the t, h or w position by ``mrope_section`` (its first ``s_t``
    frequencies from t, the next ``s_h`` from h, the rest from w) and rotates channels ``2i`` and ``2i + 1``
    (Hugging Face's GLM-4V)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int],
                cp_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
        """``position_ids [3, b, S]`` -> angles ``[S, b, 1, 2F]`` (each frequency's angle twice, side by side)."""
        freqs = self.inv_freq
        if len(mrope_section) != 3 or sum(mrope_section) != freqs.numel():
            raise ValueError(f"mrope_section={list(mrope_section)} must be three ints summing to the {freqs.numel()} "
                             f"rotated frequencies per head")
        positions = position_ids.to(freqs.device, torch.float32)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = positions[..., None] * freqs  # [3, b, S, F]
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section)).to(freqs.device, non_blocking=True)
        picked = angles.gather(0, axis.expand(1, *angles.shape[1:]))[0]  # [b, S, F]
        return picked.repeat_interleave(2, -1).transpose(0, 1)[:, :, None].contiguous()


class VisionLanguageModel(GPTModel):
    """``GPTModel`` (mRoPE) with a vision tower ``visual`` on the first pipeline stage (module docstring).
    Made from a built ``GPTModel`` by :func:`add_vision_tower`; megatron_tree's vision-language bridges do it."""

    visual: torch.nn.Module | None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                decoder_input: torch.Tensor | None = None, *, mrope_position_ids: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                image_slots: torch.Tensor | None = None, image_rows: torch.Tensor | None = None, **kwargs: Any):
        """``GPTModel.forward`` with images: the keywords of ``VisionMicroBatch.model_inputs()``. Positions are
        ``mrope_position_ids [3, b, S]``; without images, ``position_ids [b, S]`` (depths) may stand for them: a
        text token's (t, h, w) position is ``(d, d, d)`` (plain tree micro-batches, ``verify_tree_model``)."""
        images = pixel_values is not None and pixel_values.shape[0] > 0
        positions = mrope_position_ids
        if positions is None and position_ids is not None and position_ids.dim() == 2 and not images:
            positions = position_ids[None].expand(3, -1, -1)
        if positions is None or positions.dim() != 3 or positions.shape[0] != 3:
            got = None if positions is None else tuple(positions.shape)
            raise ValueError(
                f"a vision-language model with images rotates by (t, h, w) positions [3, b, S] (mrope_position_ids), "
                f"got {got}; pack with megatron_tree.pack_vision_trees and call model(mb.input_ids, mb.position_ids, "
                f"mb.attention_mask, **mb.model_inputs())"
            )
        if decoder_input is None and self.pre_process:
            if images:
                decoder_input = self.embed_with_images(input_ids, pixel_values, image_grid_thw, image_slots, image_rows)
            elif torch.is_grad_enabled() and self.visual is not None:
                decoder_input = self.embed_without_images(input_ids)
        return super().forward(input_ids, positions, attention_mask, decoder_input=decoder_input, **kwargs)

    def embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                          image_slots: torch.Tensor, image_rows: torch.Tensor) -> torch.Tensor:
        """``[S, b, h]``: the word embeddings of ``input_ids [b, S]`` with the vision tower's rows at the image
        slots (batch row 0; tree micro-batches are one row)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        weight = next(self.visual.parameters())
        rows = self.visual(pixel_values.to(weight.dtype), grid_thw=image_grid_thw).pooler_output
        batch = torch.zeros_like(image_slots)
        return embeddings.index_put((image_slots, batch), rows[image_rows].to(embeddings.dtype))


    def embed_without_images(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[S, b, h]``: the word embeddings plus 0 x one entry of every vision-tower parameter, so that each one
        takes part in every training forward (megatron-core's DDP with overlapped gradient reduction waits for a
        gradient of every parameter in the last micro-batch: a step or rank without images would stall it)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        return embeddings + 0 * sum(p.reshape(-1)[0] for p in self.visual.parameters()).to(embeddings.dtype)


def add_vision_tower(model: GPTModel, visual: torch.nn.Module | None) -> VisionLanguageModel:
    """Make the built ``model`` (``position_embedding_type="mrope"``, no sequence or context parallel) a
    :class:`VisionLanguageModel` in place with the vision tower ``visual`` (None on pipeline stages without the
    embedding); returns it. Interleaved heads rotate by :class:`InterleavedMultimodalRotaryEmbedding`."""
    config = model.config
    if model.position_embedding_type != "mrope":
        raise ValueError(f"a vision-language model needs position_embedding_type='mrope', got "
                         f"{model.position_embedding_type!r}")
    unsupported = {"sequence_parallel": config.sequence_parallel, "context_parallel_size": config.context_parallel_size,
                   "pipeline_model_parallel_size": config.pipeline_model_parallel_size}
    refused = {k: v for k, v in unsupported.items() if v not in (False, 1)}
    if refused:
        raise ValueError(f"vision-language tree models do not support {refused} yet; build with tensor or data "
                         f"parallel only (sequence_parallel=False, context / pipeline parallel size 1)")
    model.__class__ = VisionLanguageModel
    model.visual = visual if model.pre_process else None
    if config.rotary_interleaved:
        model.rotary_pos_emb.__class__ = InterleavedMultimodalRotaryEmbedding
    return model

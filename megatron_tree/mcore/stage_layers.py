"""Which layers of a model a pipeline stage builds: for decoder block specs that differ per layer."""

from __future__ import annotations

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

__all__ = ["stage_layer_ids"]


def stage_layer_ids(config: TransformerConfig, vp_stage: int | None = None) -> list[int]:
    """The 0-based ids (in the whole model) of the decoder layers this pipeline stage / virtual stage ``vp_stage``
    builds, as megatron-core's ``TransformerBlock`` numbers them (``pipeline_model_parallel_layout`` if set, else the
    stage's offset and layer count)."""
    if config.pipeline_model_parallel_layout is not None:
        return list(config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder,
                                                                             vp_stage=vp_stage))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)))

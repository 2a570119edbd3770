"""The one decision about the optional GPU stack: whether Transformer Engine is there.

Every part that depends on it (the layer spec megatron-core and mbridge build, the compat patches
for the local spec, the TE chain attention path, the launcher's flat baseline) asks
:func:`have_transformer_engine`, so they cannot disagree.
"""

from __future__ import annotations

import functools

__all__ = ["have_transformer_engine"]


def have_transformer_engine() -> bool:
    """Whether Transformer Engine can run here: CUDA is available and TE's PyTorch API imports (it is
    then imported: TE loads the system cuDNN, so call this before PyTorch's cuDNN attention first runs,
    or a cuDNN symbol clash follows). False without CUDA even where TE is installed (its modules need
    a GPU): a CPU run on a GPU machine (``CUDA_VISIBLE_DEVICES=""``) builds megatron-core's local spec."""
    import torch

    return torch.cuda.is_available() and _transformer_engine_imports()


@functools.cache
def _transformer_engine_imports() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # not installed, or built for another torch / CUDA
        return False
    return True

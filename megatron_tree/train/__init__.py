"""The launcher as a package: ``megatron-tree-train`` / ``python -m megatron_tree.train``.

- :mod:`~megatron_tree.train.config` -- ``RunConfig`` (YAML sections, validated at construction);
- :mod:`~megatron_tree.train.data` -- rollout sources: synthetic, JSONL, Parquet (streamed);
- :mod:`~megatron_tree.train.checkpoint` -- megatron-core dist checkpoints (model, optimizer, RNG, data position);
- :mod:`~megatron_tree.train.metrics` -- console, JSONL, TensorBoard and wandb sinks;
- :mod:`~megatron_tree.train.trainer` -- ``Trainer``: setup, the step loop, export, teardown;
- :mod:`~megatron_tree.train.__main__` -- the command line, ``main(argv) -> exit status``.
"""

from megatron_tree.train.config import RunConfig

__all__ = ["RunConfig"]

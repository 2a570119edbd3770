"""Command line of the launcher: ``megatron-tree-train``, ``python -m megatron_tree.train``, ``examples/train_tree.py``.

    megatron-tree-train --config configs/tiny_qwen3.yaml                      # one process (CPU or GPU)
    torchrun --nproc-per-node 2 -m megatron_tree.train --config configs/tiny_qwen3.yaml --tp 2

Every flag but ``--config`` and ``--traceback`` sets one key of the YAML config (its help
names the key and the default); values are validated together with the file. Mistakes in
the flags, the config, the data or the environment end the run with one line on stderr,
``megatron-tree-train: error: ...``, and exit status 1 (2 for a malformed command line, from
argparse), without a traceback unless ``--traceback`` is given; under torchrun from rank 0 only
(:func:`report_error`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import warnings
from typing import Any, NoReturn, Sequence

from megatron_tree.core.microbatch_spec import PACKING_ALGORITHMS
from megatron_tree.train import config

PROG = "megatron-tree-train"

# flag -> (section.key, extra argparse keywords). Help texts and defaults come from the config classes.
FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--hf-path": ("model.hf_path", {"metavar": "DIR"}),
    "--trust-remote-code": ("model.trust_remote_code", {}),
    "--skip-mtp-layers": ("model.skip_mtp_layers", {}),
    "--tp": ("parallel.tp", {}),
    "--pp": ("parallel.pp", {}),
    "--vpp": ("parallel.vpp", {}),
    "--ep": ("parallel.ep", {}),
    "--cp": ("parallel.cp", {}),
    "--distributed-timeout-minutes": ("parallel.distributed_timeout_minutes", {"metavar": "MIN"}),
    "--use-distributed-optimizer": ("parallel.use_distributed_optimizer", {}),
    "--overlap-grad-reduce": ("parallel.overlap_grad_reduce", {}),
    "--overlap-param-gather": ("parallel.overlap_param_gather", {}),
    "--ddp-bucket-size": ("parallel.ddp_bucket_size", {}),
    "--max-tokens-per-mb": ("micro_batch.max_tokens_per_mb", {}),
    "--packing-algorithm": ("micro_batch.packing_algorithm", {"choices": list(PACKING_ALGORITHMS)}),
    "--chunk-trees": ("micro_batch.chunk_trees", {}),
    "--max-kept-tokens": ("micro_batch.max_kept_tokens", {}),
    "--data-path": ("data.path", {"metavar": "FILE"}),
    "--batch-size": ("data.batch_size", {}),
    "--steps": ("train.steps", {}),
    "--lr": ("train.lr", {}),
    "--seed": ("train.seed", {}),
    "--tree-training": ("train.tree_training", {}),
    "--loss": ("train.loss", {"choices": list(config.LOSSES)}),
    "--reward-model": ("train.reward_model", {"metavar": "DIR"}),
    "--kl-coef": ("train.kl_coef", {}),
    "--forward-max-tokens-per-mb": ("train.forward_max_tokens_per_mb", {}),
    "--ppo-epochs": ("train.ppo_epochs", {}),
    "--ppo-mini-batches": ("train.ppo_mini_batches", {}),
    "--recompute": ("train.recompute", {"choices": list(config.RECOMPUTE)}),
    "--attention-backend": ("train.attention_backend", {"choices": list(config.BACKENDS)}),
    "--bf16": ("train.bf16", {}),
    "--verify-tree-model": ("train.verify_tree_model", {}),
    "--skip-nonfinite": ("train.skip_nonfinite", {}),
    "--optimizer": ("optimizer.optimizer", {"choices": list(config.OPTIMIZERS)}),
    "--weight-decay": ("optimizer.weight_decay", {}),
    "--adam-beta1": ("optimizer.adam_beta1", {}),
    "--adam-beta2": ("optimizer.adam_beta2", {}),
    "--adam-eps": ("optimizer.adam_eps", {}),
    "--sgd-momentum": ("optimizer.sgd_momentum", {}),
    "--clip-grad": ("optimizer.clip_grad", {}),
    "--lr-warmup-iters": ("optimizer.lr_warmup_iters", {}),
    "--lr-decay-style": ("optimizer.lr_decay_style", {"choices": list(config.LR_DECAY_STYLES)}),
    "--lr-decay-iters": ("optimizer.lr_decay_iters", {}),
    "--min-lr": ("optimizer.min_lr", {}),
    "--save": ("checkpoint.save", {"metavar": "DIR"}),
    "--save-interval": ("checkpoint.save_interval", {}),
    "--load": ("checkpoint.load", {"metavar": "DIR"}),
    "--export-hf": ("checkpoint.export_hf", {"metavar": "DIR"}),
    "--export-overwrite": ("checkpoint.export_overwrite", {}),
    "--log-jsonl": ("logging.jsonl", {"metavar": "FILE"}),
    "--tensorboard-dir": ("logging.tensorboard_dir", {"metavar": "DIR"}),
    "--wandb-project": ("logging.wandb_project", {"metavar": "NAME"}),
    "--wandb-run-name": ("logging.wandb_run_name", {"metavar": "NAME"}),
    "--wandb-mode": ("logging.wandb_mode", {"choices": list(config.WANDB_MODES)}),
    "--progress": ("logging.progress", {}),
}
MEGATRON_NAMES = {  # Megatron-LM's names of our flags, accepted as aliases
    "--tp": "--tensor-model-parallel-size",
    "--pp": "--pipeline-model-parallel-size",
    "--vpp": "--virtual-pipeline-model-parallel-size",
    "--ep": "--expert-model-parallel-size",
    "--cp": "--context-parallel-size",
    "--steps": "--train-iters",
    "--load": "--load-dir",
}
MICRO_BATCH_HELP = {
    "max_tokens_per_mb": ("capacity of a micro-batch in unique (tree) tokens", 1024),
    "packing_algorithm": ("packing of trees into micro-batches: ffd (first-fit decreasing) | kk (Karmarkar-Karp)", "ffd"),
    "chunk_trees": ("a tree larger than a micro-batch runs in chunks that read their ancestors' keys and values or "
                    "recurrent states (every token computed once, any sequence length; pipeline and context parallel size 1, else off)", True),
    "max_kept_tokens": ("with --chunk-trees (refused with --no-chunk-trees; dropped with a note where chunks cannot "
                        "run: PP or CP > 1): the most slots of activations kept by chunks waiting for later chunks' "
                        "backwards; the others keep only their exported keys and values and run their forward again "
                        "before their backward (0: the least memory; null: max_tokens_per_mb)", None),
}


def _field(key: str) -> tuple[str, Any, type]:
    """(help, default, type) of config key ``section.key``."""
    import typing

    from megatron_tree.train.config import SECTIONS

    section, name = key.split(".")
    if section == "micro_batch":
        help_text, default = MICRO_BATCH_HELP[name]
        return help_text, default, int if default is None else type(default)
    klass = SECTIONS[section]
    f = {f.name: f for f in dataclasses.fields(klass)}[name]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    hint = typing.get_type_hints(klass)[name]
    kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    return f.metadata["help"], default, kind


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors, under torchrun, are printed by rank 0 only (the other ranks put the
    line in their elastic error file, as :func:`report_error` does), so a mistyped flag is not shown once per rank."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and int(os.environ.get("RANK", "0")) != 0:
            report_error(f"{self.prog}: error: {message}")
            sys.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog=PROG,
        description="Tree training with Megatron: pack rollouts that share prefixes into prefix trees and train "
        "on them (CPU over gloo, GPUs over NCCL; run under torchrun for several processes).",
        epilog="Each flag overrides one key of the --config file (shown in brackets with its built-in default). "
        "Rollout file schema: docs/launcher.md, 'Rollout data'.",
    )
    ap.add_argument("--config", metavar="YAML",
                    help="run config file (configs/*.yaml); flags override its keys [default: built-in defaults, "
                         "a tiny random Qwen3 on synthetic GRPO rollouts]")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag, (key, extra) in FLAGS.items():
        section = key.split(".")[0]
        if section not in groups:
            groups[section] = ap.add_argument_group(f"config section '{section}'")
        help_text, default, kind = _field(key)
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
        help_text = f"{help_text} [{key}, default {shown}]".replace("%", "%%")
        kw: dict[str, Any] = dict(dest=key, default=None, help=help_text, **extra)
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            if "choices" not in extra:
                kw.setdefault("metavar", "N" if kind is int else flag.lstrip("-").split("-")[-1].upper())
        aliases = [MEGATRON_NAMES[flag]] if flag in MEGATRON_NAMES else []
        groups[section].add_argument(flag, *aliases, **kw)
    ap.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    return ap


def config_from_args(args: argparse.Namespace):
    """The run config: ``--config`` (or the defaults) with every given flag applied."""
    from megatron_tree.train.config import RunConfig

    overrides: dict[str, dict[str, Any]] = {}
    flags = {key: flag for flag, (key, _) in FLAGS.items()}
    given = [key for key, value in vars(args).items() if "." in key and value is not None]
    for key in given:
        section, name = key.split(".")
        overrides.setdefault(section, {})[name] = getattr(args, key)
    if args.__dict__["model.hf_path"] is not None:  # a checkpoint replaces the config's tiny model
        overrides["model"]["hf_overrides"] = {}
    try:
        if args.config:
            return RunConfig.from_yaml(args.config, overrides)
        return RunConfig.from_dict({}, source="built-in config", overrides=overrides)
    except ValueError as e:  # name the flag next to the key it set
        message = str(e)
        for key in given:
            message = message.replace(f"{key} ", f"{key} ({flags[key]}) ", 1)
        raise ValueError(message) from None


def _quiet_known_warnings() -> None:
    """Drop import-time notices about optional kernels (Apex, Transformer Engine) that every CPU run prints, and
    torch's renaming notices for the collectives megatron-core's distributed optimizer calls."""
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
    # megatron-core's DDP and distributed optimizer call these (torch >= 2.10 renamed them), once per bucket and step
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                            r"is deprecated", category=FutureWarning)
    # megatron-core's DistributedOptimizer.zero_grad reads .grad of its shard views (a comment there says so)
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor",
                            category=UserWarning)


def report_error(line: str) -> None:
    """Show the one-line error ``line`` once per job. One process: on stderr. Under torchrun (its
    ``TORCHELASTIC_ERROR_FILE`` set): every rank writes it to its elastic error file, which torchrun's failure
    summary shows as the failed rank's ``traceback`` (in place of "To enable traceback see: ..."), and only rank 0
    prints it; other ranks stay quiet on stderr (their line, the same or their own, is in the summary). Other
    multi-process launchers (``WORLD_SIZE`` > 1, no error file): every rank prints it, prefixed ``[rank N]``."""
    import json
    import time

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w") as f:
                json.dump(record, f)
        except OSError:
            error_file = None  # then say it on stderr
    if world == 1 or rank == 0 or not error_file:
        prefix = f"[rank {rank}] " if world > 1 and not error_file else ""
        print(f"{prefix}{line}", file=sys.stderr, flush=True)


def persistent_kernel_cache() -> None:
    """Keep FA4's compiled kernels across runs: flash-attn-4's persistent cache (``/tmp/$USER/
    flash_attention_cute_dsl_cache`` or ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``; keyed by flash_attn's sources and
    our tree mask_mods' ``__cute_hash__``, a hash of ours) is on unless ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED``
    is set. It takes ~12 s off the first step of every run after the first on a machine (docs/launcher.md,
    start-up); Inductor's and Triton's caches are on disk by default. Call before flash_attn is imported."""
    from megatron_tree.attention.fa4_warmup import CACHE_VARIABLE

    os.environ.setdefault(CACHE_VARIABLE, "1")


class Terminated(Exception):
    """SIGTERM arrived (what Slurm, Kubernetes and torchrun send to stop a job)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), train, return the exit status. The trainer is
    closed on every path (process groups, temporary model directory, sinks, checkpoint helper
    processes), SIGTERM included, which ends the run with status 143 and one line naming the latest
    checkpoint: during the steps, after the step in flight, saved first when ``--save`` is set (as
    Megatron-LM's ``--exit-signal-handler``; a second SIGTERM stops at once); before or after them
    (set-up, export), between two operations. SIGINT (Ctrl-C) stops at once, status 130, no save."""
    args = build_parser().parse_args(argv)
    _quiet_known_warnings()
    persistent_kernel_cache()
    trainer = None
    status = 1

    def terminate(signum, frame):
        if trainer is not None and trainer.in_steps and not trainer.stop_requested:
            trainer.stop_requested = True  # the trainer saves and stops after this step
        else:
            raise Terminated

    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    try:
        from megatron_tree.train.trainer import Trainer

        cfg = config_from_args(args)
        trainer = Trainer(cfg, config_source=args.config or "built-in")
        trainer.train()
        if trainer.stop_requested:
            raise Terminated
        status = 0
    except (ValueError, OSError) as e:
        if args.traceback:
            raise
        report_error(f"{PROG}: error: {e}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        status = 130
    except Terminated:
        latest = trainer.latest_checkpoint() if trainer is not None else None
        resume = f"; the latest checkpoint is {latest} (resume with --load)" if latest else ""
        print(f"{PROG}: terminated (SIGTERM){resume}", file=sys.stderr, flush=True)
        status = 143
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if trainer is not None:
            trainer.close(failed=status != 0)
    return status


if __name__ == "__main__":
    sys.exit(main())

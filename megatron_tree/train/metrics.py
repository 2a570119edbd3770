"""Where the launcher's per-step records go: console, JSONL, TensorBoard, Weights & Biases.

A record is a flat dict (``step`` 1-based, ``loss``, ``grad_norm``, ``skipped``, ``tokens_per_s``,
``tree_token_ratio``, ``mb_imbalance``, ``dp_tree_token_imbalance``, ``peak_mem_gib``, ...;
see ``megatron_tree.train.trainer.step_record``). Sinks live on rank 0 only. TensorBoard and
wandb get the record's numeric scalars; JSONL gets the whole record, one line per step.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Protocol


class MetricSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields (lists and None left out)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def format_line(record: dict[str, Any], steps: int) -> str:
    """One console line per step (docs/launcher.md defines the columns)."""
    grad = "n/a" if record["grad_norm"] is None else f"{record['grad_norm']:.4f}"
    return (
        f" iteration {record['step']:4d}/{steps} | elapsed time per iteration (ms) {record['step_s'] * 1e3:.1f} | lr {record['lr']:.3E} | loss {record['loss']:.5f} | grad norm {grad} | tokens/s "
        f"{record['tokens_per_s']:.0f} | TFLOP/s/GPU {record['tflops_per_gpu']:.3g} | tree_token_ratio {record['tree_token_ratio']:.3f} | micro-batches "
        f"{record['micro_batches']} | mb imbalance {record['mb_imbalance']:.3f} | dp tree-token imbalance "
        f"{record['dp_tree_token_imbalance']:.3f}"
        + (f" | cp pair imbalance {record['cp_pair_imbalance']:.3f}" if "cp_pair_imbalance" in record else "")
        + f" | peak mem {record['peak_mem_gib']:.2f} GiB"
        + (" | skipped" if record["skipped"] else "")
    )


class ConsoleSink:
    """A log line per step on stdout; with ``progress`` and stdout a terminal, also a tqdm bar
    (lines are written above it). Redirected to a file or a pipe: plain lines only."""

    def __init__(self, *, steps: int, first_step: int, desc: str, progress: bool):
        self.steps = steps
        self.bar = None
        if progress and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=first_step, desc=desc, file=sys.stdout, dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        line = format_line(record, self.steps)
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)
            self.bar.update(1)

    def info(self, message: str) -> None:
        """A line that is not a step record (checkpoint saved, export written)."""
        print(message, flush=True) if self.bar is None else self.bar.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class JsonlSink:
    """One JSON object per step, flushed at once; appended to on resume, else overwritten."""

    def __init__(self, path: str, *, append: bool):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a" if append else "w")
        except OSError as e:
            raise ValueError(f"logging.jsonl (--log-jsonl) {path!r}: cannot write the file ({e.strerror})") from None

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars under ``train/<name>`` at the record's step (``torch.utils.tensorboard``)."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from None
        try:
            self.writer = SummaryWriter(log_dir=log_dir)
        except OSError as e:
            raise ValueError(f"logging.tensorboard_dir (--tensorboard-dir) {log_dir!r}: cannot write there "
                             f"({e.strerror})") from None

    def write(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(f"train/{name}", value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run; ``mode="offline"`` writes under ``./wandb`` without network (``wandb sync`` later)."""

    def __init__(self, project: str, *, name: str | None, mode: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ValueError("--wandb-project needs the wandb package: pip install wandb") from None
        try:
            self.run = wandb.init(project=project, name=name, mode=mode, config=config)
        except wandb.errors.UsageError as e:  # no API key configured (online mode), ...
            reason = " ".join(str(e).split()).rstrip(".")
            raise ValueError(f"--wandb-project {project}: wandb cannot start a run ({reason}); pass --wandb-mode "
                             f"offline (no network; `wandb sync` later) or run `wandb login` first") from None

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({f"train/{k}": v for k, v in scalars(record).items()}, step=record["step"])

    def close(self) -> None:
        self.run.finish()

"""Run configuration for the example launcher: YAML (pyyaml) -> validated dataclasses.

A config file has five sections; every key is optional except where noted::

    model:       {hf_path: /path/to/hf}  or  {arch: qwen3, hf_overrides: {hidden_size: 64, ...}, random_init: false}
    parallel:    {tp: 1, pp: 1, vpp: null, ep: 1}            # dp = world / (tp * pp)
    micro_batch: {max_tokens_per_mb: 1024, ...}              # MicroBatchSpec fields
    data:        {workload: grpo | multi_turn, batch_size: ..., ... }
    train:       {steps: 5, lr: 1.0e-3, tree_training: true, recompute: none | full | selective,
                  bf16: false, seed: 0, loss: sft | grpo, balance: kk,
                  attention_backend: auto | dense | flex}

Unknown keys and bad values raise ``ValueError`` naming the section, the key and what is valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from megatron_tree.microbatch_spec import MicroBatchSpec

ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe")
WORKLOADS = ("grpo", "multi_turn")
RECOMPUTE = ("none", "full", "selective")
LOSSES = ("sft", "grpo")
BALANCE = ("kk", "ffd", "round_robin")
BACKENDS = ("auto", "dense", "flex")


@dataclass(kw_only=True)
class ModelConfig:
    """``hf_path``: an HF checkpoint (weights loaded). Else ``arch`` + ``hf_overrides``: a random
    HF checkpoint of that architecture is written and loaded, or with ``random_init`` only its
    config, and Megatron initialises the weights (large shapes for benchmarks)."""

    hf_path: str | None = None
    arch: str = "qwen3"
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    random_init: bool = False


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1


@dataclass(kw_only=True)
class DataConfig:
    """Synthetic rollouts (``megatron_tree.synthetic``): ``batch_size`` prompts (grpo) or
    conversations (multi_turn) per step, token ids in ``[0, vocab)`` (default: the model's)."""

    workload: str = "grpo"
    batch_size: int = 4
    samples: int = 4
    prompt_len: tuple[int, int] = (16, 48)
    response_len: tuple[int, int] = (4, 24)
    turns: tuple[int, int] = (2, 4)
    turn_len: tuple[int, int] = (4, 16)
    fork_prob: float = 0.3
    vocab: int | None = None
    same_batch_every_step: bool = True


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 5
    lr: float = 1e-3
    tree_training: bool = True
    recompute: str = "none"
    bf16: bool = False
    seed: int = 0
    loss: str = "sft"
    balance: str = "kk"
    attention_backend: str = "auto"


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch: MicroBatchSpec = field(default_factory=lambda: MicroBatchSpec(max_tokens_per_mb=1024))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_yaml(cls, path: str) -> "RunConfig":
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        return cls.from_dict(raw, source=path)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config") -> "RunConfig":
        if not isinstance(raw, Mapping):
            raise ValueError(f"{source}: top level must be a mapping of sections, got {type(raw).__name__}")
        sections = {"model": ModelConfig, "parallel": ParallelConfig, "data": DataConfig, "train": TrainConfig}
        unknown = set(raw) - set(sections) - {"micro_batch"}
        if unknown:
            raise ValueError(f"{source}: unknown section(s) {sorted(unknown)}; valid: {sorted([*sections, 'micro_batch'])}")
        kwargs = {name: _section(klass, raw.get(name) or {}, f"{source}: {name}") for name, klass in sections.items()}
        try:
            kwargs["micro_batch"] = MicroBatchSpec.from_dict(raw.get("micro_batch") or {"max_tokens_per_mb": 1024})
        except ValueError as e:
            raise ValueError(f"{source}: micro_batch: {e}") from None
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        """Check values across sections; raises ``ValueError`` naming the key and the fix."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"{source}: {msg}")

        m, p, d, t = self.model, self.parallel, self.data, self.train
        need(m.hf_path is not None or m.arch in ARCHS, f"model.arch must be one of {ARCHS}, got {m.arch!r}")
        for key in ("tp", "pp", "ep"):
            v = getattr(p, key)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"parallel.{key} must be an int >= 1, got {v!r}")
        need(p.vpp is None or (isinstance(p.vpp, int) and p.vpp >= 2 and p.pp >= 2),
             f"parallel.vpp must be null or an int >= 2 with pp >= 2, got vpp={p.vpp!r}, pp={p.pp}")
        need(d.workload in WORKLOADS, f"data.workload must be one of {WORKLOADS}, got {d.workload!r}")
        for key in ("batch_size", "samples"):
            need(getattr(d, key) >= 1, f"data.{key} must be >= 1, got {getattr(d, key)!r}")
        for key in ("prompt_len", "response_len", "turns", "turn_len"):
            lo_hi = getattr(d, key)
            need(len(lo_hi) == 2 and 0 <= lo_hi[0] <= lo_hi[1], f"data.{key} must be [lo, hi] with 0 <= lo <= hi, got {lo_hi!r}")
        need(d.prompt_len[0] >= 1 and d.turn_len[0] >= 1, "data.prompt_len and data.turn_len need lo >= 1")
        need(0.0 <= d.fork_prob <= 1.0, f"data.fork_prob must be in [0, 1], got {d.fork_prob}")
        need(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
        need(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
        need(t.recompute in RECOMPUTE, f"train.recompute must be one of {RECOMPUTE}, got {t.recompute!r}")
        need(t.loss in LOSSES, f"train.loss must be one of {LOSSES}, got {t.loss!r}")
        need(t.balance in BALANCE, f"train.balance must be one of {BALANCE}, got {t.balance!r}")
        need(t.attention_backend in BACKENDS,
             f"train.attention_backend must be one of {BACKENDS}, got {t.attention_backend!r}")


def _section(klass, values: Mapping[str, Any], where: str):
    if not isinstance(values, Mapping):
        raise ValueError(f"{where} must be a mapping, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(klass)}
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; valid: {sorted(fields)}")
    out = {}
    for key, value in values.items():
        default = getattr(klass(), key)
        if isinstance(default, tuple):
            value = tuple(value)
        elif isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"{where}.{key} must be true or false, got {value!r}")
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}.{key} must be a number, got {value!r}")
            value = type(default)(value) if isinstance(default, float) else value
        out[key] = value
    return klass(**out)

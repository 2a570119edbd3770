"""Run configuration of the launcher: YAML (pyyaml) -> frozen dataclasses validated at construction.

A config file has up to eight sections; every key is optional::

    model:       {hf_path: /path/to/hf}  or  {arch: qwen3, hf_overrides: {hidden_size: 64, ...}, random_init: false}
    parallel:    {tp: 1, pp: 1, vpp: null, ep: 1, cp: 1,     # dp = world / (tp * pp * cp)
                  use_distributed_optimizer: false, overlap_grad_reduce: false, overlap_param_gather: false}
    micro_batch: {max_tokens_per_mb: 1024, ...}              # MicroBatchSpec fields
    data:        {path: rollouts.jsonl | .parquet}  or  {workload: grpo | multi_turn, batch_size: ..., ...}
    train:       {steps: 5, lr: 1.0e-3, seed: 0, loss: sft | grpo, ...}
    optimizer:   {optimizer: adam | sgd, weight_decay: 0.01, clip_grad: 1.0, lr_warmup_iters: 0,
                  lr_decay_style: constant | linear | cosine, min_lr: 0.0, ...}   # megatron-core's names
    checkpoint:  {save: DIR, save_interval: N, load: DIR, export_hf: DIR, export_overwrite: bool}
    logging:     {jsonl: FILE, tensorboard_dir: DIR, wandb_project: NAME, wandb_mode: online | offline, progress: true}

Every section checks its keys' types and values in ``__post_init__`` and :class:`RunConfig`
checks across sections; a mistake raises one ``ValueError`` naming ``section.key``, the
value and what is valid (``RunConfig.from_yaml`` prefixes the file name). Each field's
``metadata["help"]`` is the help text of its command-line flag (``megatron_tree.train.__main__``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from megatron_tree.attention import backend_names
from megatron_tree.core.microbatch_spec import MicroBatchSpec
from megatron_tree.runtime.tiny_models import TINY_ARCHS

ARCHS = (*TINY_ARCHS, "qwen2_5_vl", "glm4v", "glm4v_moe")
WORKLOADS = ("grpo", "multi_turn")
RECOMPUTE = ("none", "full", "selective")
LOSSES = ("sft", "grpo", "ppo")
OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
BALANCE = ("kk", "ffd", "round_robin")
BACKENDS = backend_names()
WANDB_MODES = ("online", "offline", "disabled")
DATA_SUFFIXES = (".jsonl", ".parquet")


def _field(default: Any, help: str) -> Any:
    """A dataclass field whose ``help`` is its command-line flag's help text."""
    return field(default=default, metadata={"help": help})


class _Section:
    """Base of the config sections: checks every field against its annotation (``int``,
    ``float``, ``bool``, ``str``, ``tuple[int, int]``, ``dict``, ``X | None``), converts YAML
    lists to tuples, ints to floats and numbers PyYAML left as strings (``3e-3``) where declared,
    refuses NaN and inf in number fields (YAML ``.inf``, ``--lr inf``), then runs :meth:`_check`."""

    SECTION = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(getattr(self, f.name), hints[f.name], f"{self.SECTION}.{f.name}")
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        pass

    def _need(self, ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{self.SECTION}.{key} must be {what}, got {getattr(self, key)!r}")


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list [{', '.join(_describe(a) for a in typing.get_args(hint))}]"
    return {int: "an int", float: "a number", bool: "true or false", str: "a string", type(None): "null",
            dict: "a mapping"}.get(typing.get_origin(hint) or hint, str(hint))


def _number(text: str, hint: type) -> Any:
    """``text`` as a number of ``hint`` if it spells one, else ``text`` unchanged. PyYAML (YAML 1.1)
    reads ``3e-3`` and ``1e3`` as strings (its floats need a dot); a float field takes any finite
    number, an int field only an integral one (``1e3``, not ``2.5``)."""
    try:
        return int(text) if hint is int else float(int(text))
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    if number != number or number in (float("inf"), float("-inf")):
        return text
    if hint is int:
        return int(number) if number.is_integer() else text
    return number


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` converted to ``hint`` (list -> tuple, int -> float), or ``ValueError`` naming ``where``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            try:
                return _coerce(value, rest[0], where)
            except ValueError:
                pass
        raise ValueError(f"{where} must be {_describe(hint)}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"{where} must be {_describe(hint)}, got {value!r}")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if (origin or hint) is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where} must be a mapping of names to values, got {value!r}")
        return dict(value)
    if hint in (int, float) and isinstance(value, str):
        value = _number(value, hint)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(hint)
    if ok is None:
        raise TypeError(f"{where}: unsupported annotation {hint!r}")
    if not ok:
        raise ValueError(f"{where} must be {_describe(hint)}, got {value!r}")
    if hint is float and not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    return float(value) if hint is float else value


@dataclass(frozen=True, kw_only=True)
class ModelConfig(_Section):
    """``hf_path``: a local HF checkpoint (weights loaded). Else ``arch`` + ``hf_overrides``: a
    random tiny HF checkpoint of that architecture (``megatron_tree.runtime.cpu.tiny_hf_config``)
    is written to a temporary directory and loaded, or with ``random_init`` only its config,
    and Megatron initialises the weights (large shapes for benchmarks)."""

    SECTION = "model"
    hf_path: str | None = _field(None, "local Hugging Face checkpoint directory to train (config.json + safetensors); replaces arch and hf_overrides")
    arch: str = _field("qwen3", "without hf_path: architecture of a random tiny model")
    hf_overrides: dict[str, Any] = field(default_factory=dict, metadata={"help": "HF config keys of the tiny model"})
    random_init: bool = _field(False, "tiny model: Megatron's random init instead of random HF weights")
    trust_remote_code: bool = _field(False, "read a config class the checkpoint ships (its config.json's auto_map, "
                                     "e.g. MiMo's configuration_mimo.py), as transformers' trust_remote_code")
    skip_mtp_layers: bool = _field(False, "build without the checkpoint's multi-token prediction layers (MiMo, "
                                   "DeepSeek-V3), which tree training cannot run: they are not loaded, trained or "
                                   "exported")

    def _check(self) -> None:
        if self.hf_path is not None:
            if self.hf_overrides:
                raise ValueError(
                    f"model.hf_overrides applies to the random tiny model of model.arch only, not to "
                    f"model.hf_path={self.hf_path!r}; drop one of them"
                )
            config_json = os.path.join(self.hf_path, "config.json")
            if not os.path.isfile(config_json):
                raise ValueError(
                    f"model.hf_path {self.hf_path!r} is not a Hugging Face checkpoint directory (no config.json "
                    f"there); pass a local directory, e.g. from `huggingface-cli download Qwen/Qwen3-0.6B "
                    f"--local-dir DIR`"
                )
            try:
                with open(config_json, "rb") as f:
                    values = json.load(f)
            except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError: both ValueErrors
                raise ValueError(f"model.hf_path: {config_json} is not a readable JSON file ({e}); download the "
                                 f"checkpoint's config.json again") from None
            if not isinstance(values, dict):
                raise ValueError(f"model.hf_path: {config_json} holds {type(values).__name__}, not a JSON object")
            _check_model_sizes(values, lambda key: f"model.hf_path: {config_json}'s {key}", "; fix that file")
            return
        self._need(self.arch in ARCHS, "arch", f"one of {ARCHS} (or set model.hf_path)")
        from megatron_tree.runtime import tiny_hf_config

        try:
            hf_config = tiny_hf_config(self.arch, **self.hf_overrides)
        except Exception as e:  # unknown keys (ValueError); HF's own checks of the values (several types)
            raise ValueError(f"model.hf_overrides: {' '.join(str(e).split())}") from None
        _check_model_sizes(hf_config.to_dict(), lambda key: f"model.hf_overrides.{key}", "")


# Hugging Face config keys that size a model's weights: each, where a config has it and it is not null, must be an
# int >= 1 (transformers takes -64 or 0 and the model fails to build with a traceback, or builds with no layers)
MODEL_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
               "num_local_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
               "v_head_dim", "max_position_embeddings")


def _check_model_sizes(values: Mapping[str, Any], where, fix: str) -> None:
    """ValueError unless each of :data:`MODEL_SIZES` in the HF config ``values`` is null or an int >= 1;
    ``where(key)`` names the key in the message (``model.hf_overrides.hidden_size``, a config.json's key),
    ``fix`` ends it."""
    for key in MODEL_SIZES:
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where(key)} is {value!r}, but a model needs an int >= 1 there{fix}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(_Section):
    SECTION = "parallel"
    tp: int = _field(1, "tensor parallel size")
    pp: int = _field(1, "pipeline parallel size")
    vpp: int | None = _field(None, "virtual pipeline stages per rank (interleaved PP); num_hidden_layers % (pp*vpp) == 0")
    ep: int = _field(1, "expert parallel size (MoE)")
    cp: int = _field(1, "context parallel size: each micro-batch's slots split over cp ranks (long trees; "
                        "when it pays: docs/results.md, Context parallel)")
    distributed_timeout_minutes: float = _field(10.0, "a collective that waits longer fails and ends the job (a hung "
                                                "or dead rank), as Megatron-LM's --distributed-timeout-minutes")
    use_distributed_optimizer: bool = _field(False, "shard the optimizer state over data-parallel ranks (megatron-core's "
                                             "DistributedOptimizer, ZeRO-1): gradients reduce-scattered, each rank "
                                             "updates its shard, the weights all-gathered")
    overlap_grad_reduce: bool = _field(False, "reduce the gradients bucket by bucket as the last micro-batch's "
                                       "backward produces them (megatron-core's DDP, asynchronous collectives)")
    overlap_param_gather: bool = _field(False, "with use_distributed_optimizer and overlap_grad_reduce: all-gather "
                                        "the updated weights bucket by bucket during the next forward")
    ddp_bucket_size: int | None = _field(None, "with overlap_grad_reduce: parameters per gradient bucket (null: "
                                         "max(40M, 1M * data-parallel size), Megatron-LM's default)")

    def _check(self) -> None:
        for key in ("tp", "pp", "ep", "cp"):
            self._need(getattr(self, key) >= 1, key, "an int >= 1")
        self._need(0 < self.distributed_timeout_minutes < 1e6, "distributed_timeout_minutes", "a number of minutes > 0")
        self._need(self.vpp is None or (self.vpp >= 2 and self.pp >= 2), "vpp",
                   f"null or an int >= 2 with pp >= 2 (pp={self.pp})")
        self._need(self.ddp_bucket_size is None or self.ddp_bucket_size >= 1, "ddp_bucket_size", "null or an int >= 1")
        # Megatron-LM's own checks (megatron/training/arguments.py), one line each
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("parallel.overlap_param_gather all-gathers the weights the distributed optimizer updated "
                             "in shards; it needs parallel.use_distributed_optimizer (add --use-distributed-optimizer "
                             "or drop --overlap-param-gather)")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("parallel.overlap_param_gather needs parallel.overlap_grad_reduce, as in Megatron-LM (add "
                             "--overlap-grad-reduce or drop --overlap-param-gather)")
        if self.ddp_bucket_size is not None and not self.overlap_grad_reduce:
            raise ValueError(f"parallel.ddp_bucket_size={self.ddp_bucket_size} sizes the buckets of an overlapped "
                             f"gradient reduction; without parallel.overlap_grad_reduce the gradients go in one "
                             f"bucket (add --overlap-grad-reduce or drop --ddp-bucket-size)")


@dataclass(frozen=True, kw_only=True)
class DataConfig(_Section):
    """Rollouts from ``path`` (JSONL or Parquet, :mod:`megatron_tree.train.data`), else synthetic
    ones (:mod:`megatron_tree.core.synthetic`): ``batch_size`` prompts (grpo) or conversations
    (multi_turn) per step, token ids in ``[0, vocab)`` (default: the model's)."""

    SECTION = "data"
    path: str | None = _field(None, "rollout file (.jsonl or .parquet, schema in docs/launcher.md); null: synthetic rollouts")
    batch_size: int = _field(4, "groups per rollout batch (one step without --ppo-epochs / --ppo-mini-batches): prompts "
                                "(GRPO samples share a group) or conversations")
    workload: str = _field("grpo", "synthetic: grpo | multi_turn")
    samples: int = _field(4, "synthetic grpo: responses per prompt")
    prompt_len: tuple[int, int] = _field((16, 48), "synthetic: [lo, hi] prompt (system prompt) tokens")
    response_len: tuple[int, int] = _field((4, 24), "synthetic grpo: [lo, hi] response tokens")
    turns: tuple[int, int] = _field((2, 4), "synthetic multi_turn: [lo, hi] turns per conversation")
    turn_len: tuple[int, int] = _field((4, 16), "synthetic multi_turn: [lo, hi] tokens per turn")
    fork_prob: float = _field(0.3, "synthetic multi_turn: chance a turn branches from an earlier one")
    vocab: int | None = _field(None, "synthetic: token ids in [0, vocab); default the model's vocabulary")
    same_batch_every_step: bool = _field(True, "synthetic: one batch for all steps (the loss visibly falls)")

    def _check(self) -> None:
        if self.path is not None:
            self._need(self.path.endswith(DATA_SUFFIXES), "path", f"a file ending in {' or '.join(DATA_SUFFIXES)}")
            self._need(os.path.isfile(self.path), "path", "an existing file")
        self._need(self.workload in WORKLOADS, "workload", f"one of {WORKLOADS}")
        for key in ("batch_size", "samples"):
            self._need(getattr(self, key) >= 1, key, "an int >= 1")
        for key in ("prompt_len", "response_len", "turns", "turn_len"):
            lo, hi = getattr(self, key)
            self._need(0 <= lo <= hi, key, "[lo, hi] with 0 <= lo <= hi")
        self._need(self.prompt_len[0] >= 1, "prompt_len", "[lo, hi] with lo >= 1")
        self._need(self.turn_len[0] >= 1, "turn_len", "[lo, hi] with lo >= 1")
        self._need(0.0 <= self.fork_prob <= 1.0, "fork_prob", "in [0, 1]")
        self._need(self.vocab is None or self.vocab >= 2, "vocab", "null or an int >= 2")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(_Section):
    SECTION = "train"
    steps: int = _field(5, "optimizer steps (iterations) in total (a resumed run continues up to this many); a "
                        "multiple of ppo_epochs * ppo_mini_batches, the updates of one rollout batch")
    lr: float = _field(1e-3, "Adam learning rate (constant)")
    seed: int = _field(0, "seed of the tiny model's weights, synthetic data and Megatron's RNG")
    tree_training: bool = _field(True, "pack shared prefixes as trees; false: the flat baseline on the same data "
                                 "(with Transformer Engine on GPUs: Megatron's THD sequence packing, upstream model)")
    loss: str = _field("sft", "sft (token NLL) | grpo (PPO-clip on advantages) | ppo (actor + critic: reference, "
                       "critic and reward-model passes, GAE; megatron_tree.train.ppo)")
    kl_coef: float = _field(0.0, "grpo: weight of the k3 KL to ref_logprobs (rollouts must carry them); ppo: "
                            "per-token KL penalty to the reference model in the reward")
    clip_eps: float = _field(0.2, "grpo, ppo: PPO clip range")
    ppo_epochs: int = _field(1, "passes over each rollout batch, one optimizer update per mini-batch each (verl's "
                             "ppo_epochs); old log-probs are computed once per rollout batch, before its first update")
    ppo_mini_batches: int = _field(1, "mini-batches per rollout batch: its groups split in order into this many "
                                   "of whole groups (as even as possible), each packed and balanced over "
                                   "data-parallel ranks on its own, one optimizer update each")
    gamma: float = _field(1.0, "ppo: GAE discount")
    lam: float = _field(0.95, "ppo: GAE lambda")
    value_clip: float = _field(0.2, "ppo: clip range of the critic's value loss")
    reward_model: str | None = _field(None, "ppo: HF checkpoint of the reward model (value head, lm_head.weight "
                                      "[1, hidden]); null: the actor's checkpoint with a fixed-seed value head")
    forward_max_tokens_per_mb: int | None = _field(
        None, "capacity of the micro-batches of the forward-only passes (grpo's old log-probs with several updates "
        "per rollout batch; ppo's old and reference log-probs, critic values, reward scores), in unique (tree) tokens; "
        ">= micro_batch.max_tokens_per_mb: these passes keep no activations for a backward, and fewer, larger "
        "micro-batches launch fewer kernels (verl's log_prob_max_token_len_per_gpu); null: "
        "micro_batch.max_tokens_per_mb")
    recompute: str = _field("none", "activation recompute: none | full | selective")
    bf16: bool = _field(False, "bf16 weights and activations (needs a CUDA GPU)")
    balance: str = _field("kk", "split of a batch over data-parallel ranks: kk | ffd | round_robin")
    attention_backend: str = _field("auto", f"tree attention kernel: {' | '.join(BACKENDS)} (auto: per call the fastest "
                                    f"backend proven exact on its shape)")
    verify_tree_model: bool = _field(False, "at start-up, check tree log-probs and parameter gradients against "
                                     "per-sequence runs on the dense reference attention (verify_tree_model)")
    skip_nonfinite: bool = _field(False, "a step whose loss or gradient norm is NaN / inf skips its optimizer step "
                                  "(weights unchanged, record skipped: true); false: the run stops with an error "
                                  "before that optimizer step")

    def _check(self) -> None:
        self._need(self.steps >= 1, "steps", "an int >= 1")
        self._need(0 <= self.seed < 2**32, "seed", "an int in [0, 2**32 - 1] (NumPy's seed range)")
        self._need(self.lr > 0, "lr", "> 0")
        self._need(self.kl_coef >= 0, "kl_coef", ">= 0")
        self._need(0 < self.clip_eps < 1, "clip_eps", "in (0, 1)")
        for key in ("ppo_epochs", "ppo_mini_batches"):
            self._need(getattr(self, key) >= 1, key, "an int >= 1")
        self._need(0 <= self.gamma <= 1, "gamma", "in [0, 1]")
        self._need(0 <= self.lam <= 1, "lam", "in [0, 1]")
        self._need(self.value_clip > 0, "value_clip", "> 0")
        self._need(self.forward_max_tokens_per_mb is None or self.forward_max_tokens_per_mb >= 1,
                   "forward_max_tokens_per_mb", "null or an int >= 1")
        for key, valid in (("loss", LOSSES), ("recompute", RECOMPUTE), ("balance", BALANCE),
                           ("attention_backend", BACKENDS)):
            self._need(getattr(self, key) in valid, key, f"one of {valid}")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Section):
    """megatron-core's optimizer (``OptimizerConfig``) and learning-rate schedule (``OptimizerParamScheduler``),
    with Megatron-LM's names and defaults (but ``lr_decay_style`` constant); the peak lr is ``train.lr``."""

    SECTION = "optimizer"
    optimizer: str = _field("adam", "adam (decoupled weight decay, AdamW) | sgd")
    weight_decay: float = _field(0.01, "weight decay")
    adam_beta1: float = _field(0.9, "Adam beta1")
    adam_beta2: float = _field(0.999, "Adam beta2")
    adam_eps: float = _field(1e-8, "Adam epsilon")
    sgd_momentum: float = _field(0.9, "SGD momentum")
    clip_grad: float = _field(1.0, "clip the global gradient norm to this (0: no clipping), on CPU too")
    lr_warmup_iters: int = _field(0, "linear warmup of the lr from 0 to train.lr over this many steps")
    lr_decay_style: str = _field("constant", "after the warmup: constant | linear | cosine decay to min_lr")
    lr_decay_iters: int | None = _field(None, "steps of warmup + decay (null: train.steps)")
    min_lr: float = _field(0.0, "lr at the end of the decay")

    def _check(self) -> None:
        self._need(self.optimizer in OPTIMIZERS, "optimizer", f"one of {OPTIMIZERS}")
        self._need(self.lr_decay_style in LR_DECAY_STYLES, "lr_decay_style", f"one of {LR_DECAY_STYLES}")
        for key in ("weight_decay", "clip_grad", "min_lr", "sgd_momentum"):
            self._need(getattr(self, key) >= 0, key, ">= 0")
        for key in ("adam_beta1", "adam_beta2"):
            self._need(0 <= getattr(self, key) < 1, key, "in [0, 1)")
        self._need(self.adam_eps > 0, "adam_eps", "> 0")
        self._need(self.lr_warmup_iters >= 0, "lr_warmup_iters", "an int >= 0")
        self._need(self.lr_decay_iters is None or self.lr_decay_iters >= 1, "lr_decay_iters", "null or an int >= 1")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(_Section):
    SECTION = "checkpoint"
    save: str | None = _field(None, "directory for megatron dist checkpoints (DIR/iter_NNNNNNN)")
    save_interval: int | None = _field(None, "save every N steps and after the last; null: after the last only")
    load: str | None = _field(None, "resume from this directory (its latest checkpoint) or one iter_NNNNNNN in it")
    export_hf: str | None = _field(None, "at the end, write the trained weights as a Hugging Face checkpoint here")
    export_overwrite: bool = _field(False, "export_hf names a non-empty directory: replace its contents (else refused)")

    def _check(self) -> None:
        self._need(self.save_interval is None or self.save_interval >= 1, "save_interval", "null or an int >= 1")
        if self.save_interval is not None and self.save is None:
            raise ValueError("checkpoint.save_interval needs checkpoint.save (--save DIR): where to write")
        if self.load is not None and not os.path.isdir(self.load):
            self._need(False, "load", "an existing checkpoint directory")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig(_Section):
    SECTION = "logging"
    jsonl: str | None = _field(None, "write one JSON record per step to this file (rank 0; appended to on resume)")
    tensorboard_dir: str | None = _field(None, "write TensorBoard scalars here (needs tensorboard)")
    wandb_project: str | None = _field(None, "log to this Weights & Biases project (needs wandb)")
    wandb_run_name: str | None = _field(None, "wandb run name (null: wandb picks one)")
    wandb_mode: str = _field("online", "online | offline (no network; `wandb sync` later) | disabled")
    progress: bool = _field(True, "progress bar on a terminal (never in files or pipes)")

    def _check(self) -> None:
        self._need(self.wandb_mode in WANDB_MODES, "wandb_mode", f"one of {WANDB_MODES}")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "micro_batch": MicroBatchSpec,
    "data": DataConfig,
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}
DEFAULT_MICRO_BATCH = {"max_tokens_per_mb": 1024, "chunk_trees": True}
"""The launcher's micro-batch defaults (``chunk_trees``: on, unlike ``MicroBatchSpec``'s; the trainer runs it where
the layout allows, pipeline and context parallel size 1)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch: MicroBatchSpec = field(default_factory=lambda: MicroBatchSpec(**DEFAULT_MICRO_BATCH))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        opt = self.optimizer
        decay = opt.lr_decay_iters or self.train.steps
        if opt.lr_warmup_iters >= decay:
            raise ValueError(f"optimizer.lr_warmup_iters={opt.lr_warmup_iters} must be below the warmup + decay steps "
                             f"({decay}: optimizer.lr_decay_iters, else train.steps)")
        if opt.min_lr > self.train.lr:
            raise ValueError(f"optimizer.min_lr={opt.min_lr} is above train.lr={self.train.lr}, the peak lr")
        if self.parallel.use_distributed_optimizer and opt.optimizer != "adam":
            raise ValueError(f"parallel.use_distributed_optimizer shards Adam's state only (megatron-core's "
                             f"DistributedOptimizer saves and restores exp_avg / exp_avg_sq), not optimizer.optimizer="
                             f"{opt.optimizer}; pass --optimizer adam or drop --use-distributed-optimizer")
        if self.checkpoint.export_hf and self.model.random_init:
            raise ValueError("checkpoint.export_hf needs a model built from Hugging Face weights; model.random_init "
                             "models have none to map onto (set random_init: false)")
        if self.train.kl_coef > 0 and self.train.loss == "sft":
            raise ValueError(f"train.kl_coef={self.train.kl_coef} applies to losses grpo and ppo only; set train.loss "
                             f"or drop kl_coef")
        t, updates = self.train, self.train.ppo_epochs * self.train.ppo_mini_batches
        for key, value in (("train.steps", t.steps), ("checkpoint.save_interval", self.checkpoint.save_interval)):
            if value is not None and value % updates:
                raise ValueError(f"{key}={value} counts optimizer updates and must be a multiple of train.ppo_epochs * "
                                 f"train.ppo_mini_batches = {t.ppo_epochs} * {t.ppo_mini_batches}, the updates of one "
                                 f"rollout batch (checkpoints fall between rollout batches); pass "
                                 f"{-(-value // updates) * updates}")
        fwd, mb = t.forward_max_tokens_per_mb, self.micro_batch.max_tokens_per_mb
        if fwd is not None and (t.loss == "sft" or t.loss == "grpo" and updates == 1):
            raise ValueError(f"train.forward_max_tokens_per_mb={fwd} sizes the forward-only passes: ppo's, and grpo's old "
                             f"log-probs with several updates per rollout batch (train.ppo_epochs * "
                             f"train.ppo_mini_batches > 1); train.loss {t.loss} with {updates} update(s) runs none: "
                             f"drop it")
        if fwd is not None and fwd < mb:
            raise ValueError(f"train.forward_max_tokens_per_mb={fwd} is below micro_batch.max_tokens_per_mb={mb}: the "
                             f"forward-only passes keep no activations for a backward, so they take at least the "
                             f"training micro-batch; raise it or drop it (null: {mb})")
        if t.ppo_mini_batches > self.data.batch_size:
            raise ValueError(f"train.ppo_mini_batches={t.ppo_mini_batches} is more than data.batch_size="
                             f"{self.data.batch_size} groups per rollout batch; mini-batches take whole groups")
        if self.train.kl_coef > 0 and self.train.loss == "grpo" and self.data.path is None:
            raise ValueError("train.kl_coef > 0 needs reference log-probs: rollouts from data.path with ref_logprobs")

    @classmethod
    def from_yaml(cls, path: str, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> "RunConfig":
        """Read ``path``, apply ``overrides`` (``{section: {key: value}}``, e.g. from flags), validate."""
        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {path!r} does not exist; pass --config with a YAML file (see configs/)") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not a YAML text file (it holds byte {e.object[e.start]:#04x}, not UTF-8 "
                             f"text); pass --config with a YAML file (see configs/)") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"{path}: not valid YAML{where}: {problem}") from None
        return cls.from_dict(raw or {}, source=path, overrides=overrides)

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], source: str = "config", overrides: Mapping[str, Mapping[str, Any]] | None = None
    ) -> "RunConfig":
        """Build from ``{section: {key: value}}`` (a parsed YAML file) plus ``overrides``; errors name ``source``."""
        if overrides:
            source = f"{source} + command line"
        try:
            if not isinstance(raw, Mapping):
                raise ValueError(f"top level must be a mapping of sections {list(SECTIONS)}, got {raw!r}")
            unknown = set(raw) - set(SECTIONS)
            if unknown:
                raise ValueError(f"unknown section(s) {sorted(unknown)}; valid: {list(SECTIONS)}")
            sections = {}
            for name, klass in SECTIONS.items():
                values = raw.get(name)
                if values is None:
                    values = dict(DEFAULT_MICRO_BATCH) if klass is MicroBatchSpec else {}
                if not isinstance(values, Mapping):
                    raise ValueError(f"{name} must be a mapping of keys to values, got {values!r}")
                values = {**values, **(overrides or {}).get(name, {})}
                sections[name] = _section(name, klass, values)
            return cls(**sections)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


def _section(name: str, klass: type, values: Mapping[str, Any]):
    if klass is MicroBatchSpec:
        try:
            return MicroBatchSpec.from_dict({"chunk_trees": DEFAULT_MICRO_BATCH["chunk_trees"], **values})
        except (ValueError, TypeError) as e:
            raise ValueError(f"micro_batch: {e}") from None
    fields = [f.name for f in dataclasses.fields(klass)]
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {sorted(unknown)}; valid: {fields}")
    return klass(**values)

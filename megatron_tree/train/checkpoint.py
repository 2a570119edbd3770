"""Checkpoints of a training run with megatron-core's distributed checkpointing (``torch_dist``).

Layout, as Megatron-LM's: ``ROOT/iter_0000004/`` (one dist checkpoint per save) and
``ROOT/latest_checkpointed_iteration.txt``. A checkpoint holds

- ``model`` (``model0``, ``model1``, ... under virtual pipeline): every chunk's sharded state
  (of the ``GPTModel`` inside the DDP / Float16Module wrappers);
- ``optimizer``: Megatron's optimizer state sharded like the parameters (Adam moments, step; the distributed
  optimizer's per bucket shard, :func:`_optimizer_layout`);
- ``critic``, ``critic_optimizer`` (``train.loss: ppo``): the critic's chunks (keys prefixed ``critic.``)
  and its optimizer's state (the reference and reward models are rebuilt as the run starts);
- ``rng_state``: Python, NumPy, torch (CPU and CUDA) and Megatron's model-parallel RNG
  tracker, one object per rank (restored when the world size is the same);
- ``iteration``, ``data`` (the rollout source's position), ``world_size`` and ``distributed_optimizer``
  (a run resumes with the optimizer kind it saved): plain values in ``common.pt`` (megatron-core 0.16; 0.19 keeps
  them in the shards, as a ``common_state`` object);

and beside them ``checksums.json``: the size and SHA-256 of every file of the checkpoint, written before it is
renamed into place and verified at load (:func:`write_checksums`, :func:`verify_checksums`).

Call both functions on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_tree.compat.megatron_core import distributed_optimizer_state_for_load, distributed_optimizer_restore_steps
from megatron_tree.mcore.data_parallel import sync_params

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKSUMS_FILE = "checksums.json"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def is_distributed_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` (megatron-core's, chained or not) is the distributed optimizer (state sharded over
    data-parallel ranks)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_layout(optimizer) -> dict[str, Any]:
    """``sharded_state_dict`` keywords of ``optimizer``: the distributed optimizer's state in Megatron-LM's default
    layout, ``dp_reshardable`` (each rank writes its own shard of every bucket, no communication; a resume needs the
    same buckets: ``--ddp-bucket-size`` and the tensor / pipeline layout, the data-parallel size may change;
    megatron-core's own default, ``fully_sharded_model_space``, no longer saves); nothing for other optimizers."""
    if not is_distributed_optimizer(optimizer):
        return {}
    return {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}


def _sharded_state_dict(model: list, optimizer, *, is_loading: bool, rng: dict | None, critic=None) -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.utils import unwrap_model

    state: dict[str, Any] = {}
    for i, chunk in enumerate(unwrap_model(model)):
        state["model" if len(model) == 1 else f"model{i}"] = chunk.sharded_state_dict()
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, **_optimizer_layout(optimizer))
    if critic is not None:
        chunks, critic_optimizer = critic
        state["critic"] = {str(i): chunk.sharded_state_dict(prefix="critic.") for i, chunk in enumerate(unwrap_model(chunks))}
        state["critic_optimizer"] = critic_optimizer.sharded_state_dict(
            {"critic": state["critic"]}, is_loading=is_loading, **_optimizer_layout(critic_optimizer))
        if is_distributed_optimizer(critic_optimizer):  # its per-bucket keys are the actor optimizer's otherwise
            from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

            add_prefix_for_sharding(state["critic_optimizer"], "critic.")
    rank, world = dist.get_rank(), dist.get_world_size()
    state["rng_state"] = ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0)
    return state


def save_checkpoint(root: str, iteration: int, model: list, optimizer, *, data: dict[str, Any], scheduler=None,
                    critic=None) -> str:
    """Save the run after ``iteration`` steps under ``root``; returns the checkpoint directory.
    ``data`` is the rollout source's position; ``scheduler`` megatron-core's ``OptimizerParamScheduler``
    (its state: steps taken, schedule); ``critic``: PPO's ``(critic chunks, critic optimizer)``.

    Safe against a kill at any instant: the checkpoint is written into a staging folder
    (``.iter_NNNNNNN.saving``) and renamed into place once every rank has finished; an existing
    checkpoint of that iteration is moved aside only then (and deleted after); the tracker file is
    replaced atomically (temporary file, fsync, rename) last. A kill leaves the previous tracker and
    checkpoints intact, or at worst a tracker naming a missing checkpoint, which :func:`resolve_checkpoint`
    steps over to the newest complete one.
    """
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, iteration)
    staging = os.path.join(root, f".{os.path.basename(path)}.saving")
    if dist.get_rank() == 0:
        if os.path.isdir(staging):  # left by a save that was killed
            shutil.rmtree(staging)
        os.makedirs(staging)
    dist.barrier()
    sync_params(model)  # weights the distributed optimizer updated in shards, where their all-gather is deferred
    if critic is not None:
        sync_params(critic[0])
    state = _sharded_state_dict(model, optimizer, is_loading=False, rng=_rng_state(), critic=critic)
    state.update(iteration=iteration, data=data, world_size=dist.get_world_size(), model_config=model_signature(model),
                 has_critic=critic is not None, distributed_optimizer=is_distributed_optimizer(optimizer))
    if scheduler is not None:
        state.update(opt_param_scheduler=scheduler.state_dict())
    dist_checkpointing.save(state, staging)
    dist.barrier()
    write_checksums(staging)
    if dist.get_rank() == 0:
        move_into_place(staging, path, then=lambda: _write_atomically(os.path.join(root, TRACKER_FILE), str(iteration)))
    dist.barrier()
    return path


def move_into_place(staging: str, path: str, *, then=None) -> None:
    """Make the complete folder ``staging`` be ``path``: an existing ``path`` is moved aside (``.NAME.replaced``
    beside it) only now, ``staging`` renamed to ``path``, ``then()`` run (the tracker's update), the old one deleted.
    A kill at any instant leaves a complete ``path``, or the old one aside and the new one staged."""
    parent, name = os.path.split(os.path.normpath(path))
    replaced = os.path.join(parent, f".{name}.replaced")
    if os.path.isdir(replaced):
        shutil.rmtree(replaced)
    if os.path.isdir(path):
        os.rename(path, replaced)
    os.rename(staging, path)
    _fsync_dir(parent or ".")
    if then is not None:
        then()
    if os.path.isdir(replaced):
        shutil.rmtree(replaced)


_SIGNATURE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size", "moe_layer_freq", "qk_layernorm", "add_qkv_bias",
                     "normalization", "gated_linear_unit", "params_dtype")


def _digests(folder: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` of this rank's share of ``names`` (files in ``folder``): every
    world-size-th one, from this rank's index on."""
    out = {}
    for name in names[dist.get_rank()::dist.get_world_size()]:
        file = os.path.join(folder, name)
        out[name] = {"size": os.path.getsize(file), "sha256": _sha256(file)}
    return out


def _sha256(file: str) -> str:
    """SHA-256 of ``file``, read in 1 MiB blocks (``hashlib.file_digest`` needs Python 3.11)."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gather(part: dict) -> dict:
    """The union of every rank's ``part`` (the same on every rank)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def write_checksums(folder: str) -> None:
    """Write ``folder/checksums.json``: the size and SHA-256 of every file of the complete checkpoint ``folder``
    (all ranks' shards, on a file system every rank sees). Call on every rank. Cost: one more read of the
    checkpoint, split over the ranks (each hashes every world-size-th file): SHA-256 hashes about 1 GB/s on
    one core (1.05 GB/s measured on a shared 2-core CPU host), so a save takes about 1 s longer per GB each
    rank hashes, or the file system's read time where that is slower."""
    names = sorted(n for n in os.listdir(folder) if n != CHECKSUMS_FILE)
    files = _gather(_digests(folder, names))
    if dist.get_rank() == 0:
        with open(os.path.join(folder, CHECKSUMS_FILE), "w") as f:
            json.dump({"files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()


def verify_checksums(path: str) -> None:
    """ValueError naming the first file of checkpoint ``path`` that is missing, of another size or of another
    SHA-256 than ``path/checksums.json`` says (a truncated copy, a flipped byte); the files are split over the
    ranks as in :func:`write_checksums` (the same cost) and every rank raises the same error. A checkpoint
    without ``checksums.json`` (saved before they were written) is not checked."""
    manifest = os.path.join(path, CHECKSUMS_FILE)
    if not os.path.exists(manifest):
        return
    try:
        with open(manifest, "rb") as f:
            saved = json.load(f)["files"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise _damaged(path, CHECKSUMS_FILE, f"unreadable: {type(e).__name__}: {e}") from None
    problems = {}
    for name in sorted(saved)[dist.get_rank()::dist.get_world_size()]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems[name] = "missing"
            continue
        size = os.path.getsize(file)
        if size != saved[name]["size"]:
            problems[name] = f"{size} bytes, saved with {saved[name]['size']}: truncated or overwritten"
            continue
        if _sha256(file) != saved[name]["sha256"]:
            problems[name] = "its SHA-256 is not the one saved in checksums.json: its content changed after the save"
    problems = _gather(problems)
    if problems:
        name = min(problems)
        raise _damaged(path, name, problems[name])


def _damaged(path: str, name: str, why: str) -> ValueError:
    """The error for file ``name`` of checkpoint ``path`` being damaged (``why``), naming an earlier one to load."""
    root, this = os.path.split(os.path.abspath(path))
    n = int(this[5:]) if this.startswith("iter_") and this[5:].isdigit() else None
    earlier = [i for i in _complete_iterations(root) if i < n] if n is not None else []
    fix = (f"--load an earlier checkpoint, e.g. --load {iteration_dir(root, earlier[-1])}" if earlier else
           "no earlier checkpoint is beside it: start a new run without --load")
    return ValueError(f"--load {path}: {os.path.join(path, name)} is damaged ({why}); {fix}")


def _is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a dist checkpoint (has ``metadata.json``); ValueError (:func:`_damaged`) when that
    file is unreadable."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.check_is_distributed_checkpoint(path)
    except (ValueError, TypeError) as e:  # not JSON (empty, truncated) or not megatron-core's keys
        raise _damaged(path, "metadata.json", f"unreadable: {e}") from None


def model_signature(model: list) -> dict[str, str]:
    """What a checkpoint must match to be loaded into ``model``: vocabulary size, position embedding (RoPE base
    and share), and the ``TransformerConfig`` fields that shape its weights or dtype, as strings. Saved in
    ``common.pt``; :func:`load_checkpoint` refuses a checkpoint whose signature differs (the padded vocabulary,
    for one, lets a checkpoint of another vocabulary size load silently)."""
    from megatron.core.utils import unwrap_model

    chunk = unwrap_model(model)[0]
    rope = getattr(chunk, "rotary_pos_emb", None)
    rope = getattr(rope, "inner", rope)  # a tree model's TreeRotaryEmbedding wraps the upstream one
    signature = {name: repr(getattr(chunk.config, name, None)) for name in _SIGNATURE_FIELDS}
    signature.update(vocab_size=repr(getattr(chunk, "vocab_size", None)),
                     position_embedding_type=repr(getattr(chunk, "position_embedding_type", None)),
                     rotary=repr(None if rope is None else (len(rope.inv_freq), round(float(rope.inv_freq[-1]), 12))))
    return signature


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: a temporary file beside it, fsync, rename, fsync of the folder."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _complete_iterations(root: str) -> list[int]:
    """Iterations of the complete ``iter_NNNNNNN`` checkpoints under ``root``, ascending."""
    from megatron.core import dist_checkpointing

    found = []
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit():
            try:
                if dist_checkpointing.check_is_distributed_checkpoint(os.path.join(root, name)):
                    found.append(int(name[5:]))
            except (ValueError, TypeError):  # its metadata.json is damaged: not complete
                pass
    return sorted(found)


def saved_iteration(root: str) -> str | None:
    """The iteration ``root``'s tracker file names (as written), or None when ``root`` holds no run."""
    try:
        with open(os.path.join(root, TRACKER_FILE), errors="replace") as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def check_save_dir(save: str | None, load: str | None) -> None:
    """ValueError when ``save`` already holds a run and nothing is resumed: a fresh run would
    later point the tracker at a lower iteration than the ``iter_*`` folders left there."""
    if save is None or load is not None:
        return
    latest = saved_iteration(save)
    complete = _complete_iterations(save) if os.path.isdir(save) else []
    if latest is None and not complete:
        return
    held = latest if latest and latest.isdigit() else f"{complete[-1] if complete else '?'} (its {TRACKER_FILE} is damaged)"
    raise ValueError(f"--save {save} already holds checkpoints up to iteration {held}: pass --load {save} to "
                     f"resume, or choose an empty --save directory")


def resolve_checkpoint(path: str) -> str:
    """The dist checkpoint directory ``path`` names: itself, or ``path``'s latest ``iter_*``."""
    if _is_checkpoint(path):
        return path
    tracker = os.path.join(path, TRACKER_FILE)
    if not os.path.isfile(tracker):
        if os.path.isdir(path) and _complete_iterations(path):
            return _newest_complete(path, f"it has no {TRACKER_FILE}")
        raise ValueError(f"--load {path!r}: neither a checkpoint nor a directory with {TRACKER_FILE}; pass the "
                         f"--save directory of an earlier run or one of its iter_NNNNNNN folders")
    with open(tracker, errors="replace") as f:  # a tracker of binary garbage is stepped over as any other
        text = f.read().strip()
    if not text.isdigit():
        return _newest_complete(path, f"its {TRACKER_FILE} holds {text[:40]!r}, not an iteration")
    latest = iteration_dir(path, int(text))
    if not _is_checkpoint(latest):
        return _newest_complete(path, f"its {TRACKER_FILE} names {latest}, which is not a complete checkpoint")
    return latest


def _newest_complete(root: str, why: str) -> str:
    """The newest complete checkpoint under ``root`` (a warning says ``why`` the tracker was not followed)."""
    found = _complete_iterations(root)
    if not found:
        raise ValueError(f"--load {root!r}: {why}, and no complete iter_NNNNNNN checkpoint is there; pass a "
                         f"checkpoint folder, or start a new run without --load")
    chosen = iteration_dir(root, found[-1])
    warnings.warn(f"--load {root}: {why}; resuming from the newest complete checkpoint, {chosen}", stacklevel=3)
    return chosen


def load_checkpoint(path: str, model: list, optimizer, scheduler=None, critic=None) -> tuple[str, int, dict[str, Any], bool]:
    """Load model, optimizer, lr schedule (into ``scheduler``: its schedule must equal the saved one),
    PPO's ``critic`` (``(chunks, optimizer)``, as saved) and RNG state from ``path`` (see :func:`resolve_checkpoint`).
    Returns ``(checkpoint directory loaded, iteration, data position, whether the RNG state was restored)``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.utils import unwrap_model
    from torch.distributed.checkpoint.api import CheckpointException

    path = resolve_checkpoint(path)
    verify_checksums(path)
    in_shards = _common_state_in_shards(path)
    if not in_shards and not os.path.isfile(os.path.join(path, "common.pt")):
        raise _damaged(path, "common.pt", "missing")
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except (Exception, CheckpointException) as e:  # torch.load's errors of a damaged file (EOFError, ...); torch's
        if in_shards:  # CheckpointException (a BaseException) from the shards
            raise _does_not_load(path, e) from None
        raise _damaged(path, "common.pt", f"unreadable: {_first_cause(e)}") from None
    if common.get("has_critic", False) != (critic is not None):
        raise ValueError(f"--load {path}: the checkpoint {'holds a' if common.get('has_critic') else 'holds no'} PPO "
                         f"critic, but this run {'trains one' if critic is not None else 'does not'}; resume with "
                         f"the --loss it was saved with")
    saved, mine = common.get("distributed_optimizer", False), is_distributed_optimizer(optimizer)
    if saved != mine:
        raise ValueError(f"--load {path}: the checkpoint holds {'the distributed' if saved else 'a whole-model'} "
                         f"optimizer's state (saved {'with' if saved else 'without'} --use-distributed-optimizer), "
                         f"this run {'shards' if mine else 'does not shard'} it; resume "
                         f"{'with' if saved else 'without'} --use-distributed-optimizer")
    optimizers = [optimizer] + ([critic[1]] if critic is not None else [])
    for opt in optimizers:
        distributed_optimizer_state_for_load(opt)
    state = _sharded_state_dict(model, optimizer, is_loading=True, rng=None, critic=critic)
    saved = common.get("model_config")
    if saved is not None:  # checkpoints written before the signature was saved hold none
        wanted = model_signature(model)
        diff = [f"{k} {saved.get(k)} (this run: {v})" for k, v in wanted.items() if saved.get(k) != v]
        if diff:
            raise ValueError(f"--load {path}: the checkpoint does not fit this model: {'; '.join(diff)}; resume with "
                             f"the model config it was saved with")
    has_rng = common["world_size"] == dist.get_world_size()
    if not has_rng:
        del state["rng_state"]
    with warnings.catch_warnings():  # torch.distributed.checkpoint deprecations inside megatron-core's loader
        warnings.simplefilter("ignore", FutureWarning)
        try:
            loaded = dist_checkpointing.load(state, path)
        except (CheckpointingException, CheckpointException) as e:
            raise _does_not_load(path, e) from None
    for i, chunk in enumerate(unwrap_model(model)):
        _load_model_state(chunk, loaded["model" if len(model) == 1 else f"model{i}"], path)
    try:
        with torch.no_grad():  # the distributed optimizer copies fp32 weights into views of the parameters
            optimizer.load_state_dict(loaded["optimizer"])
    except ValueError as e:  # megatron-core 0.19 matches parameter groups by their lr / wd settings
        if scheduler is not None and "opt_param_scheduler" in common:
            _refuse_another_schedule(path, scheduler, common["opt_param_scheduler"])
        raise ValueError(f"--load {path}: the checkpoint's optimizer state does not fit this run's optimizer "
                         f"({str(e).strip().splitlines()[0][:160]}); resume with the optimizer settings it was saved "
                         f"with") from None
    if critic is not None:
        for i, chunk in enumerate(unwrap_model(critic[0])):
            _load_model_state(chunk, {k.removeprefix("critic."): v for k, v in loaded["critic"][str(i)].items()}, path)
        with torch.no_grad():
            critic[1].load_state_dict(loaded["critic_optimizer"])
    for opt in optimizers:
        distributed_optimizer_restore_steps(opt)
    if scheduler is not None and "opt_param_scheduler" in common:
        saved = common["opt_param_scheduler"]
        try:
            scheduler.load_state_dict(saved)
        except AssertionError:  # megatron-core asserts each schedule value equal to the checkpoint's
            _refuse_another_schedule(path, scheduler, saved)
            raise
    if has_rng:
        _set_rng_state(loaded["rng_state"])
    return path, int(common["iteration"]), common["data"], has_rng



def _refuse_another_schedule(path: str, scheduler, saved: dict) -> None:
    """One-line ValueError naming each lr-schedule value of this run that differs from the checkpoint's (``saved``);
    nothing when none does."""
    mine = scheduler.state_dict()
    diff = [f"{k} {saved.get(k)} (this run: {mine[k]})" for k in mine if k != "num_steps" and saved.get(k) != mine[k]]
    if diff:
        raise ValueError(f"--load {path}: the checkpoint's lr schedule differs from this run's: {'; '.join(diff)}; "
                         f"resume with the optimizer settings it was saved with")


def _load_model_state(chunk: torch.nn.Module, state: dict, path: str) -> None:
    """``chunk.load_state_dict`` that lets a module's ``_extra_state`` be absent from ``state``, and nothing else.

    Distributed checkpoints hold no ``_extra_state`` of modules that write none into them (megatron-core's
    ``TEDotProductAttention``, and :class:`~megatron_tree.mcore.core_attention.TreeCoreAttentionTE` in its
    place, keep theirs in torch state dicts only), so a strict load of a Transformer Engine model misses them.
    """
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"--load {path}: the checkpoint does not fit this model (missing {missing[:4]}, unexpected "
                         f"{list(result.unexpected_keys)[:4]}); resume with the model config it was saved with")


def _common_state_in_shards(path: str) -> bool:
    """Whether checkpoint ``path`` keeps its common state (``iteration``, ``data``, ...) inside its torch_dist shards
    (a ``common_state`` object: megatron-core 0.19 saves so) rather than in ``common.pt`` (0.16); False when its
    ``.metadata`` is unreadable (the load then names the damage)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:
        return False
    return any(key.split("/")[0] == "common_state" for key in keys)


def _does_not_load(path: str, error: Exception) -> ValueError:
    """The error for checkpoint ``path`` not loading (``error``: megatron-core's or torch's) into this model."""
    return ValueError(f"--load {path}: the checkpoint does not load into this model ({_first_cause(error)}): it was "
                      f"saved with another model config or parallel layout (resume with those), or a file of it is "
                      f"damaged")


def _first_cause(error: Exception) -> str:
    """First line of the error behind ``error`` (torch's CheckpointException wraps one per rank)."""
    failures = getattr(error, "failures", None)
    if failures:
        first = next(iter(failures.values()))  # (exception, stack summary)
        error = first[0] if isinstance(first, tuple) else first
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:160]}" if text else type(error).__name__

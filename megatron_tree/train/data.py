"""Rollout sources of the launcher: synthetic batches, or JSONL / Parquet files read as a stream.

A rollout file holds one sequence per line (JSONL) or row (Parquet)::

    input_ids     list[int]    required; token ids in [0, vocab), 1 <= len <= max_tokens_per_mb
    loss_mask     list[0|1]    optional, len(input_ids); 1 = train on this token (default: all)
    old_logprobs  list[float]  optional, len(input_ids); log p(token i | tokens < i) <= 0 under the
                               policy that sampled it (default: the current policy's, ratio 1)
    ref_logprobs  list[float]  optional, len(input_ids); same under the reference policy (KL term)
    group         int | str    optional; consecutive rows with one group id are one group
                               (the samples of a prompt); default: every row its own group
    reward        float        optional; GRPO advantages are computed from it per group
    advantage     float        optional; the sequence's advantage as given (wins over reward)
    images        list         optional; the sequence's images in prompt order (vision-language models: one run of
                               the model's image placeholder token per image), each
                               ``{"pixel_values": [[...]], "grid_thw": [t, h, w]}`` (the model's image processor
                               output for one image) or the path of a ``.npz`` file holding both arrays (relative
                               paths from the rollout file's directory)

Per-token fields are aligned with ``input_ids``: entry i is about token i, entry 0 is unused
(nothing predicts the first token). Other fields are ignored; a name close to one above
(``advantages``, ``input_id``) is refused as a likely typo. A step takes ``batch_size``
groups; at the end of the file the last step of the epoch takes what is left and the next
starts again from the top. Files are read row by row (Parquet by record batch), so a file
larger than memory works; the position (epoch, row, byte offset, path) is saved in checkpoints,
and resuming it with the other kind of source (synthetic vs a file) is refused.

Every rank reads the same batch (the launcher then splits it over data-parallel ranks).
Errors name the file, the line (JSONL) or row (Parquet, 1-based) and the field.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import numpy as np
import torch

from megatron_tree.core.synthetic import grpo_batch, multi_turn_batch
from megatron_tree.core.vision_packing import ImageInput

if TYPE_CHECKING:
    from megatron_tree.train.config import DataConfig

FIELDS = ("input_ids", "loss_mask", "old_logprobs", "ref_logprobs", "group", "reward", "advantage", "images")
TOKEN_FIELDS = ("loss_mask", "old_logprobs", "ref_logprobs")
PARQUET_ROWS_PER_READ = 1024


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One sequence. ``input_ids`` int64 [L]; ``loss_mask`` bool [L], ``old_logprobs`` /
    ``ref_logprobs`` float32 [L] or None (aligned with ``input_ids``, entry 0 unused);
    ``where``: "file line 3" for error messages."""

    input_ids: np.ndarray
    loss_mask: np.ndarray | None = None
    old_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    group: Any = None
    reward: float | None = None
    advantage: float | None = None
    images: list[ImageInput] | None = None
    where: str = ""


@dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    """One step's rollouts (identical on every rank). ``sequences``: n int64 arrays [L_k];
    ``advantages`` float64 [n] (per sequence; zeros when the loss needs none); the per-token
    lists hold n arrays [L_k] aligned with the sequences, or are None when no rollout carries
    the field. A rollout without a field another one has gets an all-true mask or NaN
    log-probs (NaN old log-probs: the current policy's). ``groups`` int64 [n]: each sequence's
    group, 0, 1, ... in order (a group's sequences are consecutive; mini-batches take whole groups). ``images``: n
    lists of each sequence's images, or None when no rollout carries any."""

    sequences: list[np.ndarray]
    advantages: np.ndarray
    groups: np.ndarray
    loss_mask: list[np.ndarray] | None
    old_logprobs: list[np.ndarray] | None
    ref_logprobs: list[np.ndarray] | None
    images: list[list[ImageInput]] | None = None


class RolloutSource(Protocol):
    """Yields one :class:`RolloutBatch` per step; its position survives a checkpoint."""

    def next_batch(self) -> RolloutBatch: ...

    def state(self) -> dict[str, Any]:
        """JSON-able position: what :meth:`restore` needs to continue with the next batch."""
        ...

    def restore(self, state: dict[str, Any]) -> None: ...


def grpo_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)`` [n] float64 of ``rewards`` [n] within
    their groups (``groups`` [n], any hashable ids); std with Bessel's correction (as TRL and
    verl); a group of one sequence gets 0."""
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    rewards = np.asarray(rewards, dtype=np.float64)
    mean = np.bincount(inverse, rewards) / counts
    centred = rewards - mean[inverse]
    var = np.bincount(inverse, centred**2) / np.maximum(counts - 1, 1)
    return np.where(counts[inverse] > 1, centred / (np.sqrt(var)[inverse] + eps), 0.0)


def make_batch(rollouts: list[Rollout], *, need_advantages: bool) -> RolloutBatch:
    """Stack ``rollouts`` into a batch; advantages as given, else from rewards per group."""
    n = len(rollouts)
    advantages = np.zeros(n)
    if need_advantages:
        given = np.array([r.advantage is not None for r in rollouts])
        if not given.all():
            missing = [r for r in rollouts if r.advantage is None and r.reward is None]
            if missing:
                raise ValueError(
                    f"{missing[0].where}: loss grpo needs 'advantage' or 'reward' (advantages are computed from "
                    f"rewards per group); add one, or train with --loss sft"
                )
            groups = np.array([str(r.group) if r.group is not None else f"\0{i}" for i, r in enumerate(rollouts)])
            rewards = np.array([np.nan if r.reward is None else r.reward for r in rollouts])
            no_reward = np.isnan(rewards)
            if no_reward.any():  # a group mixing given advantages and rewards: rewards must cover it
                needed = np.isin(groups, groups[~given])
                bad = np.flatnonzero(needed & no_reward)
                if bad.size:
                    raise ValueError(
                        f"{rollouts[bad[0]].where}: its group {rollouts[bad[0]].group!r} has rows without "
                        f"'advantage', so every row of it needs 'reward'"
                    )
            computed = grpo_advantages(np.nan_to_num(rewards), groups)
            advantages = np.where(given, [r.advantage or 0.0 for r in rollouts], computed)
        else:
            advantages = np.array([r.advantage for r in rollouts], dtype=np.float64)

    def per_token(name: str, fill: float) -> list[np.ndarray] | None:
        values = [getattr(r, name) for r in rollouts]
        if all(v is None for v in values):
            return None
        dtype = bool if name == "loss_mask" else np.float32
        return [np.full(len(r.input_ids), fill, dtype) if v is None else v for r, v in zip(rollouts, values)]

    keys = [("row", i) if r.group is None else ("group", r.group) for i, r in enumerate(rollouts)]
    return RolloutBatch(
        sequences=[r.input_ids for r in rollouts],
        advantages=advantages,
        groups=np.cumsum([0] + [a != b for a, b in zip(keys, keys[1:])], dtype=np.int64),
        loss_mask=per_token("loss_mask", True),
        old_logprobs=per_token("old_logprobs", np.nan),
        ref_logprobs=per_token("ref_logprobs", np.nan),
        images=[r.images or [] for r in rollouts] if any(r.images for r in rollouts) else None,
    )


def _source_kind(state: dict[str, Any]) -> str:
    """What a saved position was read from, in words (by its keys: ``step`` synthetic, ``epoch`` a file)."""
    if "epoch" in state:
        return f"rollouts from data.path {state['path']!r}" if "path" in state else "rollouts from a file (data.path)"
    if "step" in state:
        return "synthetic rollouts (no data.path)"
    return f"an unknown data source (position {state!r})"


def _check_position(state: dict[str, Any], key: str, current: str) -> None:
    """ValueError unless ``state`` (a checkpoint's data position) has ``key``: it was saved by the
    other kind of source, and its position means nothing to this one."""
    if key not in state:
        if "epoch" in state:
            fix = f"pass --data-path {state['path']}" if "path" in state else "pass the --data-path it was saved with"
        else:
            fix = "drop --data-path (data.path)"
        raise ValueError(f"the checkpoint was saved training on {_source_kind(state)}, but this run trains on "
                         f"{current}; {fix} to resume it, or start a new run without --load")


# --------------------------------------------------------------------------- synthetic


class SyntheticSource:
    """Synthetic GRPO or multi-turn batches (:mod:`megatron_tree.core.synthetic`) drawn from
    ``seed + step`` (``seed`` alone with ``same_batch_every_step``): the same on every rank.
    Reward = share of token ids below ``vocab / 2``; groups = prompts / conversations (multi_turn
    advantages are normalised over the whole batch)."""

    def __init__(self, data: DataConfig, *, vocab: int, seed: int, need_advantages: bool):
        self.data, self.vocab, self.seed, self.need_advantages = data, data.vocab or vocab, seed, need_advantages
        if self.vocab > vocab:
            raise ValueError(f"data.vocab={data.vocab} exceeds the model's vocabulary ({vocab}); lower it or drop it")
        self.step = 0

    def next_batch(self) -> RolloutBatch:
        d = self.data
        rng = np.random.default_rng(self.seed + (0 if d.same_batch_every_step else self.step))
        self.step += 1
        if d.workload == "grpo":
            seqs = grpo_batch(rng, n_prompts=d.batch_size, samples=d.samples, prompt_len=d.prompt_len,
                              response_len=d.response_len, vocab=self.vocab)
            groups = np.repeat(np.arange(d.batch_size), d.samples)
        else:  # one conversation at a time: the same draws as all at once
            conversations = [multi_turn_batch(rng, n_conversations=1, turns=d.turns, turn_len=d.turn_len,
                                              fork_prob=d.fork_prob, system_len=d.prompt_len[0], vocab=self.vocab)
                             for _ in range(d.batch_size)]
            seqs = [s for c in conversations for s in c]
            groups = np.repeat(np.arange(d.batch_size), [len(c) for c in conversations])
        rewards = np.array([float((s < self.vocab // 2).mean()) for s in seqs])
        advantages = [None] * len(seqs)
        if d.workload == "multi_turn" and self.need_advantages:
            advantages = grpo_advantages(rewards, np.zeros(len(seqs))).tolist()
        rollouts = [Rollout(input_ids=s, group=int(g), reward=float(r), advantage=a)
                    for s, g, r, a in zip(seqs, groups, rewards, advantages)]
        return make_batch(rollouts, need_advantages=self.need_advantages)

    def state(self) -> dict[str, Any]:
        return {"step": self.step}

    def restore(self, state: dict[str, Any]) -> None:
        _check_position(state, "step", "synthetic rollouts (no data.path)")
        self.step = int(state["step"])


# --------------------------------------------------------------------------- files


def _check_names(names: list[str], where: str) -> None:
    for name in names:
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.8)
            if close:
                raise ValueError(f"{where}: field {name!r} is not a rollout field; did you mean {close[0]!r}?")


def _token_array(value: Any, name: str, length: int | None, where: str) -> np.ndarray:
    """``value`` as a 1-D array of ``name``'s dtype (and ``length``), or ValueError naming ``where``."""
    kind = {"input_ids": "ints", "loss_mask": "0/1 values"}.get(name, "finite numbers")
    try:
        arr = np.asarray(value)
    except ValueError:
        arr = np.asarray([], dtype=object)
    if arr.ndim != 1 or arr.size == 0:
        ok = False
    elif name == "input_ids":
        ok = arr.dtype.kind in "iu"
    elif name == "loss_mask":
        ok = arr.dtype.kind in "biu" and bool(np.isin(arr, (0, 1)).all())
    else:
        ok = arr.dtype.kind in "iuf" and bool(np.isfinite(arr).all())
    if not ok:
        shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
        raise ValueError(f"{where}: field {name!r} must be a non-empty list of {kind}, got {shown}")
    if length is not None and arr.size != length:
        raise ValueError(f"{where}: field {name!r} has {arr.size} entries but input_ids has {length}; "
                         f"per-token fields are aligned with input_ids")
    if name in ("old_logprobs", "ref_logprobs") and (arr > 0).any():
        i = int(np.argmax(arr > 0))
        raise ValueError(f"{where}: field {name!r} entry {i} is {float(arr[i])} > 0, not a log-probability (log p <= 0); "
                         f"pass log p of each token, not p or -log p")
    return arr.astype({"input_ids": np.int64, "loss_mask": bool}.get(name, np.float32), copy=False)


def _scalar(value: Any, name: str, where: str) -> Any:
    if value is None:
        return None
    if name == "group":
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return value
        raise ValueError(f"{where}: field 'group' must be an int or a string, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ValueError(f"{where}: field {name!r} must be a finite number, got {value!r}")
    return float(value)


_IMAGE_FORM = ("each {'pixel_values': [[...]], 'grid_thw': [t, h, w]} (the model's image processor output for one "
               "image) or the path of a .npz file holding those two arrays")


def _image(item: Any, k: int, where: str, base_dir: str) -> ImageInput:
    """Image ``k`` of a rollout: an object, or a ``.npz`` path (relative to ``base_dir``)."""
    if isinstance(item, str):
        path = os.path.join(base_dir, item)
        if not path.endswith(".npz"):
            raise ValueError(f"{where}: image {k} {item!r} is not a .npz file; image files are not decoded here: run "
                             f"the model's image processor and save pixel_values and grid_thw with numpy.savez")
        try:
            with np.load(path) as f:
                item = {"pixel_values": f["pixel_values"], "grid_thw": f["grid_thw"]}
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{where}: image {k}: cannot read pixel_values and grid_thw from {path} ({e})") from None
    if not isinstance(item, dict) or set(item) != {"pixel_values", "grid_thw"}:
        shown = repr(item) if len(repr(item)) < 60 else repr(item)[:57] + "..."
        raise ValueError(f"{where}: image {k} is {shown}; field 'images' holds {_IMAGE_FORM}")
    try:
        pixels = torch.from_numpy(np.asarray(item["pixel_values"], dtype=np.float32))
        return ImageInput(pixels, tuple(np.asarray(item["grid_thw"]).reshape(-1).tolist()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: image {k}: {e}") from None


def parse_rollout(record: dict[str, Any], where: str, *, vocab: int, max_len: int | None,
                  base_dir: str = "") -> Rollout:
    """Validate one record (a JSON object or a Parquet row as Python values) into a :class:`Rollout`; ``max_len``:
    the longest sequence a micro-batch takes (None: any, trees larger than a micro-batch run in chunks);
    ``base_dir``: where relative image paths start."""
    if "input_ids" not in record or record["input_ids"] is None:
        raise ValueError(f"{where}: field 'input_ids' is missing; every rollout needs its token ids")
    ids = _token_array(record["input_ids"], "input_ids", None, where)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{where}: token id {bad} in 'input_ids' is outside the model's vocabulary [0, {vocab}); "
                         f"tokenize with the model's tokenizer")
    if max_len is not None and ids.size > max_len:
        raise ValueError(f"{where}: {ids.size} tokens, more than max_tokens_per_mb={max_len}; raise "
                         f"--max-tokens-per-mb, truncate the sequence, or run with --chunk-trees (pipeline and "
                         f"context parallel size 1)")
    fields = {name: _token_array(record[name], name, ids.size, where)
              for name in TOKEN_FIELDS if record.get(name) is not None}
    mask = fields.get("loss_mask")
    if mask is not None and not mask[1:].any():
        raise ValueError(f"{where}: field 'loss_mask' marks no token after the first, so the row trains nothing (the "
                         f"first token has no prediction); mark the tokens to train on (the response) or drop the row")
    scalars = {name: _scalar(record.get(name), name, where) for name in ("group", "reward", "advantage")}
    images = record.get("images")
    if images is not None and not isinstance(images, list):
        raise ValueError(f"{where}: field 'images' must be a list, {_IMAGE_FORM}; got {type(images).__name__}")
    images = [_image(item, k, where, base_dir) for k, item in enumerate(images or [])] or None
    return Rollout(input_ids=ids, **fields, **scalars, images=images, where=where)


def file_fingerprint(path: str, chunk: int = 1 << 16) -> dict[str, Any]:
    """``{"size", "sha256"}`` of ``path``: its size and a SHA-256 of its first and last ``chunk`` bytes (cheap for
    files of any size; a resumed run's data file must be the one its checkpoint's position points into)."""
    import hashlib

    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(chunk))
        if size > chunk:
            f.seek(max(size - chunk, chunk))
            digest.update(f.read(chunk))
    return {"size": size, "sha256": digest.hexdigest()}


class FileSource:
    """Rollouts from a ``.jsonl`` or ``.parquet`` file, ``batch_size`` groups per step, streamed.

    Position: ``{"epoch", "row", "offset", "path", "fingerprint"}`` of the first row not yet used (``offset``:
    its byte offset in a JSONL file; ``fingerprint``: :func:`file_fingerprint`, compared at restore). Rows of one
    group must be consecutive.
    """

    def __init__(self, path: str, *, batch_size: int, vocab: int, max_len: int | None, need_advantages: bool,
                 need_ref_logprobs: bool = False):
        self.path, self.batch_size, self.vocab, self.max_len = path, batch_size, vocab, max_len
        self.need_advantages, self.need_ref_logprobs = need_advantages, need_ref_logprobs
        self.parquet = path.endswith(".parquet")
        self.epoch, self.row, self.offset = 0, 0, 0
        self._rows: Iterator[tuple[int, int, Rollout]] | None = None
        self._pending: tuple[int, int, Rollout] | None = None
        if self.parquet:
            self._parquet_file()  # fail now on a missing pyarrow or a bad schema

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "row": self.row, "offset": self.offset, "path": self.path,
                "fingerprint": file_fingerprint(self.path)}

    def restore(self, state: dict[str, Any]) -> None:
        _check_position(state, "epoch", f"rollouts from data.path {self.path!r}")
        saved = state.get("fingerprint")  # positions saved before fingerprints were: path only
        if saved is not None and saved != file_fingerprint(self.path):
            raise ValueError(f"the checkpoint's data position (row {state['row']}, byte {state['offset']}) is in "
                             f"{state['path']!r} ({saved['size']} bytes), but data.path {self.path!r} is another file "
                             f"or changed since ({file_fingerprint(self.path)['size']} bytes): resume with the file it "
                             f"was saved with, or start a new run without --load")
        self.epoch, self.row, self.offset = int(state["epoch"]), int(state["row"]), int(state["offset"])
        self._rows, self._pending = None, None

    def next_batch(self) -> RolloutBatch:
        rollouts: list[Rollout] = []
        groups_seen: list[Any] = []
        from_top = self.row == 0 and self._pending is None
        while True:
            item = self._next_row()
            if item is None:  # end of file: this batch ends here, the next epoch starts at the top
                if not rollouts and self.row == 0:
                    raise ValueError(f"{self.path}: no rollouts in the file")
                if from_top and len(groups_seen) < self.batch_size:
                    raise ValueError(f"data.batch_size (--batch-size) {self.batch_size} is more groups than {self.path} "
                                     f"holds ({len(groups_seen)}): every step would be the whole file, short; pass "
                                     f"--batch-size {len(groups_seen)} or less")
                self.epoch, self.row, self.offset, self._rows = self.epoch + 1, 0, 0, None
                if rollouts:
                    break
                continue
            row, offset, r = item
            key = ("row", row) if r.group is None else ("group", r.group)
            if not groups_seen or key != groups_seen[-1]:
                if key in groups_seen:
                    raise ValueError(f"{r.where}: group {r.group!r} appeared earlier in this batch with other groups "
                                     f"in between; keep the rows of a group consecutive")
                if len(groups_seen) == self.batch_size:
                    self._pending = item  # first row of the next batch
                    break
                groups_seen.append(key)
            if self.need_ref_logprobs and r.ref_logprobs is None:
                raise ValueError(f"{r.where}: train.kl_coef > 0 needs 'ref_logprobs' in every rollout; add them or "
                                 f"set kl_coef 0")
            rollouts.append(r)
            self.row, self.offset = row + 1, offset
        return make_batch(rollouts, need_advantages=self.need_advantages)

    def _next_row(self) -> tuple[int, int, Rollout] | None:
        """(row, byte offset after it, rollout) of the next row, or None at the end of the file."""
        if self._pending is not None:
            item, self._pending = self._pending, None
            return item
        if self._rows is None:
            self._rows = self._parquet_rows() if self.parquet else self._jsonl_rows()
        return next(self._rows, None)

    def _jsonl_rows(self) -> Iterator[tuple[int, int, Rollout]]:
        row = self.row
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                offset = f.tell()
                where = f"{self.path} line {row + 1}"
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                    except UnicodeDecodeError as e:
                        raise ValueError(f"{where}: not JSON text (it holds byte {e.object[e.start]:#04x}, not UTF-8); "
                                         f"--data-path takes a JSONL file, one JSON object per line") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{where}: expected a JSON object with 'input_ids', got {line[:40]!r}")
                    _check_names(list(record), where)
                    yield row, offset, parse_rollout(record, where, vocab=self.vocab, max_len=self.max_len,
                                                     base_dir=os.path.dirname(self.path))
                row += 1

    def _parquet_file(self):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"reading {self.path} needs pyarrow: pip install pyarrow (or use a .jsonl file)") from None
        try:
            f = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{self.path}: not a readable Parquet file ({e}); write it again") from None
        names = f.schema_arrow.names
        _check_names(names, self.path)
        if "input_ids" not in names:
            raise ValueError(f"{self.path}: no 'input_ids' column (columns: {names}); every rollout needs its token ids")
        return f

    def _parquet_rows(self) -> Iterator[tuple[int, int, Rollout]]:
        import pyarrow as pa

        f = self._parquet_file()
        columns = [c for c in FIELDS if c in f.schema_arrow.names]
        # Skip whole row groups before the saved row, then the rest of the first one read.
        skip, groups = self.row, []
        for i in range(f.num_row_groups):
            n = f.metadata.row_group(i).num_rows
            if skip >= n and not groups:
                skip -= n
                continue
            groups.append(i)
        row = self.row
        try:
            for batch in f.iter_batches(batch_size=PARQUET_ROWS_PER_READ, row_groups=groups, columns=columns):
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                for record in batch.slice(skip).to_pylist():
                    yield row, 0, parse_rollout(record, f"{self.path} row {row + 1}", vocab=self.vocab,
                                                max_len=self.max_len, base_dir=os.path.dirname(self.path))
                    row += 1
                skip = 0
        except (pa.ArrowException, OSError) as e:  # pyarrow's errors of damaged data (ours are plain ValueErrors)
            raise ValueError(f"{self.path}: damaged Parquet data, reading from row {row + 1} ({e}); write the file "
                             f"again") from None


def open_rollout_source(data: DataConfig, *, vocab: int, max_len: int | None, seed: int, need_advantages: bool,
                        need_ref_logprobs: bool = False) -> RolloutSource:
    """The source ``data`` (:class:`~megatron_tree.train.config.DataConfig`) describes."""
    if data.path is None:
        return SyntheticSource(data, vocab=vocab, seed=seed, need_advantages=need_advantages)
    return FileSource(data.path, batch_size=data.batch_size, vocab=vocab, max_len=max_len,
                      need_advantages=need_advantages, need_ref_logprobs=need_ref_logprobs)

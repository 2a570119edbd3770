"""Checkpoints: a resumed run reproduces the uninterrupted run exactly (one process, and PP=2 with
interleaving over torchrun); --export-hf writes a checkpoint transformers loads, and training on
from it continues where the exporting run stopped."""

import json

import pytest

from dist_utils import REPO_ROOT, TorchrunCases
from examples.make_rollouts import make_rollouts, write_rollouts
from megatron_tree.train.__main__ import main

LAUNCHER = REPO_ROOT / "examples" / "train_tree.py"
CONFIG = str(REPO_ROOT / "configs" / "tiny_qwen3.yaml")


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def exact(recs):
    return [(r["step"], r["loss"], r["grad_norm"], r["original_tokens"]) for r in recs]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "rollouts.jsonl")
    write_rollouts(make_rollouts(prompts=5), path)
    return path


def test_resumed_run_equals_the_uninterrupted_one(tmp_path, rollouts):
    """A rollout file (loss on the response tokens), 3 groups a step over 5 groups (steps cross the end of the file)."""
    common = ["--config", CONFIG, "--data-path", rollouts, "--batch-size", "3", "--steps", "5",
              "--lr", "0.01"]
    assert main([*common, "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                 "--log-jsonl", str(tmp_path / "full.jsonl")]) == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "iter_0000002", "iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"]
    assert main([*common, "--load", str(tmp_path / "ckpt" / "iter_0000002"),
                 "--log-jsonl", str(tmp_path / "resumed.jsonl")]) == 0
    full, resumed = records(tmp_path / "full.jsonl"), records(tmp_path / "resumed.jsonl")
    assert exact(resumed) == exact(full[2:])
    assert len({r["loss"] for r in full}) == 5  # the model moves: equality is not trivial


PARALLEL = {"pp2-vpp2": ["--pp", "2", "--vpp", "2"], "cp2": ["--cp", "2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per layout, in one torchrun job (dist_utils.TorchrunCases): 4 steps uninterrupted, saving every 2; the
    same run resumed from its step-2 checkpoint up to step 4, saving again."""
    tmp = tmp_path_factory.mktemp("resume")
    cases = {}
    for layout, parallel in PARALLEL.items():
        common = ["--config", "configs/tiny_qwen3_4layers.yaml", *parallel, "--no-progress", "--save-interval", "2"]
        save = str(tmp / f"{layout}-ckpt")
        for part, args in (("full", ["--steps", "4", "--save", save]),
                           ("resumed", ["--steps", "4", "--save", "{tmp}", "--load", f"{save}/iter_0000002"])):
            cases[f"{layout}-{part}"] = ("test_resume_with_model_parallel", 2, str(LAUNCHER),
                                         [*common, *args, "--log-jsonl", f"{tmp}/{layout}-{part}.jsonl"])
    return TorchrunCases(cases, tmp)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", PARALLEL)
def test_resume_with_model_parallel(runs, request, layout):
    """The README's PP=2 x VPP=2 command (and CP=2) with checkpoints every 2 steps, resumed from the latest."""
    for part in ("full", "resumed"):
        runs.output(request, f"{layout}-{part}")
    full, resumed = (records(runs.tmp / f"{layout}-{part}.jsonl") for part in ("full", "resumed"))
    assert exact(resumed) == exact(full[2:])


def test_export_hf_loads_in_transformers_and_training_continues_from_it(tmp_path):
    """A run of 3 steps equals 2 steps, export, then 1 step from the export (same batch every step:
    the third step's loss is computed by the weights the export holds)."""
    from transformers import AutoModelForCausalLM

    base = ["--config", CONFIG, "--lr", "0.01"]
    assert main([*base, "--steps", "3", "--log-jsonl", str(tmp_path / "three.jsonl")]) == 0
    assert main([*base, "--steps", "2", "--export-hf", str(tmp_path / "hf")]) == 0
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert main(["--config", CONFIG, "--hf-path", str(tmp_path / "hf"), "--steps", "1",
                 "--log-jsonl", str(tmp_path / "one.jsonl")]) == 0
    three, one = records(tmp_path / "three.jsonl"), records(tmp_path / "one.jsonl")
    assert one[0]["loss"] == pytest.approx(three[2]["loss"], rel=1e-6)
    assert three[2]["loss"] < three[0]["loss"] - 0.5


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path, capsys):
    assert main(["--config", CONFIG, "--steps", "1", "--save", str(tmp_path)]) == 0
    assert main(["--config", str(REPO_ROOT / "configs" / "tiny_qwen3_4layers.yaml"), "--load", str(tmp_path),
                 "--steps", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "iter_0000001: the checkpoint does not fit this model: num_layers 2 (this run: 4);" in err, err


def test_resuming_with_the_other_kind_of_data_is_refused_in_one_line(tmp_path, rollouts, capsys):
    """A checkpoint's data position belongs to its source: a file's (epoch, row, offset) means nothing to the
    synthetic source and the other way round; both directions are refused, naming both sources."""
    first, resume = ["--config", CONFIG, "--steps", "1"], ["--config", CONFIG, "--steps", "2"]
    assert main([*first, "--save", str(tmp_path / "synthetic")]) == 0
    assert main([*resume, "--load", str(tmp_path / "synthetic"), "--data-path", rollouts]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"megatron-tree-train: error: --load {tmp_path}/synthetic/iter_0000001: the checkpoint was saved "
                   f"training on synthetic rollouts (no data.path), but this run trains on rollouts from data.path "
                   f"{rollouts!r}; drop --data-path (data.path) to resume it, or start a new run without --load"), err
    assert main([*first, "--data-path", rollouts, "--save", str(tmp_path / "file")]) == 0
    assert main([*resume, "--load", str(tmp_path / "file")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"megatron-tree-train: error: --load {tmp_path}/file/iter_0000001: the checkpoint was saved "
                   f"training on rollouts from data.path {rollouts!r}, but this run trains on synthetic rollouts "
                   f"(no data.path); pass --data-path {rollouts} to resume it, or start a new run without --load"), err


class _Killed(Exception):
    """Stands for the process dying at that instant (the files are left as they are)."""


def _kill_at(monkeypatch, owner, name):
    def die(*args, **kwargs):
        raise _Killed(name)

    monkeypatch.setattr(owner, name, die)


@pytest.mark.parametrize("moment", ["shards", "tracker rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoints_and_tracker(tmp_path, monkeypatch, moment):
    """Resumed from iter 1 into a --save whose tracker names 2, the re-save of 2 is killed while its shards are
    written, or just before the tracker's rename: iter_0000002 and the tracker stay as they were, and --load DIR
    resumes from them with the uninterrupted run's numbers."""
    import megatron.core.dist_checkpointing as dist_checkpointing

    from megatron_tree.train import checkpoint

    save, common = tmp_path / "ckpt", ["--config", CONFIG, "--lr", "0.01"]
    saving = ["--save", str(save), "--save-interval", "1"]
    assert main([*common, *saving, "--steps", "3", "--log-jsonl", str(tmp_path / "full.jsonl")]) == 0
    before = sorted(p.name for p in (save / "iter_0000002").iterdir())
    with monkeypatch.context() as m:
        _kill_at(m, *((dist_checkpointing, "save") if moment == "shards" else (checkpoint.os, "replace")))
        with pytest.raises(_Killed):
            main([*common, *saving, "--steps", "2", "--load", str(save / "iter_0000001")])
    assert (save / checkpoint.TRACKER_FILE).read_text() == "3"
    assert sorted(p.name for p in (save / "iter_0000002").iterdir()) == before
    assert checkpoint.resolve_checkpoint(str(save)) == str(save / "iter_0000003")
    assert main([*common, "--steps", "3", "--load", str(save / "iter_0000002"),
                 "--log-jsonl", str(tmp_path / "resumed.jsonl")]) == 0
    assert exact(records(tmp_path / "resumed.jsonl")) == exact(records(tmp_path / "full.jsonl")[2:])


@pytest.mark.parametrize("tracker", [b"", b"garbage", b"9", b"\x00\xff\x12 binary"])
def test_a_damaged_tracker_falls_back_to_the_newest_complete_checkpoint(saved, tmp_path, tracker):
    """An empty or garbled tracker, or one naming a checkpoint that is not there: --load DIR resumes from the
    newest complete iter_* with a warning, and a fresh --save DIR still refuses to start over it."""
    from megatron_tree.train import checkpoint

    import shutil

    save = tmp_path / "ckpt"
    shutil.copytree(saved, save)
    (save / checkpoint.TRACKER_FILE).write_bytes(tracker)
    with pytest.warns(UserWarning, match="resuming from the newest complete checkpoint, .*iter_0000002"):
        assert checkpoint.resolve_checkpoint(str(save)) == str(save / "iter_0000002")
    with pytest.raises(ValueError, match="already holds checkpoints up to iteration"):
        checkpoint.check_save_dir(str(save), None)


def test_a_checkpoint_of_another_vocabulary_is_refused_naming_it(tmp_path, capsys):
    """vocab 160 and 200 pad to the same embedding shape, so the shards load; the saved signature refuses it."""
    other = tmp_path / "vocab200.yaml"
    other.write_text(open(CONFIG).read().replace("vocab_size: 160", "vocab_size: 200"))
    assert main(["--config", CONFIG, "--steps", "1", "--save", str(tmp_path / "ckpt")]) == 0
    assert main(["--config", str(other), "--load", str(tmp_path / "ckpt"), "--steps", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the checkpoint does not fit this model: vocab_size 160 (this run: 200)" in err, err


def test_export_into_an_earlier_export_is_refused_or_replaces_it_whole(tmp_path, capsys):
    """An earlier export's single-file weights beside the new shards would be what transformers loads: a non-empty
    --export-hf directory is refused before training, and with --export-overwrite nothing of the old export is left."""
    from transformers import AutoModelForCausalLM

    export, base = tmp_path / "hf", ["--config", CONFIG, "--lr", "0.01"]
    assert main([*base, "--steps", "1", "--export-hf", str(export)]) == 0
    (export / "stale.safetensors").write_bytes(b"old")
    assert main([*base, "--steps", "2", "--export-hf", str(export)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is not empty" in err and "--export-overwrite" in err, err
    assert main([*base, "--steps", "2", "--export-hf", str(export), "--export-overwrite",
                 "--log-jsonl", str(tmp_path / "two.jsonl")]) == 0
    assert not (export / "stale.safetensors").exists() and not list(tmp_path.glob(".hf*")) and not list(
        tmp_path.glob("hf.exporting"))
    _, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_resuming_on_another_data_file_is_refused(tmp_path, rollouts, capsys):
    """The saved byte offset means nothing in another file (a false parse error or a silent restart): the file's
    fingerprint (size, hash of its ends) is saved with the position and compared at load."""
    other = str(tmp_path / "other.jsonl")
    write_rollouts(make_rollouts(prompts=6), other)
    common = ["--config", CONFIG, "--batch-size", "3"]
    assert main([*common, "--data-path", rollouts, "--steps", "1", "--save", str(tmp_path / "ckpt")]) == 0
    assert main([*common, "--data-path", other, "--steps", "2", "--load", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"is in {rollouts!r}" in err and f"but data.path {other!r} is another file or changed since" in err, err


def test_resume_continues_the_lr_schedule_and_refuses_another(tmp_path, capsys):
    """The checkpoint holds megatron-core's OptimizerParamScheduler: 2 steps saved and resumed to 4 repeat the
    uninterrupted cosine run's lrs, losses and grad norms; resuming under another schedule is refused in one line."""
    sched = ["--config", CONFIG, "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--lr-decay-iters", "4",
             "--min-lr", "1e-4"]
    assert main([*sched, "--steps", "4", "--log-jsonl", str(tmp_path / "full.jsonl")]) == 0
    assert main([*sched, "--steps", "2", "--save", str(tmp_path / "ckpt")]) == 0
    assert main([*sched, "--steps", "4", "--load", str(tmp_path / "ckpt"), "--log-jsonl", str(tmp_path / "res.jsonl")]) == 0
    full, resumed = records(tmp_path / "full.jsonl"), records(tmp_path / "res.jsonl")
    assert [(r["lr"], *e) for r, e in zip(resumed, exact(resumed))] == [(r["lr"], *e) for r, e in zip(full[2:], exact(full[2:]))]
    assert main([*sched[:-2], "--min-lr", "2e-4", "--steps", "4", "--load", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the checkpoint's lr schedule differs from this run's: min_lr 0.0001 (this run: 0.0002)" in err, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 2 steps saved after each (iter_0000001, iter_0000002): the damage tests copy it."""
    save = tmp_path_factory.mktemp("saved") / "ckpt"
    assert main(["--config", CONFIG, "--steps", "2", "--save", str(save), "--save-interval", "1"]) == 0
    return save


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


LAST_SHARD, COMMON_STATE = "the last __*.distcp", "common.pt, or the last shard"  # megatron-core 0.19 writes one
# shard here and keeps the common state in it (no common.pt); 0.16 writes two shards and common.pt


def _damaged_file(checkpoint, name):
    shards = sorted(checkpoint.glob("__*.distcp"))
    if name == COMMON_STATE:
        return checkpoint / "common.pt" if (checkpoint / "common.pt").exists() else shards[-1]
    return shards[-1] if name == LAST_SHARD else checkpoint / name


DAMAGE = {  # file of iter_0000002 -> (what is done to it, what the error says of it)
    "flipped byte": ("__0_0.distcp", _flip, "its SHA-256 is not the one saved in checksums.json"),
    "truncated shard": (LAST_SHARD, lambda p: p.write_bytes(p.read_bytes()[:1000]), "1000 bytes, saved with"),
    "empty shard": ("__0_0.distcp", lambda p: p.write_bytes(b""), "0 bytes, saved with"),
    "missing common.pt": (COMMON_STATE, lambda p: p.unlink(), "missing"),
    "empty metadata.json": ("metadata.json", lambda p: p.write_bytes(b""), "unreadable: Expecting value"),
    "no checksums, truncated shard": ("__0_0.distcp", lambda p: (p.with_name("checksums.json").unlink(),
                                                                 p.write_bytes(p.read_bytes()[:1000])), None),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(saved, tmp_path, capsys, case):
    """Every file of a checkpoint has its size and SHA-256 in checksums.json, verified at load: a flipped byte (which
    loads silently otherwise), a truncated or empty shard, a missing common.pt or a damaged metadata.json is one line
    naming the file and the earlier checkpoint to load. A checkpoint without checksums.json (saved before them) is
    not verified; torch's EOFError is then named (our message had an IndexError of its own)."""
    import shutil

    name, damage, why = DAMAGE[case]
    save = tmp_path / "ckpt"
    shutil.copytree(saved, save)
    target = _damaged_file(save / "iter_0000002", name)
    damage(target)
    name = target.name
    assert main(["--config", CONFIG, "--steps", "3", "--load", str(save)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    if why is None:
        assert err[-1].startswith(f"megatron-tree-train: error: --load {save}/iter_0000002: the checkpoint does not "
                                  f"load into this model (EOFError"), err  # 0.19 adds ": Ran out of input"
        assert err[-1].endswith("): it was saved with another model config or parallel layout (resume with those), or "
                                "a file of it is damaged"), err
        return
    assert err[-1].startswith(f"megatron-tree-train: error: --load {save}/iter_0000002: {save}/iter_0000002/{name} "
                              f"is damaged ({why}"), err
    assert err[-1].endswith(f"; --load an earlier checkpoint, e.g. --load {save}/iter_0000001"), err


def test_ppo_resume_carries_the_critic_and_its_optimizer(tmp_path, capsys):
    """--loss ppo: checkpoints hold the critic and its optimizer besides the actor; 2 steps saved and resumed to 4
    give the uninterrupted run's actor and critic losses and grad norms; a run without a critic refuses them."""
    common = ["--config", CONFIG, "--loss", "ppo", "--batch-size", "2", "--lr", "0.01"]
    assert main([*common, "--steps", "4", "--log-jsonl", str(tmp_path / "full.jsonl")]) == 0
    assert main([*common, "--steps", "2", "--save", str(tmp_path / "ckpt")]) == 0
    assert main([*common, "--steps", "4", "--load", str(tmp_path / "ckpt"), "--log-jsonl", str(tmp_path / "res.jsonl")]) == 0
    keys = ("step", "loss", "grad_norm", "critic_loss", "critic_grad_norm", "kl_mean", "score_mean")
    full, resumed = records(tmp_path / "full.jsonl"), records(tmp_path / "res.jsonl")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full[2:]]
    assert len({r["critic_loss"] for r in full}) == 4  # the critic moves: equality is not trivial
    assert main(["--config", CONFIG, "--steps", "4", "--load", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "iter_0000002: the checkpoint holds a PPO critic, but this run does not; resume with the --loss it" in err, err

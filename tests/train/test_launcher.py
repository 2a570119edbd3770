"""The launcher (megatron_tree.train) runs end to end on CPU; its config is validated with clear errors."""

import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
import yaml

from dist_utils import REPO_ROOT, TorchrunCases, cpu_env, run_python
from examples.make_rollouts import make_rollouts, write_rollouts
from megatron_tree.train.__main__ import FLAGS, build_parser, main, report_error
from megatron_tree.train.config import RunConfig
from megatron_tree.train.trainer import Trainer, check_expert_parallel, check_layers

LAUNCHER = REPO_ROOT / "examples" / "train_tree.py"


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_launcher_trains_and_loss_goes_down(tmp_path):
    out = tmp_path / "run.jsonl"
    proc = run_python(LAUNCHER, ["--config", "configs/tiny_qwen3.yaml", "--steps", "4", "--no-progress", "--log-jsonl", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(out)
    assert len(recs) == 4
    losses = [r["loss"] for r in recs]
    assert losses[-1] < losses[0] - 0.3, losses
    assert 0 < recs[0]["tree_token_ratio"] < 0.8  # GRPO batch: prefixes are shared


CP_ARGS = ["--config", "configs/tiny_qwen3.yaml", "--steps", "2", "--batch-size", "2", "--no-progress"]
FOUR = {"tp2xpp2": ("tiny_qwen3.yaml", ["--tp", "2", "--pp", "2"]),
        "ep2xpp2-moe": ("tiny_qwen3_moe.yaml", ["--ep", "2", "--pp", "2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's multi-process launcher runs, one torchrun job per process count (dist_utils.TorchrunCases)."""
    launcher = str(LAUNCHER)
    cases = {"dp2": ("test_launcher_dp2_balances_ranks", 2, launcher,
                     ["--config", "configs/tiny_qwen3.yaml", "--steps", "2", "--no-progress", "--log-jsonl", "{tmp}.jsonl"])}
    for loss in ("grpo", "ppo"):
        for n in (1, 2):
            cases[f"cp{n}-{loss}"] = ("test_launcher_context_parallel_equals_one_rank", n, launcher,
                                      [*CP_ARGS, "--loss", loss, "--log-jsonl", "{tmp}.jsonl", *(["--cp", "2"] if n == 2 else [])])
    cases["cp2-ppo-forward"] = ("test_launcher_forward_micro_batches_under_context_parallel", 2, launcher,
                                [*CP_ARGS, "--loss", "ppo", "--cp", "2", "--max-tokens-per-mb", "64",
                                 "--forward-max-tokens-per-mb", "4096", "--log-jsonl", "{tmp}.jsonl"])
    for n in (1, 2):  # several updates per rollout batch, each mini-batch balanced over DP ranks on its own
        cases[f"mini-dp{n}"] = ("test_launcher_mini_batches_dp2_equal_one_rank", n, launcher,
                                [*CP_ARGS[:2], "--steps", "4", "--batch-size", "4", "--no-progress", "--loss", "grpo",
                                 "--ppo-epochs", "2", "--ppo-mini-batches", "2", "--log-jsonl", "{tmp}.jsonl"])
    for case, (config, args) in FOUR.items():
        cases[case] = ("test_launcher_four_processes", 4, launcher,
                       ["--config", f"configs/{config}", "--steps", "2", "--no-progress", "--log-jsonl", "{tmp}.jsonl", *args])
    return TorchrunCases(cases, tmp_path_factory.mktemp("launcher"))


def _records_of(runs, request, case):
    runs.output(request, case)
    return records(runs.tmp / f"{case}.jsonl")


@pytest.mark.multiprocess
def test_launcher_dp2_balances_ranks(runs, request):
    for rec in _records_of(runs, request, "dp2"):
        a, b = rec["dp_micro_batches"]
        assert a == b, rec
        assert rec["dp_tree_token_imbalance"] < 1.2, rec


@pytest.mark.multiprocess
@pytest.mark.parametrize("loss", ["grpo", "ppo"])
def test_launcher_context_parallel_equals_one_rank(runs, request, loss):
    """--cp 2 (each micro-batch's slots over two ranks) logs the one-process run's losses and grad norms."""
    one, two = (_records_of(runs, request, f"cp{n}-{loss}") for n in (1, 2))
    keys = ["loss", "loss_tokens", "grad_norm", "tree_tokens"] + (["critic_loss", "critic_grad_norm"] if loss == "ppo" else [])
    for a, b in zip(one, two, strict=True):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a[key], b[key])
        assert "cp_pair_imbalance" not in a and b["cp_pair_imbalance"] < 1.1 and len(b["cp_rank_pairs"]) == 2


@pytest.mark.multiprocess
def test_launcher_forward_micro_batches_under_context_parallel(runs, request):
    """--cp 2 with updates in micro-batches of 64 slots (prefix groups split: chunks need CP = 1) and PPO's
    forward-only passes in one micro-batch of up to 4096: the one-process run's numbers (one packing of 256 there)."""
    one, fwd = (_records_of(runs, request, case) for case in ("cp1-ppo", "cp2-ppo-forward"))
    for a, b in zip(one, fwd, strict=True):
        assert b["forward_micro_batches"] == 1 < b["micro_batches"], b
        for key in ("loss", "grad_norm", "critic_loss", "critic_grad_norm", "score_mean", "kl_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a[key], b[key])


@pytest.mark.multiprocess
def test_launcher_mini_batches_dp2_equal_one_rank(runs, request):
    """--ppo-epochs 2 --ppo-mini-batches 2 over DP = 2 (each mini-batch split over the ranks by tree cost, old
    log-probs on the rank that trains the sequence) logs the one-process run's numbers."""
    one, two = (_records_of(runs, request, f"mini-dp{n}") for n in (1, 2))
    assert len(one) == 4 and len({r["loss"] for r in one}) == 4
    for a, b in zip(one, two, strict=True):
        for key in ("loss_tokens", "grad_norm", "tree_tokens", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a[key], b[key])
        # the GRPO loss is a mean of +-advantage terms of size ~1 that cancel to ~1e-2: fp32 noise on the terms
        # (another summation order after an Adam step: measured 5.5e-7) is absolute
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (a["loss"], b["loss"])
        assert len(b["dp_micro_batches"]) == 2


@pytest.mark.parametrize("case", FOUR)
@pytest.mark.multiprocess
def test_launcher_four_processes(runs, request, case):
    """The four-GPU job's code path (TP x PP, EP x PP MoE), scaled down to 4 gloo processes."""
    recs = _records_of(runs, request, case)
    assert len(recs) == 2 and all(np.isfinite(r["loss"]) for r in recs)


def test_yaml_configs_load(tmp_path):
    """Every config the repository ships validates (a typo in one the README or a benchmark names fails here); the
    rollout files the vision-language ones read are written by their example first, so any file stands in here."""
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("")
    paths = sorted((REPO_ROOT / "configs").glob("*.yaml"))
    assert {"tiny_qwen3.yaml", "ppo_qwen3_0.6b_shape.yaml", "ppo_qwen3_1.7b_shape.yaml"} <= {p.name for p in paths}
    for path in paths:
        reads_file = (yaml.safe_load(path.read_text()).get("data") or {}).get("path")
        cfg = RunConfig.from_yaml(str(path), overrides={"data": {"path": str(rollouts)}} if reads_file else None)
        assert cfg.micro_batch.max_tokens_per_mb > 0


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"trainer": {}}, "unknown section(s) ['trainer']"),
        ({"train": {"stepz": 3}}, "train: unknown key(s) ['stepz']"),
        ({"train": {"recompute": "partial"}}, "train.recompute must be one of"),
        ({"train": {"tree_training": "yes"}}, "train.tree_training must be true or false"),
        ({"parallel": {"tp": 0}}, "parallel.tp must be an int >= 1"),
        ({"parallel": {"vpp": 2}}, "parallel.vpp must be null or an int >= 2 with pp >= 2"),
        ({"micro_batch": {"max_tokens_per_mb": -1}}, "max_tokens_per_mb must be a positive int"),
        ({"micro_batch": {"n_mbs": 2}}, "needs max_tokens_per_mb"),
        ({"model": {"arch": "gpt2"}}, "model.arch must be one of"),
        ({"data": {"prompt_len": [5, 2]}}, "data.prompt_len must be [lo, hi]"),
        ({"data": {"prompt_len": 5}}, "data.prompt_len must be a list [an int, an int], got 5"),
        ({"train": {"lr": "fast"}}, "train.lr must be a number, got 'fast'"),
        ({"train": {"lr": float("inf")}}, "train.lr must be a finite number, got inf"),  # YAML .inf
        ({"train": [1]}, "train must be a mapping"),
        ({"model": {"hf_overrides": {"hiden_size": 64}}}, "did you mean 'hidden_size' for 'hiden_size'?"),
        ({"model": {"hf_overrides": {"hidden_size": "big"}}}, "model.hf_overrides: Validation error for field 'hidden_size'"),
        ({"model": {"hf_path": "/nonexistent"}}, "model.hf_path '/nonexistent' is not a Hugging Face checkpoint"),
        ({"checkpoint": {"save_interval": 2}}, "checkpoint.save_interval needs checkpoint.save"),
        ({"model": {"random_init": True}, "checkpoint": {"export_hf": "x"}}, "export_hf needs a model built from"),
        ({"train": {"kl_coef": 0.1}}, "train.kl_coef=0.1 applies to losses grpo and ppo only"),
        ({"data": {"path": "rollouts.csv"}}, "data.path must be a file ending in .jsonl or .parquet"),
        ({"logging": {"wandb_mode": "cloud"}}, "logging.wandb_mode must be one of"),
        ({"model": {"hf_overrides": {"hidden_size": -64}}}, "model.hf_overrides.hidden_size is -64, but a model "
                                                            "needs an int >= 1 there"),
        ({"model": {"hf_overrides": {"num_hidden_layers": 0}}}, "model.hf_overrides.num_hidden_layers is 0"),
        ({"model": {"hf_overrides": {"vocab_size": 0}}}, "model.hf_overrides.vocab_size is 0"),
        ({"train": {"seed": -1}}, "train.seed must be an int in [0, 2**32 - 1] (NumPy's seed range), got -1"),
        ({"train": {"steps": 5, "ppo_epochs": 2}}, "train.steps=5 counts optimizer updates and must be a multiple of "
                                                   "train.ppo_epochs * train.ppo_mini_batches = 2 * 1"),
        ({"train": {"ppo_mini_batches": 2, "steps": 6}, "checkpoint": {"save": "x", "save_interval": 3}},
         "checkpoint.save_interval=3 counts optimizer updates"),
        ({"train": {"ppo_mini_batches": 5}}, "train.ppo_mini_batches=5 is more than data.batch_size=4 groups"),
    ],
)
def test_bad_config_values_are_named(raw, message):
    with pytest.raises(ValueError) as e:
        RunConfig.from_dict(raw, source="cfg.yaml")
    assert message in str(e.value) and "cfg.yaml" in str(e.value)


def test_malformed_yaml_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  arch: qwen3\n hf_overrides: [\n")
    with pytest.raises(ValueError, match=r"bad.yaml: not valid YAML at line 3, column 2"):
        RunConfig.from_yaml(str(bad))


def test_a_binary_config_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_bytes(b"\x80\x81 model weights, not YAML")
    with pytest.raises(ValueError, match=r"run.yaml: not a YAML text file \(it holds byte 0x80, not UTF-8 text\)"):
        RunConfig.from_yaml(str(bad))


def test_a_checkpoint_config_json_of_bad_sizes_is_named(tmp_path):
    """model.hf_path: the checkpoint's config.json is read with the run config; a size < 1 (a model of no
    layers builds and trains nothing) or an unreadable file is refused naming the file and key."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 0}))
    with pytest.raises(ValueError, match=re.escape(f"model.hf_path: {config}'s num_hidden_layers is 0, but a model "
                                                   f"needs an int >= 1 there; fix that file")):
        RunConfig.from_dict({"model": {"hf_path": str(tmp_path)}})
    config.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"model.hf_path: {config} is not a readable JSON file")):
        RunConfig.from_dict({"model": {"hf_path": str(tmp_path)}})


def test_yaml_numbers_pyyaml_reads_as_strings(tmp_path):
    """PyYAML (YAML 1.1) reads `3e-3` and `1e1` as strings; number fields take them, int fields only integral ones."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("train:\n  lr: 3e-3\n  steps: 1e1\n  kl_coef: '0'\ndata:\n  fork_prob: 5e-1\n")
    c = RunConfig.from_yaml(str(cfg))
    assert (c.train.lr, c.train.steps, c.train.kl_coef, c.data.fork_prob) == (0.003, 10, 0.0, 0.5)
    assert type(c.train.steps) is int and type(c.train.lr) is float
    for text, message in (("train: {steps: 2.5e0}", "train.steps must be an int, got '2.5e0'"),
                          ("train: {lr: nan}", "train.lr must be a number, got 'nan'")):
        cfg.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            RunConfig.from_yaml(str(cfg))


def test_malformed_command_line_is_argparse_usage_and_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--stepz", "3"])
    assert e.value.code == 2 and "unrecognized arguments: --stepz" in capsys.readouterr().err


def test_help_shows_every_flag_with_its_key_and_default():
    text = " ".join(build_parser().format_help().split())
    for flag, (key, _) in FLAGS.items():
        assert flag in text and f"[{key}, default " in text, flag
    assert "--seed N" in text and "[train.seed, default 0]" in text


def test_layers_must_split_over_pipeline_stages():
    check_layers(4, 2, 2)
    with pytest.raises(ValueError, match=r"num_hidden_layers=2, not divisible by pp \* vpp = 2 \* 2.*tiny_qwen3_4layers"):
        check_layers(2, 2, 2)


def test_expert_parallel_needs_experts():
    """--ep 2 on a dense model names that, not what megatron-core or mbridge trip over later."""
    from types import SimpleNamespace

    check_expert_parallel(SimpleNamespace(model_type="qwen3_moe", num_experts=4), 2, "moe")
    check_expert_parallel(SimpleNamespace(model_type="qwen3"), 1, "dense")
    with pytest.raises(ValueError, match=r"parallel.ep \(--ep\) 2 splits the experts of a MoE model over ranks, but the "
                                         r"tiny qwen3 model \(qwen3\) is dense, without experts; pass --ep 1"):
        check_expert_parallel(SimpleNamespace(model_type="qwen3", num_experts=None), 2, "the tiny qwen3 model")


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_rank_0_prints_the_error_and_every_rank_files_it(tmp_path, capsys, monkeypatch, rank):
    """torchrun's failure summary shows each rank's elastic error file as its 'traceback': the one line goes there
    on every rank, and to stderr from rank 0 only."""
    error_file = tmp_path / "error.json"
    for name, value in (("RANK", str(rank)), ("WORLD_SIZE", "2"), ("TORCHELASTIC_ERROR_FILE", str(error_file))):
        monkeypatch.setenv(name, value)
    report_error("megatron-tree-train: error: boom")
    assert capsys.readouterr().err == ("megatron-tree-train: error: boom\n" if rank == 0 else "")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=rank, pid=1, exitcode=1, error_file=str(error_file))
    summary = ChildFailedError("train_tree.py", {rank: failure}).format_msg()
    assert "traceback : megatron-tree-train: error: boom" in summary, summary
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")  # another launcher: every rank says it, naming itself
    report_error("megatron-tree-train: error: boom")
    assert capsys.readouterr().err == f"[rank {rank}] megatron-tree-train: error: boom\n"


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_a_mistyped_flag_is_printed_by_rank_0_only(tmp_path, capsys, monkeypatch, rank):
    error_file = tmp_path / "error.json"
    for name, value in (("RANK", str(rank)), ("WORLD_SIZE", "2"), ("TORCHELASTIC_ERROR_FILE", str(error_file))):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--dp", "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    if rank == 0:
        assert err.startswith("usage: megatron-tree-train") and "unrecognized arguments: --dp 2" in err
    else:
        assert err == "" and "unrecognized arguments: --dp 2" in error_file.read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "train.steps (--steps) must be an int >= 1, got 0"),
        (["--lr", "inf"], "train.lr (--lr) must be a finite number, got inf"),
        (["--seed", "-1"], "train.seed (--seed) must be an int in [0, 2**32 - 1]"),
        (["--hf-path", "/nonexistent"], "model.hf_path (--hf-path) '/nonexistent' is not a Hugging Face checkpoint"),
        (["--config", "/nonexistent.yaml"], "config file '/nonexistent.yaml' does not exist"),
        (["--tp", "2"], "world size 1 is not divisible by tp * pp * cp = 2 * 1 * 1"),
        (["--save", "/proc/no/such/dir"], "checkpoint.save '/proc/no/such/dir': cannot create the directory"),
        (["--load", "/proc"], "--load '/proc': neither a checkpoint nor a directory with latest_checkpointed_iteration"),
        (["--no-chunk-trees", "--max-kept-tokens", "5"], "max_kept_tokens=5 bounds what the chunks of trees larger "
                                                          "than a micro-batch keep, but chunk_trees is False"),
        pytest.param(["--bf16"], "train.bf16 (--bf16) needs a CUDA GPU", marks=pytest.mark.skipif(
            torch.cuda.is_available(), reason="refused on CPU only")),
    ],
)
def test_mistakes_end_in_one_line_and_a_nonzero_exit(capsys, argv, message):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megatron-tree-train: error: ") and message in err[-1], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(
    "flag, target, message",
    [
        ("--log-jsonl", "afile/x.jsonl", "logging.jsonl (--log-jsonl) '{tmp}/afile/x.jsonl': cannot create its "
                                         "directory '{tmp}/afile' ('{tmp}/afile' is a file)"),
        ("--log-jsonl", "adir", "logging.jsonl (--log-jsonl) '{tmp}/adir' is a directory; pass a file path"),
        ("--tensorboard-dir", "afile", "logging.tensorboard_dir (--tensorboard-dir) '{tmp}/afile': cannot create "
                                       "the directory ('{tmp}/afile' is a file)"),
        ("--tensorboard-dir", "afile/tb", "logging.tensorboard_dir (--tensorboard-dir) '{tmp}/afile/tb': cannot "
                                          "create the directory ('{tmp}/afile' is a file)"),
    ],
)
def test_unwritable_log_paths_name_their_option(tmp_path, capsys, flag, target, message):
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    assert main([flag, str(tmp_path / target)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "megatron-tree-train: error: " + message.format(tmp=tmp_path), err


def test_save_into_a_directory_holding_a_run_needs_load(tmp_path, capsys):
    """Without --load, a fresh run would later point the tracker back to a lower iteration while newer
    iter_* folders stay: refused before anything is built."""
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert main(["--save", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"megatron-tree-train: error: --save {tmp_path} already holds checkpoints up to iteration 4: "
                       f"pass --load {tmp_path} to resume, or choose an empty --save directory"), err


def test_data_errors_name_the_row_and_nothing_is_left_behind(tmp_path, capsys, monkeypatch):
    """A token id beyond the model's vocabulary is refused before training, naming file, line and
    field; the temporary model directory is removed on that path as on the normal one."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = tmp_path / "rollouts.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": [4, 500]}) + "\n")
    assert main(["--data-path", str(data), "--batch-size", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "rollouts.jsonl line 2: token id 500 in 'input_ids' is outside the model's vocabulary [0, 160)" in err
    assert sorted(os.listdir(tmp_path)) == ["rollouts.jsonl"]


def _train_image_rollouts_one_step(tmp_path, config: str) -> str:
    """make_rollouts.py --images (2 prompts x 3 samples) trained one step by ``configs/<config>``: the samples of a
    prompt share its image in the tree. Returns the rollout file."""
    image_dir = tmp_path / "vl.jsonl.images"
    image_dir.mkdir()
    data = tmp_path / "vl.jsonl"
    write_rollouts(make_rollouts(prompts=2, samples=3, image_dir=str(image_dir)), str(data))
    log = tmp_path / "vl_log.jsonl"
    assert main(["--config", str(REPO_ROOT / "configs" / config), "--data-path", str(data),
                 "--batch-size", "2", "--steps", "1", "--no-progress", "--log-jsonl", str(log)]) == 0
    (rec,) = records(log)
    assert np.isfinite(rec["loss"]) and rec["tree_token_ratio"] < 0.6
    return str(data)


def test_image_rollouts_train_qwen2_5_vl_on_trees(tmp_path, capsys):
    """configs/tiny_qwen2_5_vl.yaml on make_rollouts.py --images; the same rollouts with a text model are refused in
    one line; text-only rollouts train the same model with overlapped gradient reduction."""
    data = _train_image_rollouts_one_step(tmp_path, "tiny_qwen2_5_vl.yaml")
    assert main(["--data-path", data, "--batch-size", "2", "--steps", "1", "--no-progress"]) == 1
    assert "the rollouts carry images, but the model has no vision tower" in capsys.readouterr().err
    text = tmp_path / "text.jsonl"  # no image in a step: the vision tower still takes part (overlapped reduction)
    write_rollouts(make_rollouts(prompts=2, samples=3), str(text))
    assert main(["--config", str(REPO_ROOT / "configs" / "tiny_qwen2_5_vl.yaml"), "--data-path", str(text),
                 "--batch-size", "2", "--steps", "1", "--no-progress", "--use-distributed-optimizer",
                 "--overlap-grad-reduce"]) == 0


@pytest.mark.slow
def test_image_rollouts_train_glm4v_on_trees(tmp_path):
    """configs/tiny_glm4v.yaml on the same image rollouts (GLM-4V's tiny special tokens are Qwen2.5-VL's)."""
    _train_image_rollouts_one_step(tmp_path, "tiny_glm4v.yaml")


@pytest.mark.slow
def test_image_rollouts_train_glm4v_moe_on_trees(tmp_path):
    """configs/tiny_glm4v_moe.yaml (GLM-4.5V: MoE layers, router statistics weighted by sharing) on image rollouts."""
    _train_image_rollouts_one_step(tmp_path, "tiny_glm4v_moe.yaml")


def test_rollout_file_run_logs_plain_lines_to_sinks(tmp_path, capsys, monkeypatch):
    """GRPO on the sample file (examples/make_rollouts.py) with JSONL and TensorBoard sinks; stdout
    is not a terminal, so no progress bar, only one line per step; no temporary files remain."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = str(tmp_path / "rollouts.parquet")
    write_rollouts(make_rollouts(prompts=4), data)
    argv = ["--config", str(REPO_ROOT / "configs" / "tiny_qwen3.yaml"), "--data-path", data, "--loss", "grpo",
            "--steps", "3", "--batch-size", "3", "--log-jsonl", str(tmp_path / "log.jsonl"),
            "--tensorboard-dir", str(tmp_path / "tb")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "\r" not in out and "it/s" not in out
    lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    assert [line.split("|")[0].split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    recs = records(tmp_path / "log.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in recs)
    tokens = [r["original_tokens"] for r in recs]
    assert tokens[1] < tokens[0] == tokens[2]  # 4 groups: 3, the last 1, then the first 3 again
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in recs])
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl", "rollouts.parquet", "tb"]


def test_wandb_offline_and_missing(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb", reason="wandb (the test extra) is not installed; the GPU hosts have no package index")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(["--steps", "1", "--wandb-project", "tree", "--wandb-mode", "offline"]) == 0
    assert any(name.startswith("offline-run-") for name in os.listdir(tmp_path / "wandb"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert main(["--steps", "1", "--wandb-project", "tree"]) == 1
    assert "--wandb-project needs the wandb package: pip install wandb" in capsys.readouterr().err


def test_wandb_online_without_an_api_key_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb", reason="wandb (the test extra) is not installed; the GPU hosts have no package index")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HOME", "WANDB_DIR", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(["--steps", "1", "--wandb-project", "test"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megatron-tree-train: error: --wandb-project test: wandb cannot start a run (No API "
                              "key configured") and "pass --wandb-mode offline" in err[-1] and "wandb login" in err[-1]
    assert not any("Traceback" in line for line in err), err


def test_a_non_finite_step_stops_the_run_before_its_update(tmp_path, capsys):
    """--lr 1e4 makes the gradient norm NaN after a few steps: the run stops with one line naming the step,
    the value and the fixes, exit status 1, before that step's optimizer step; the latest checkpoint is the
    step before, no later one and no export is written."""
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    argv = ["--config", str(REPO_ROOT / "configs" / "tiny_qwen3.yaml"), "--lr", "1e4", "--steps", "8", "--save",
            str(ckpt), "--save-interval", "1", "--export-hf", str(hf), "--log-jsonl", str(tmp_path / "log.jsonl")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    bad = re.fullmatch(r"megatron-tree-train: error: step (\d+): non-finite (loss|gradient norm) (nan|inf)\b.*; the run "
                       r"stopped before its optimizer step: nothing of step \1 reaches the weights, a checkpoint or an "
                       r"export\. Lower the learning rate \(--lr, now 10000\), check the rollouts' advantages and "
                       r"log-probs, or pass --skip-nonfinite to skip such updates", err[-1])
    assert bad, err[-1]
    good = int(bad[1]) - 1
    assert good >= 1  # at least one checkpoint before the bad step
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(good)
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{i:07d}" for i in range(1, good + 1)]
    assert not list(hf.iterdir())
    assert [r["step"] for r in records(tmp_path / "log.jsonl")] == list(range(1, good + 1))


@pytest.mark.parametrize("loss", ["sft", "ppo"])
def test_skip_nonfinite_leaves_the_weights_unchanged(capsys, loss):
    """train.skip_nonfinite (--skip-nonfinite): a step with a NaN gradient norm skips its optimizer step (every
    trained model's parameters stay as they were) and its record says skipped, grad_norm None; the run goes on."""
    cfg = RunConfig.from_yaml(str(REPO_ROOT / "configs" / "tiny_qwen3.yaml"), {
        "train": {"lr": 1e4, "steps": 5, "loss": loss, "skip_nonfinite": True}, "data": {"batch_size": 2},
        "logging": {"progress": False}})
    trainer = Trainer(cfg)
    try:
        models = [*trainer.model, *([] if trainer.ppo is None else trainer.ppo.critic)]
        recs = []
        for _ in range(cfg.train.steps):
            before = [p.detach().clone() for m in models for p in m.parameters()]
            recs += trainer.train_batch(trainer.source.next_batch())
            same = all(torch.equal(a, p) for a, p in zip(before, (p for m in models for p in m.parameters())))
            assert same == recs[-1]["skipped"], recs[-1]  # the first step moves the weights: the check can fail
    finally:
        trainer.close()
    skipped = [r["step"] for r in recs if r["skipped"]]
    assert skipped and skipped[0] > 1, [(r["step"], r["grad_norm"]) for r in recs]
    assert all(r["grad_norm"] is None for r in recs if r["skipped"])
    out = capsys.readouterr().out
    assert f"step {skipped[0]}: non-finite " in out and "update skipped (train.skip_nonfinite), weights unchanged" in out
    assert f" iteration    {skipped[0]}/5 |" in out and out.count("| skipped") == len(skipped)


def _run(tmp_path, name, *flags):
    log = tmp_path / f"{name}.jsonl"
    assert main(["--config", str(REPO_ROOT / "configs" / "tiny_qwen3.yaml"), "--no-progress", *flags,
                 "--log-jsonl", str(log)]) == 0
    return records(log)


def test_lr_schedule_is_megatrons_warmup_then_cosine(tmp_path):
    """megatron-core's OptimizerParamScheduler under Megatron-LM's flag names: linear warmup from 0 over 2 steps,
    cosine decay to --min-lr at step 6; the lr of each step's update is logged."""
    import math

    recs = _run(tmp_path, "cosine", "--train-iters", "6", "--lr", "3e-3", "--lr-warmup-iters", "2",
                "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--tensor-model-parallel-size", "1")
    expected = [3e-3 * n / 2 if n <= 2 else 1e-4 + 0.5 * (math.cos(math.pi * (n - 2) / 4) + 1) * (3e-3 - 1e-4)
                for n in range(6)]
    assert [r["lr"] for r in recs] == pytest.approx(expected, rel=1e-12)
    assert recs[1]["loss"] == recs[0]["loss"]  # the first update ran at lr 0
    assert recs[-1]["loss"] < recs[1]["loss"]


def test_gradient_clipping_runs_on_the_cpu(tmp_path):
    """--clip-grad bounds the update on the CPU too (megatron-core's clipping asserted CUDA gradients)."""
    free = _run(tmp_path, "free", "--steps", "2", "--clip-grad", "0", "--weight-decay", "0")
    tight = _run(tmp_path, "tight", "--steps", "2", "--clip-grad", "1e-9", "--weight-decay", "0", "--optimizer", "sgd",
                 "--sgd-momentum", "0")
    assert free[0]["loss"] == tight[0]["loss"] and free[0]["grad_norm"] == pytest.approx(tight[0]["grad_norm"])
    assert abs(tight[1]["loss"] - tight[0]["loss"]) < 1e-6 < abs(free[1]["loss"] - free[0]["loss"])


@pytest.mark.parametrize("flags, error", [
    (["--lr-warmup-iters", "5", "--steps", "5"], "optimizer.lr_warmup_iters=5 must be below the warmup + decay steps"),
    (["--min-lr", "1", "--lr", "1e-3"], "optimizer.min_lr=1.0 is above train.lr=0.001"),
    (["--adam-beta2", "1"], "optimizer.adam_beta2 (--adam-beta2) must be in [0, 1)"),
])
def test_bad_optimizer_settings_are_one_line(tmp_path, capsys, flags, error):
    assert main(["--config", str(REPO_ROOT / "configs" / "tiny_qwen3.yaml"), *flags]) == 1
    assert error in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_saves_the_step_in_flight_and_leaves_no_helper_process(tmp_path):
    """What Slurm / Kubernetes send, after the save of step 3 (--save-interval 3): the step in flight ends, is
    saved although no save was due (as Megatron-LM's --exit-signal-handler), status 143, one line naming that
    checkpoint; none of megatron-core's checkpoint helpers (a spawn Manager) is left running; it resumes."""
    import signal
    import time

    import psutil

    save = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCHER), "--config", "configs/tiny_qwen3.yaml", "--steps", "500", "--no-progress",
         "--save", str(save), "--save-interval", "3"],
        cwd=REPO_ROOT, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "saved checkpoint" in line and "iter_0000003" in line:
            break
    helpers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    steps = [3, *(int(m) for m in re.findall(r"iteration +(\d+)/500", out))]  # the steps logged after 3
    assert saved == steps[-1] > 3, (saved, steps)  # the step in flight, not the last one due (3)
    assert f"saved checkpoint {save}/iter_{saved:07d}" in out
    last = err.strip().splitlines()[-1]
    assert last == (f"megatron-tree-train: terminated (SIGTERM); the latest checkpoint is {save}/iter_{saved:07d} "
                    f"(resume with --load)"), last
    assert helpers  # the Manager of megatron-core's checkpoint writers (and the resource tracker)
    deadline = time.time() + 10
    while time.time() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                         for p in helpers):
        time.sleep(0.2)
    assert not [p for p in helpers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert main(["--config", str(REPO_ROOT / "configs" / "tiny_qwen3.yaml"), "--load", str(save), "--steps", "12",
                 "--no-progress"]) == 0


def test_mini_batches_are_updates_on_their_own_groups(tmp_path):
    """--ppo-mini-batches 2 on rollout batches of 4 groups: each update is the update of its 2 groups alone, as a run
    on rollout batches of 2 groups gives it (bitwise: same packing, same losses, grad norms and lrs, the lr schedule
    stepped per update). The rows carry old log-probs, so the ratio is the same in both runs."""
    rng = np.random.default_rng(0)
    rows = make_rollouts(prompts=8)
    for row in rows:
        row["old_logprobs"] = (-rng.uniform(0.5, 6.0, len(row["input_ids"]))).tolist()
    data = str(tmp_path / "rollouts.jsonl")
    write_rollouts(rows, data)
    common = ["--data-path", data, "--loss", "grpo", "--steps", "4", "--lr-decay-style", "linear", "--lr", "0.01"]
    mini = _run(tmp_path, "mini", *common, "--batch-size", "4", "--ppo-mini-batches", "2")
    alone = _run(tmp_path, "alone", *common, "--batch-size", "2")
    keys = ("step", "loss", "loss_tokens", "grad_norm", "lr", "original_tokens", "tree_tokens")
    assert [[r[k] for k in keys] for r in mini] == [[r[k] for k in keys] for r in alone]
    assert len({r["loss"] for r in mini}) == 4 and len({r["lr"] for r in mini}) == 4


@pytest.mark.parametrize("loss", ["grpo", "ppo"])
def test_ppo_epochs_move_the_ratio_off_one(tmp_path, loss):
    """--ppo-epochs 2: the old log-probs are the policy's before the rollout batch's first update, so the second
    update's loss (ratio off 1) differs from the first, which equals a one-update run's; without old log-probs in
    the rollouts, one update per batch keeps the ratio at 1 (GRPO on the same batch: the same loss every step)."""
    common = ["--loss", loss, "--batch-size", "2", "--lr", "0.01"]
    one = _run(tmp_path, "one", *common, "--steps", "2")
    two = _run(tmp_path, "two", *common, "--steps", "2", "--ppo-epochs", "2")
    assert two[0]["loss"] == one[0]["loss"] and two[0]["grad_norm"] == one[0]["grad_norm"]
    assert abs(two[1]["loss"] - two[0]["loss"]) > 1e-6
    if loss == "grpo":
        assert one[1]["loss"] == one[0]["loss"]  # ratio 1 by construction
    else:  # both epochs train towards the targets computed before the first: same KL and scores
        assert (two[1]["kl_mean"], two[1]["score_mean"]) == (two[0]["kl_mean"], two[0]["score_mean"])


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["grpo", "ppo"])
def test_micro_batches_smaller_than_every_sequence_train_the_same_steps(tmp_path, loss):
    """``--max-tokens-per-mb 16`` (every sequence is longer; refused before chunked trees): the trees run in chunks
    and the steps' losses, gradient norms and tree-token ratio are those of micro-batches that hold whole trees; the
    same with ``--max-kept-tokens 0`` (every chunk that later chunks read runs its forward again: more
    ``recomputed_tokens`` than at the default, 16)."""
    logs = {}
    for name, extra in (("256", ["--max-tokens-per-mb", "256"]), ("16", ["--max-tokens-per-mb", "16"]),
                        ("16-kept-0", ["--max-tokens-per-mb", "16", "--max-kept-tokens", "0"])):
        logs[name] = tmp_path / f"{name}.jsonl"
        argv = ["--config", "configs/tiny_qwen3.yaml", "--steps", "2", "--batch-size", "2", "--no-progress",
                "--loss", loss, *extra, "--log-jsonl", str(logs[name])]
        assert main(argv) == 0
    whole = records(logs["256"])
    chunked, least = records(logs["16"]), records(logs["16-kept-0"])
    assert all(r["micro_batches"] > 2 * w["micro_batches"] for r, w in zip(chunked, whole))
    assert all(w["recomputed_tokens"] == 0 < r["recomputed_tokens"] < m["recomputed_tokens"]
               for w, r, m in zip(whole, chunked, least))
    for key in ("loss", "grad_norm", "tree_token_ratio", "tree_tokens", "original_tokens"):
        for r, m, w in zip(chunked, least, whole):
            assert r[key] == pytest.approx(w[key], rel=1e-5) and m[key] == pytest.approx(w[key], rel=1e-5), (
                key, r[key], m[key], w[key])
    refused = tmp_path / "refused.jsonl"
    assert main(["--config", "configs/tiny_qwen3.yaml", "--steps", "1", "--no-progress", "--max-tokens-per-mb", "16",
                 "--no-chunk-trees", "--log-jsonl", str(refused)]) == 1


def test_gated_delta_net_trees_larger_than_a_micro_batch_run_in_chunks(tmp_path):
    """A hybrid Gated DeltaNet model (tiny Qwen3.5) with ``--max-tokens-per-mb 16``, every sequence longer: its trees
    run in chunks that carry the recurrent states, and the step's loss and gradient norm are those of micro-batches
    that hold whole trees."""
    logs = {}
    for cap in ("256", "16"):
        logs[cap] = tmp_path / f"{cap}.jsonl"
        assert main(["--config", str(REPO_ROOT / "configs" / "tiny_qwen3_5.yaml"), "--no-progress", "--steps", "1",
                     "--batch-size", "1", "--max-tokens-per-mb", cap, "--log-jsonl", str(logs[cap])]) == 0
    (whole,), (chunked,) = records(logs["256"]), records(logs["16"])
    assert chunked["micro_batches"] > 2 * whole["micro_batches"]
    print({key: (chunked[key], whole[key]) for key in ("micro_batches", "loss", "grad_norm")})
    for key in ("loss", "grad_norm", "tree_tokens"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5), (key, chunked[key], whole[key])


def test_mimo_trains_with_its_config_code_and_without_its_mtp_layers(tmp_path, capsys):
    """A MiMo checkpoint (its config class in the checkpoint, one multi-token prediction layer): refused until
    --trust-remote-code, then refused at its MTP layers naming --skip-mtp-layers, then it trains."""
    from scripts.parity_common import save_tiny_mimo_checkpoint

    from megatron_tree.runtime import save_tiny_hf_checkpoint

    path = save_tiny_mimo_checkpoint(save_tiny_hf_checkpoint("qwen2", tmp_path / "qwen2"), tmp_path / "mimo")
    base = ["--hf-path", path, "--steps", "1", "--no-progress", "--max-tokens-per-mb", "256"]
    assert main(base) == 1
    assert "trust_remote_code=True" in capsys.readouterr().err
    assert main([*base, "--trust-remote-code"]) == 1
    assert "multi-token prediction layer(s)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main([*base, "--trust-remote-code", "--skip-mtp-layers", "--log-jsonl", str(tmp_path / "log.jsonl")]) == 0
    assert (tmp_path / "log.jsonl").read_text().count('"loss"') == 1


def test_fa4_persistent_kernel_cache_on_unless_the_user_says(monkeypatch):
    from megatron_tree.train.__main__ import persistent_kernel_cache

    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    persistent_kernel_cache()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    persistent_kernel_cache()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"

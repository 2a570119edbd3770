"""FA4's kernels compiled ahead by a helper process (megatron_tree.attention.fa4_warmup): what it reports, how the
launcher uses it, and on a GPU that a job's first step compiles nothing the helper did not."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from megatron_tree.attention import fa4_warmup
from megatron_tree.attention.fa4 import fa4_available
from megatron_tree.attention.fa4_warmup import FA4Warmup, start_fa4_warmup

REPO = Path(__file__).resolve().parents[2]


def _helper(*codes: str, record: Path | None = None) -> FA4Warmup:
    """Stand-in helper processes, one running each of ``codes``."""
    return FA4Warmup.spawn([[sys.executable, "-c", code] for code in codes], record)


def _compiled(job: str, seconds: float) -> str:
    return f"import json; print(json.dumps({{'compiled_s': {{'{job}': {seconds}}}}}))"


def test_wait_reports_what_was_compiled_skipped_or_failed():
    done = _helper("import json; print(json.dumps({'compiled_s': {'tree:forward': 3.25, 'tree:train': 2.5}}))").wait()
    assert done.startswith("FA4 kernels compiled ahead in a helper process (tree:forward 3.2 s, tree:train 2.5 s;"), done
    side_by_side = _helper(_compiled("tree:forward", 1.0), _compiled("tree:train", 2.0)).wait()
    assert side_by_side.startswith("FA4 kernels compiled ahead in 2 helper processes (tree:forward 1.0 s, tree:train "
                                   "2.0 s;"), side_by_side
    skipped = _helper("import json; print(json.dumps({'skipped': 'no CUDA GPU here'}))").wait()
    assert skipped == "FA4 kernel warm-up: nothing compiled (no CUDA GPU here)"
    failed = _helper("import sys; sys.exit('CUDA error: out of memory')").wait()
    assert failed == ("FA4 kernel warm-up failed (status 1: CUDA error: out of memory); the first step compiles the "
                      "kernels itself")
    one_of_two = _helper(_compiled("tree:forward", 1.0), "import sys; sys.exit('killed')").wait()
    assert one_of_two.startswith("FA4 kernel warm-up failed (status 1: killed)"), one_of_two


def test_a_finished_warm_up_is_recorded_and_not_repeated(monkeypatch, tmp_path):
    """A later job with the same options on the same GPU kind starts no helper; a failed warm-up records nothing;
    another shape, or the query-slot jobs as well, start helpers again."""
    monkeypatch.setenv(fa4_warmup.CACHE_VARIABLE, "1")
    monkeypatch.setenv(fa4_warmup.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    spawned, real_spawn = [], FA4Warmup.spawn
    stand_in = {"ok": True}

    def spawn(argvs, record=None):
        spawned.append([argv[argv.index("--job") + 1] for argv in argvs])
        jobs = [_compiled(job, 1.0) if stand_in["ok"] else "import sys; sys.exit(1)" for job in spawned[-1]]
        return real_spawn([[sys.executable, "-c", code] for code in jobs], record)

    monkeypatch.setattr(FA4Warmup, "spawn", staticmethod(spawn))
    stand_in["ok"] = False
    assert start_fa4_warmup(16, 8, 128).wait().startswith("FA4 kernel warm-up failed")
    stand_in["ok"] = True
    assert start_fa4_warmup(16, 8, 128).wait().startswith("FA4 kernels compiled ahead in 2 helper processes")
    assert spawned == [["tree:forward", "tree:train"]] * 2
    again = start_fa4_warmup(16, 8, 128)
    assert not again.processes and again.wait().startswith("FA4 kernels: in the persistent cache since an earlier "
                                                           "run's warm-up (" + str(tmp_path / "cache"))
    again.stop()  # nothing to end
    start_fa4_warmup(16, 8, 64).wait()
    start_fa4_warmup(16, 8, 128, query_slots=True).wait()
    assert spawned[2:] == [["tree:forward", "tree:train"], list(fa4_warmup.JOBS)]
    assert len(spawned) == 4 and not start_fa4_warmup(16, 8, 128, query_slots=True).processes


def test_a_talkative_helper_runs_on_before_the_job_waits():
    """Compiler logs go to a file: a helper writing more than a pipe holds still finishes on its own."""
    helper = _helper("import json, sys; sys.stderr.write('log line\\n' * 50_000); print(json.dumps({'skipped': 'test'}))")
    deadline = time.monotonic() + 60
    while helper.processes[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert helper.processes[0].poll() == 0
    assert helper.wait() == "FA4 kernel warm-up: nothing compiled (test)"


def test_stop_ends_a_running_helper():
    helper = _helper("import time; time.sleep(60)", "import time; time.sleep(60)")
    helper.stop()
    assert all(process.poll() is not None for process in helper.processes)
    helper.stop()  # again: nothing left to end


def test_cli_says_what_it_skips_and_refuses_bad_values():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "megatron_tree.attention.fa4_warmup", *args], capture_output=True,
                              text=True, cwd=REPO, timeout=120)

    if not torch.cuda.is_available():
        ok = run("--heads", "16", "--kv-heads", "8", "--head-dim", "128")
        assert ok.returncode == 0 and json.loads(ok.stdout) == {"skipped": "no CUDA GPU here"}, ok.stderr
    bad = run("--heads", "16", "--kv-heads", "0", "--head-dim", "128")
    assert bad.returncode == 2 and "--kv-heads must be at least 1, got 0" in bad.stderr
    bad = run("--heads", "16", "--kv-heads", "8", "--head-dim", "128", "--device", "-1")
    assert bad.returncode == 2 and "--device is a CUDA device index (0, 1, ...), got -1" in bad.stderr
    bad = run("--heads", "16", "--kv-heads", "8", "--head-dim", "128", "--query-slots", "--job", "tree:train")
    assert bad.returncode == 2 and "--job names the jobs to run; --query-slots (every job) goes without it" in bad.stderr
    bad = run("--heads", "16", "--kv-heads", "8", "--head-dim", "128", "--job", "tree")
    assert bad.returncode == 2 and "invalid choice: 'tree'" in bad.stderr


def test_no_helper_without_a_gpu_or_the_persistent_cache(monkeypatch):
    monkeypatch.setenv(fa4_warmup.CACHE_VARIABLE, "0")
    assert start_fa4_warmup(16, 8, 128) is None  # nothing it compiled would outlive it
    monkeypatch.setenv(fa4_warmup.CACHE_VARIABLE, "1")
    if not torch.cuda.is_available():
        assert start_fa4_warmup(16, 8, 128) is None


def test_launcher_starts_it_only_where_fa4_may_run(monkeypatch):
    from transformers import Qwen3Config

    from megatron_tree.train.config import RunConfig
    from megatron_tree.train.trainer import start_kernel_warmup

    def config(parallel=None, micro_batch=None, **train):
        return RunConfig.from_yaml(str(REPO / "configs" / "tiny_qwen3.yaml"),
                                   overrides={"train": train, "parallel": parallel or {}, "micro_batch": micro_batch or {}})

    monkeypatch.setenv(fa4_warmup.CACHE_VARIABLE, "1")
    cfg = config()
    hf = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    assert start_kernel_warmup(cfg, hf, cuda=False) is None  # no GPU
    started = []
    monkeypatch.setattr(fa4_warmup, "start_fa4_warmup", lambda *a, **k: started.append((a, k)) or "helper")
    bf16 = config(bf16=True)
    assert start_kernel_warmup(bf16, hf, cuda=True) == "helper"
    start_kernel_warmup(config(bf16=True, parallel={"tp": 2}, micro_batch={"chunk_trees": False}), hf, cuda=True)
    # chunks on by default: the query-slot kernels too; heads per tensor-parallel rank
    assert started == [((4, 2, 64), {"query_slots": True}), ((2, 1, 64), {"query_slots": False})]
    for off in (config(), config(bf16=True, attention_backend="flex")):
        assert start_kernel_warmup(off, hf, cuda=True) is None
    flat = config(bf16=True, tree_training=False)  # with TE the upstream model on THD sequences, else the tree model's
    for te in (False, True):
        monkeypatch.setattr("megatron_tree.core.platform.have_transformer_engine", lambda: te)
        assert start_kernel_warmup(flat, hf, cuda=True) == (None if te else "helper")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert start_kernel_warmup(bf16, hf, cuda=True) is True  # waits for local rank 0's helper
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(fa4_warmup.CACHE_VARIABLE, "0")
    assert start_kernel_warmup(bf16, hf, cuda=True) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fa4_available(), reason="needs a Hopper GPU and flash-attn-4")
def test_first_step_compiles_nothing_the_helper_did_not(tmp_path):
    """The helper alone fills an empty cache; then a launcher run (bf16, FA4 on head dim 64, GQA 2:1) adds no entry:
    every kernel its steps ran was the helper's. The launcher's own helpers (one per job) record the finished
    warm-up, so a second run starts none."""
    cache = tmp_path / "cache"
    env = {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(cache)}
    helper = subprocess.run([sys.executable, "-m", "megatron_tree.attention.fa4_warmup", "--heads", "4", "--kv-heads",
                             "2", "--head-dim", "64", "--query-slots"], capture_output=True, text=True, cwd=REPO,
                            env={**_env(), **env}, timeout=600)
    assert helper.returncode == 0 and "compiled_s" in helper.stdout, helper.stdout + helper.stderr[-3000:]
    entries = sorted(p.name for p in cache.rglob("*.o"))
    assert entries
    config = yaml.safe_load((REPO / "configs" / "tiny_qwen3.yaml").read_text())
    config["model"]["hf_overrides"]["head_dim"] = 64
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    def launch():
        run = subprocess.run([sys.executable, "-m", "megatron_tree.train", "--config", str(tmp_path / "run.yaml"),
                              "--bf16", "--steps", "2", "--no-progress"], capture_output=True, text=True, cwd=REPO,
                             env={**_env(), **env}, timeout=600)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        return run.stdout + run.stderr

    out = launch()
    assert "FA4 kernels compiled ahead in 4 helper processes" in out, out[-4000:]
    assert sorted(p.name for p in cache.rglob("*.o")) == entries
    out = launch()
    assert "FA4 kernels: in the persistent cache since an earlier run's warm-up" in out, out[-4000:]
    assert sorted(p.name for p in cache.rglob("*.o")) == entries


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

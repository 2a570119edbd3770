"""FA4's kernels compiled ahead (megatron_tree.attention.fa4_warmup): what the warm-up reports, how the launcher
starts it, and on a GPU that a job's first step compiles nothing the warm-up did not."""

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


def test_wait_reports_what_was_compiled_skipped_or_failed():
    done = FA4Warmup(lambda stop: {"compiled_s": {"tree": 3.25, "query_slots": 2.5}}).wait()
    assert done.startswith("FA4 kernels compiled ahead in a background thread (tree 3.2 s, query_slots 2.5 s;"), done
    skipped = FA4Warmup(lambda stop: {"skipped": "no CUDA GPU here"}).wait()
    assert skipped == "FA4 kernel warm-up: nothing compiled (no CUDA GPU here)"

    def fails(stop):
        raise RuntimeError("CUDA error: out of memory\nmore lines")

    failed = FA4Warmup(fails).wait()
    assert failed == ("FA4 kernel warm-up failed (RuntimeError: CUDA error: out of memory); the first step compiles "
                      "the kernels itself")


def test_the_job_goes_on_while_it_runs_and_stop_starts_no_further_job():
    ran = []

    def jobs(stop):
        for job in ("tree", "query_slots"):
            if stop.is_set():
                break
            ran.append(job)
            stop.wait(30)  # a long compile that ends when asked to stop
        return {"compiled_s": {job: 0.0 for job in ran}}

    warmup = FA4Warmup(jobs)
    assert warmup.thread.is_alive()  # start_fa4_warmup returns at once: the job builds its models meanwhile
    start = time.perf_counter()
    warmup.stop()
    assert not warmup.thread.is_alive() and time.perf_counter() - start < 10 and ran == ["tree"]


def test_its_inputs_leave_the_job_random_state_alone():
    """The thread runs while the job initialises its models: drawing from the global generator would change them."""
    state = torch.random.get_rng_state()
    q, k, v = fa4_warmup._layer_inputs(8, 12, 4, 2, 16, 16, False, torch.Generator().manual_seed(0))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert q.shape == (1, 4, 8, 16) and k.shape == (1, 2, 12, 16) and v.shape == (1, 2, 12, 16)
    assert v.stride(2) == 2 * (2 * 16 + 16 + 16)  # a view into the fused QKV projection, as a layer hands it over
    again = fa4_warmup._layer_inputs(8, 12, 4, 2, 16, 16, False, torch.Generator().manual_seed(0))
    assert all(torch.equal(x, y) for x, y in zip((q, k, v), again))


def test_cli_says_what_it_skips_and_refuses_bad_values():
    def run(*args, env=None):
        return subprocess.run([sys.executable, "-m", "megatron_tree.attention.fa4_warmup", *args], capture_output=True,
                              text=True, cwd=REPO, timeout=120, env=env)

    if not torch.cuda.is_available():
        ok = run("--heads", "16", "--kv-heads", "8", "--head-dim", "128")
        assert ok.returncode == 0 and json.loads(ok.stdout) == {"skipped": "no CUDA GPU here"}, ok.stderr
    else:
        import os

        off = run("--heads", "16", "--kv-heads", "8", "--head-dim", "128",
                  env={**os.environ, fa4_warmup.CACHE_VARIABLE: "0"})
        assert json.loads(off.stdout) == {"skipped": "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0: flash-attn-4 would "
                                                     "keep nothing on disk"}, off.stderr
    bad = run("--heads", "16", "--kv-heads", "0", "--head-dim", "128")
    assert bad.returncode == 2 and "--kv-heads must be at least 1, got 0" in bad.stderr
    bad = run("--heads", "16", "--kv-heads", "8", "--head-dim", "128", "--device", "-1")
    assert bad.returncode == 2 and "--device is a CUDA device index (0, 1, ...), got -1" in bad.stderr


def test_nothing_to_warm_up_without_a_gpu():
    if not torch.cuda.is_available():
        assert start_fa4_warmup(16, 8, 128) is None


def test_launcher_starts_it_only_where_fa4_may_run(monkeypatch):
    from transformers import Qwen3Config

    from megatron_tree.train.config import RunConfig
    from megatron_tree.train.trainer import start_kernel_warmup

    def config(parallel=None, micro_batch=None, **train):
        return RunConfig.from_yaml(str(REPO / "configs" / "tiny_qwen3.yaml"),
                                   overrides={"train": train, "parallel": parallel or {}, "micro_batch": micro_batch or {}})

    cfg = config()
    hf = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    assert start_kernel_warmup(cfg, hf, cuda=False) is None  # no GPU
    started = []
    monkeypatch.setattr(fa4_warmup, "start_fa4_warmup", lambda *a, **k: started.append((a, k)) or "warm-up")
    bf16 = config(bf16=True)
    assert start_kernel_warmup(bf16, hf, cuda=True) == "warm-up"  # on every rank, on its current GPU
    start_kernel_warmup(config(bf16=True, parallel={"tp": 2}), hf, cuda=True)
    start_kernel_warmup(config(bf16=True, parallel={"cp": 2}), hf, cuda=True)
    # heads per tensor-parallel rank; the query-slot kernels under context parallel (a chunk compiles its own)
    assert started == [((4, 2, 64), {"query_slots": False}), ((2, 1, 64), {"query_slots": False}),
                       ((4, 2, 64), {"query_slots": True})]
    for off in (config(), config(bf16=True, attention_backend="flex")):
        assert start_kernel_warmup(off, hf, cuda=True) is None
    flat = config(bf16=True, tree_training=False)  # with TE the upstream model on THD sequences, else the tree model's
    for te in (False, True):
        monkeypatch.setattr("megatron_tree.core.platform.have_transformer_engine", lambda: te)
        assert start_kernel_warmup(flat, hf, cuda=True) == (None if te else "warm-up")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fa4_available(), reason="needs a Hopper GPU and flash-attn-4")
def test_first_step_compiles_nothing_the_warm_up_did_not(tmp_path):
    """The command-line warm-up alone fills an empty disk cache; then a launcher run (bf16, FA4 on head dim 64, GQA 2:1;
    PPO: forward-only passes under no_grad, and full recompute's first forward too) adds no entry: every kernel its
    steps ran was one the warm-up compiled (its own thread loads them)."""
    cache = tmp_path / "cache"
    env = {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(cache)}
    helper = subprocess.run([sys.executable, "-m", "megatron_tree.attention.fa4_warmup", "--heads", "4", "--kv-heads",
                             "2", "--head-dim", "64"], capture_output=True, text=True, cwd=REPO,
                            env={**_env(), **env}, timeout=600)
    assert helper.returncode == 0 and "compiled_s" in helper.stdout, helper.stdout + helper.stderr[-3000:]
    entries = sorted(p.name for p in cache.rglob("*.o"))
    assert entries
    config = yaml.safe_load((REPO / "configs" / "tiny_qwen3.yaml").read_text())
    config["model"]["hf_overrides"]["head_dim"] = 64
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.run([sys.executable, "-m", "megatron_tree.train", "--config", str(tmp_path / "run.yaml"), "--bf16",
                          "--steps", "2", "--loss", "ppo", "--recompute", "full", "--no-progress"], capture_output=True, text=True, cwd=REPO,
                         env={**_env(), **env}, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "FA4 kernels compiled ahead in a background thread" in out, out[-4000:]
    assert sorted(p.name for p in cache.rglob("*.o")) == entries


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

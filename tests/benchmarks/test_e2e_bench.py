"""The end-to-end benchmark harness runs on CPU (tiny model, scaled-down workloads; CUDA hidden, also on a
GPU host) and writes every field the GPU runs report, so a GPU run does not fail on the harness itself."""

import json
import sys

import pytest
from dist_utils import REPO_ROOT as REPO
from dist_utils import run_python

pytestmark = pytest.mark.slow


def test_e2e_bench_cpu_smoke(tmp_path):
    out = tmp_path / "e2e.json"
    proc = run_python("benchmarks/e2e_bench.py", ["--model", "tiny", "--scale", "0.02", "--max-tokens-per-mb", "256",
                                                  "--workloads", "grpo,no_sharing", "--warmup", "0", "--steps", "2",
                                                  "--profile-steps", "2", "--lr", "0", "--out", out])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    grpo, no_sharing = result["rows"]
    assert grpo["token_ratio"] < 0.6 and grpo["flop_ideal_speedup"] > 1.5
    assert grpo["flop_ideal_speedup"] >= grpo["packed_flop_ideal_speedup"] > 1.0
    assert no_sharing["token_ratio"] == 1.0 and no_sharing["flop_ideal_speedup"] == 1.0
    for row in result["rows"]:
        flat, tree = row["flat"], row["tree"]
        assert flat["computed_tokens"] == row["original_tokens"] and flat["computed_pairs"] == row["flat_pairs"]
        assert tree["computed_tokens"] >= row["unique_tokens"] and tree["computed_pairs"] >= row["tree_pairs"]
        assert max(flat["max_mb_slots"], tree["max_mb_slots"]) <= 256
        for mode in (flat, tree):
            assert mode["step_s"] > 0 and mode["peak_mem_gib"] is None
            assert len(mode["step_times"]) == 2 and mode["cuda_mallocs"] == mode["alloc_retries"] == [0, 0]
            profile = mode["profile"]
            assert 0 < profile["busy_ms"] <= profile["wall_ms"]
            assert mode["profiled_steps"][0]["wall_ms"] == profile["wall_ms"]
            assert all(0 < p["busy_ms"] <= p["wall_ms"] and p["kernel_ms"] == 0 for p in mode["profiled_steps"])
            assert profile["regions_ms"]["logprobs"] > 0 and profile["regions_ms"]["optimizer"] > 0
    spread = run_python("benchmarks/step_spread.py", [out])
    assert spread.returncode == 0 and spread.stdout.count("profiled: wall") == 4, spread.stdout + spread.stderr


def test_e2e_bench_chunked_trees_compute_each_token_once(tmp_path):
    """``--chunk-trees`` with micro-batches smaller than the trees: the tree steps compute exactly the global trie's
    tokens and (query, key) pairs, so the packed ideal is the global one, less the forwards run again
    (``--max-kept-tokens 0``: every chunk read later). ``--host-profile`` writes each mode's cProfile'd step (the
    chunk schedule among the tree step's functions)."""
    out = tmp_path / "e2e.json"
    proc = run_python("benchmarks/e2e_bench.py", ["--model", "tiny", "--scale", "0.02", "--max-tokens-per-mb", "48",
                                                  "--chunk-trees", "--max-kept-tokens", "0",
                                                  "--flat-max-tokens-per-mb", "256", "--workloads",
                                                  "grpo", "--warmup", "0", "--steps", "1", "--no-profile",
                                                  "--host-profile", "--out", out])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "chunk_schedule.py" in (tmp_path / "e2e.host_grpo_tree.txt").read_text()
    assert "ordered by: cumulative time" in (tmp_path / "e2e.host_grpo_flat.txt").read_text().lower()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["chunk_trees"] and row["tree"]["max_mb_slots"] <= 128  # 48 slots padded to a multiple of 128
    assert row["tree"]["computed_tokens"] == row["unique_tokens"] and row["tree"]["computed_pairs"] == row["tree_pairs"]
    tree = row["tree"]
    assert tree["recomputed_tokens"] > 0 and tree["recomputed_pairs"] > 0
    assert row["packed_flop_ideal_speedup"] < row["flop_ideal_speedup"]


def test_e2e_bench_hybrid_gdn_model_cpu_smoke(tmp_path):
    """A hybrid Gated DeltaNet model (tiny Qwen3.5) runs tree and flat steps; the FLOP ideal counts full attention by
    (query, key) pairs in its one full-attention layer of four."""
    out = tmp_path / "e2e.json"
    proc = run_python("benchmarks/e2e_bench.py", ["--model", "tiny-qwen3.5", "--scale", "0.01", "--max-tokens-per-mb",
                                                  "256", "--workloads", "grpo", "--warmup", "0", "--steps", "1",
                                                  "--no-profile", "--out", out])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["token_ratio"] < 0.6 and row["flop_ideal_speedup"] > 1.5
    assert row["flat"]["computed_tokens"] == row["original_tokens"] and row["tree"]["step_s"] > 0


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3.5", "qwen3-moe-2b", "qwen2-moe-shared-2b", "deepseek-v3-small",
                                   "qwen3-next-hybrid-moe-3b"])
def test_flops_per_token_count_every_matmul_weight_once(model, monkeypatch):
    """``flops_per_token_and_pair`` against the Hugging Face model's own weights (built on the meta device): per token
    6 x the weights of every linear layer (the gated q_proj, MLA's low-rank projections, shared experts included),
    of every router, top-k / experts of the routed experts' weights, plus each GDN layer's conv and recurrence
    (3 Hv dk dv multiply-adds); per pair 6 x query heads x (q/k head dim + value head dim) per full-attention
    layer."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_tree.runtime import tiny_hf_config

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import e2e_bench

    arch, overrides = e2e_bench.MODELS[model]
    cfg = tiny_hf_config(arch, **overrides)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    modules = list(hf.modules())
    linear = sum(m.weight.numel() for m in modules if isinstance(m, torch.nn.Linear))
    routers = sum(m.weight.numel() for m in modules if type(m).__name__.endswith("Router"))
    experts = [m for m in modules if type(m).__name__.endswith("Experts")]
    routed = sum(p.numel() * cfg.num_experts_per_tok // p.shape[0] for m in experts for p in m.parameters())
    gdn_layers = [m for m in modules if type(m).__name__.endswith("GatedDeltaNet")]
    recurrence = sum(m.conv1d.weight.numel() + 3 * m.num_v_heads * m.head_k_dim * m.head_v_dim for m in gdn_layers)
    full = cfg.num_hidden_layers - len(gdn_layers)
    d_qk = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) if arch == "deepseek_v3" else getattr(cfg, "head_dim", None)
    d_qk = d_qk or cfg.hidden_size // cfg.num_attention_heads
    d_v = cfg.v_head_dim if arch == "deepseek_v3" else d_qk
    assert e2e_bench.flops_per_token_and_pair(cfg) == (6 * (linear + routers + routed + recurrence),
                                                       6 * full * cfg.num_attention_heads * (d_qk + d_v))
    assert bool(experts) == ("moe" in model or "deepseek" in model) and bool(gdn_layers) == ("qwen3.5" in model or "next" in model)


def test_a_non_finite_gradient_norm_stops_the_step():
    """The optimizer's gradient norm (clipping computes it on GPUs) is checked after every step: a bf16 flat
    baseline whose backward went non-finite stops there, not one forward later at a layer's input check."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from e2e_bench import train_step
    finally:
        sys.path.pop(0)

    class Optimizer:
        def __init__(self, norm):
            self.norm = norm

        def zero_grad(self):
            pass

        def step(self):
            return True, self.norm, 0

    train_step([], Optimizer(1.5), [], None, lambda *args: None)
    train_step([], Optimizer(None), [], None, lambda *args: None)  # CPU: no clipping, no norm
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm \(nan\)"):
        train_step([], Optimizer(float("nan")), [], None, lambda *args: None)

"""benchmarks/ppo_profile.py profiles each pass of the launcher's PPO step: every pass the step times is profiled,
in the step after the warm-up, and the launcher's own timing is left in place afterwards."""

from dist_utils import REPO_ROOT as REPO


def test_every_pass_of_a_ppo_step_is_profiled(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from ppo_profile import PASSES, profile_mode

    from megatron_tree.train import ppo

    timed = ppo.timed
    result = profile_mode(str(REPO / "configs" / "tiny_qwen3.yaml"), "tree", 0, ["--loss", "ppo", "--batch-size", "2"])
    assert ppo.timed is timed
    assert sorted(result["passes"]) == sorted(PASSES)
    for name, p in result["passes"].items():
        assert 0 < p["busy_ms"] <= p["wall_ms"], (name, p)
    (record,) = result["steps"]
    assert record["step"] == 1 and all(f"pass_{name}_s" in record for name in PASSES)

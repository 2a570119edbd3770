"""benchmarks/startup_bench.py times a fresh process's first step with every kernel cache cold, then warm: each
mode's runs keep every cache under a folder of their own, which the launcher leaves as set."""

import os

from dist_utils import REPO_ROOT as REPO


def test_each_mode_keeps_every_kernel_cache_in_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from startup_bench import CACHES, cache_env

    from megatron_tree.train.__main__ import persistent_kernel_cache

    envs = {mode: cache_env(tmp_path / mode) for mode in ("tree", "flat")}
    for mode, env in envs.items():
        assert all(env[var].startswith(str(tmp_path / mode)) for var in CACHES)
        assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert not {envs["tree"][v] for v in CACHES} & {envs["flat"][v] for v in CACHES}
    for var in CACHES:  # what the launcher does to its environment keeps the run's folders
        monkeypatch.setenv(var, envs["tree"][var])
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)  # restored after the test
    persistent_kernel_cache()
    assert all(os.environ[var] == envs["tree"][var] for var in CACHES)

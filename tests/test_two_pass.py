"""tests/two_pass.py: in the CPU pass Transformer Engine is hidden from the suite and every process it starts
(as on CI, where it is not installed); the environment's own sitecustomize still runs; pass 2 sees TE again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import two_pass

_PROBE = """
import importlib.util, sys
print("find_spec", importlib.util.find_spec("transformer_engine"))
for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch"):
    try:
        __import__(name)
    except ImportError as e:
        print("refused", name, type(e).__name__)
"""


def _run(pythonpath: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_process_of_the_cpu_pass_cannot_import_transformer_engine(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("print('own sitecustomize ran')\n")
    for package in ("transformer_engine", "transformer_engine/pytorch"):  # a stand-in for an installed TE
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "transformer_engine_torch.py").write_text("")
    assert "refused" not in _run([str(tmp_path)])
    out = _run([str(two_pass.CPU_PASS_DIR), str(tmp_path)])
    assert "find_spec None" in out
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch"):
        assert f"refused {name} ModuleNotFoundError" in out
    assert "own sitecustomize ran" in out  # the one it shadows runs after it


def test_hidden_only_in_the_cpu_pass_and_not_in_pass_two(monkeypatch):
    for name in two_pass.TRANSFORMER_ENGINE_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # restored (removed) after the test
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    monkeypatch.delenv(two_pass.GPU_PASS_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not two_pass.hide_transformer_engine()  # CUDA visible: not a CPU pass
    assert os.environ["PYTHONPATH"] == "elsewhere"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert two_pass.hide_transformer_engine() and two_pass.hide_transformer_engine()  # idempotent
    assert os.environ["PYTHONPATH"] == os.pathsep.join([str(two_pass.CPU_PASS_DIR), "elsewhere"])
    with pytest.raises(ModuleNotFoundError):
        import transformer_engine  # noqa: F401
    env = two_pass.gpu_pass_env(two_pass.GpuPass(visible_devices="0"))
    assert env["PYTHONPATH"] == "elsewhere" and env["CUDA_VISIBLE_DEVICES"] == "0" and env[two_pass.GPU_PASS_ENV]
    monkeypatch.setenv("PYTHONPATH", str(two_pass.CPU_PASS_DIR))
    assert "PYTHONPATH" not in two_pass.gpu_pass_env(two_pass.GpuPass(visible_devices=None))


def test_a_transformer_engine_imported_before_the_cpu_pass_is_an_error(monkeypatch):
    monkeypatch.delenv(two_pass.GPU_PASS_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setitem(sys.modules, "transformer_engine", object())
    with pytest.raises(RuntimeError, match="transformer_engine was imported before"):
        two_pass.hide_transformer_engine()


def test_a_failure_is_reported_as_it_happens(tmp_path):
    """A run cut short still says which test failed and why: the line comes before pytest's report at the end."""
    (tmp_path / "test_probe.py").write_text("def test_fails():\n    assert 1 == 2, 'one is not two'\n\n"
                                            "def test_passes():\n    pass\n")
    tests = str(two_pass.CPU_PASS_DIR.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "instant_failures", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_probe.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    early = [i for i, line in enumerate(lines)
             if line.startswith("FAILED") and "(call): AssertionError: one is not two" in line]
    assert early and early[0] < next(i for i, line in enumerate(lines) if "FAILURES" in line), proc.stdout

"""The README and docs/ say what the code does: every Python block runs, every launcher command line
parses, every script and link they name exists, every public name and launcher flag is documented."""

import re
import shlex

import pytest
from dist_utils import REPO_ROOT, run_python

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def _blocks(lang: str):
    for path in DOCS:
        for i, block in enumerate(re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.S)):
            yield pytest.param(block, id=f"{path.name}-{i}")


def _commands():
    """Each command line of the bash blocks (continuations joined, comments dropped)."""
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                for part in filter(None, (p.strip() for p in line.split("&&"))):
                    yield pytest.param(part, id=f"{path.name}:{part[:60]}")


@pytest.mark.slow
@pytest.mark.parametrize("code", list(_blocks("python")))
def test_python_blocks_run(code, tmp_path):
    proc = run_python(None, code=code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("command", list(_commands()))
def test_command_lines_name_real_scripts_and_flags(command):
    from megatron_tree.train.__main__ import build_parser

    words = shlex.split(command)
    for word in words:
        if re.fullmatch(r"(examples|benchmarks|tests)/[\w/.-]+\.(py|sh)", word):
            assert (REPO_ROOT / word).is_file(), f"{command}: no {word}"
    launcher = [i for i, w in enumerate(words) if w.endswith("train_tree.py") or w == "megatron_tree.train"]
    if launcher:
        build_parser().parse_args(words[launcher[0] + 1:])  # argparse exits (SystemExit) on a bad flag


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
        assert (path.parent / target).exists(), f"{path.name}: broken link {target}"


def test_every_public_name_is_documented():
    import megatron_tree

    api = (REPO_ROOT / "docs" / "api.md").read_text()
    missing = [name for name in megatron_tree.__all__ if f"`{name}" not in api]
    assert not missing, f"docs/api.md does not mention {missing}"


def test_every_launcher_flag_is_documented():
    from megatron_tree.train.__main__ import build_parser

    doc = (REPO_ROOT / "docs" / "launcher.md").read_text()
    flags = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    missing = [f for f in flags if f"`{f}`" not in doc]
    assert not missing, f"docs/launcher.md does not list {missing}"

"""The package's layers: each subpackage imports only the layers below it (function-level imports included),
Megatron stays out of the lower layers, and nothing in the package uses the test helpers or the 0.1 paths."""

import ast
import pathlib

import pytest

from megatron_tree._moved import MOVED

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_tree"

# layer -> the megatron_tree layers it may import; third-party packages it must not import.
ALLOWED = {
    "core": {"core"},
    "ops": {"core", "ops"},
    "attention": {"core", "attention"},
    "linear_attention": {"core", "linear_attention"},
    "compat": {"core", "compat"},
    "mcore": {"core", "ops", "attention", "linear_attention", "compat", "mcore"},
    "runtime": {"core", "ops", "attention", "linear_attention", "compat", "mcore", "runtime"},
    "train": {"core", "ops", "attention", "linear_attention", "compat", "mcore", "runtime", "train"},
}
UPSTREAM = ("megatron", "mbridge", "transformers", "transformer_engine", "flash_attn", "cutlass")
FORBIDDEN = {
    "core": UPSTREAM,
    "ops": UPSTREAM,
    "attention": ("megatron", "mbridge", "transformers"),  # the kernels (TE, FA4's CuTe DSL) are optional imports
    "linear_attention": UPSTREAM,  # its kernel (flash-linear-attention) is an optional import
}

# Reviewed exceptions: the one Transformer Engine probe, and the 0.1 names' deprecated aliases
# (imported only when an old name is used).
EXEMPT = {
    "core/platform.py": {"transformer_engine.pytorch"},
    "attention/__init__.py": {"megatron_tree.mcore"},
}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.append((node.lineno, module))
            if module == "megatron_tree":  # from megatron_tree import sub
                found += [(node.lineno, f"megatron_tree.{a.name}") for a in node.names]
    return found


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if len(p.relative_to(PACKAGE).parts) > 1)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_layer_imports_only_the_layers_below_it(path):
    layer = path.relative_to(PACKAGE).parts[0]
    exempt = EXEMPT.get(str(path.relative_to(PACKAGE)), set())
    problems = []
    for line, module in _imports(path):
        if module in exempt:
            continue
        parts = module.split(".")
        if parts[0] == "megatron_tree" and len(parts) > 1:
            target = parts[1]
            if target == "testing" or module in MOVED:
                problems.append(f"line {line}: {module} (test helpers / a 0.1 path)")
            elif target in ALLOWED and target not in ALLOWED[layer]:
                problems.append(f"line {line}: {module} (layer {target!r} is not below {layer!r})")
        elif parts[0] in FORBIDDEN.get(layer, ()):
            problems.append(f"line {line}: {module} (layer {layer!r} imports no {parts[0]})")
    assert not problems, f"{path.relative_to(PACKAGE)}:\n" + "\n".join(problems)


def test_every_layer_is_checked():
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert layers == set(ALLOWED), layers


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """A core module that imports megatron-core or the Megatron adapters is reported."""
    bad = PACKAGE / "core" / "_layout_probe.py"
    bad.write_text("def f():\n    from megatron_tree.mcore import schedule\n    import megatron.core\n")
    try:
        with pytest.raises(AssertionError, match="line 2: megatron_tree.mcore.*\n.*line 3: megatron.core"):
            test_each_layer_imports_only_the_layers_below_it(bad)
    finally:
        bad.unlink()

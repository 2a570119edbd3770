"""The CPU pass of the suite on a GPU host: Transformer Engine hidden, as on a CPU-only machine (tests/two_pass.py).

This directory is put first on ``PYTHONPATH`` by :func:`two_pass.hide_transformer_engine`, so every Python
process of the pass (xdist workers, torchrun ranks, example scripts) runs this at start-up: ``import
transformer_engine`` then raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` answers None, as where
TE is not installed. The environment's own ``sitecustomize`` (shadowed by this one), if any, runs after it.
"""

import importlib.machinery
import importlib.util
import os
import sys

for _name in ("transformer_engine", "transformer_engine_torch"):
    sys.modules.setdefault(_name, None)

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)

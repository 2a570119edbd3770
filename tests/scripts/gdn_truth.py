"""Each run's gradients against the truth: the fp64 runs ``gdn_grad_gap.py --no-te --fp64 --save DIR`` wrote (the
same tiny checkpoints, the local spec), for the fp32 runs it wrote with ``--save DIR`` (TE or local spec, GPU or CPU):
is the tree's fp32 rounding that of running each sequence alone?

Run: PYTHONPATH=.:tests python tests/scripts/gdn_truth.py DIR [ARCH ...] (ARCH: ``qwen3_next`` and ``qwen3_5`` by
default). For each ``DIR/ARCH-SPEC-fp32.pt`` beside ``DIR/ARCH-local-fp64.pt`` prints per layer and overall the
largest ``max|run - truth| / max|truth|`` of the runs ``tree`` (tree model, several micro-batches), ``unshared``
(the same model, each sequence its own tree) and ``upstream`` (megatron-core's model per sequence), truth the fp64
``unshared`` run (fp64 tree = fp64 unshared to ~1e-7, the fp32 log-prob op), and ``ratio`` = tree / max(unshared,
upstream) per parameter (its largest); ``PASS`` when the tree's error is within 1e-5 or within twice the per-sequence
runs' (a defect of sharing is not rounding: it is neither). TE's parameter names are mapped to the local spec's.
"""

from __future__ import annotations

import glob
import os
import re
import sys

import torch
from scripts.parity_common import relative_error

TE_NAMES = (
    (r"\.self_attention\.(in_proj|linear_qkv)\.layer_norm_weight$", ".input_layernorm.weight"),
    (r"\.mlp\.linear_fc1\.layer_norm_weight$", ".pre_mlp_layernorm.weight"),
    (r"\.mlp\.experts\.linear_fc(\d)\.weight(\d+)$", r".mlp.experts.local_experts.\2.linear_fc\1.weight"),
)
"""(pattern, replacement): the TE spec's parameter names -> the local spec's (fused norms, grouped experts)."""
TOL = 1e-5


def local_name(name: str) -> str:
    for pattern, repl in TE_NAMES:
        name = re.sub(pattern, repl, name)
    return name


def truth_errors(runs: dict[str, dict[str, torch.Tensor]], truth: dict[str, torch.Tensor]) -> dict:
    """Per parameter of ``runs`` (``tree``, ``unshared``, ``upstream``: :func:`scripts.families_gpu.family_gradients`)
    each run's ``max|run - truth| / max|truth|`` against ``truth`` (the fp64 ``unshared`` gradients, local-spec
    names): ``{"errors": {name: {run: error}}, "ok": bool, "ratio": largest tree / per-sequence, "worst": its
    parameter}``; ``ok`` when every tree error is within :data:`TOL` or twice the larger per-sequence run's."""
    missing = [n for n in runs["tree"] if local_name(n) not in truth]
    if missing:
        raise KeyError(f"no fp64 parameter for {missing[:4]} (add its mapping to TE_NAMES)")
    errors, ok, ratio, worst = {}, True, 0.0, ""
    for name in runs["tree"]:
        ref = truth[local_name(name)]
        errs = errors[name] = {r: relative_error(runs[r][name], ref) for r in ("tree", "unshared", "upstream")}
        per_seq = max(errs["unshared"], errs["upstream"])
        ok &= errs["tree"] <= max(TOL, 2 * per_seq)
        if errs["tree"] / max(per_seq, 1e-30) > ratio:
            ratio, worst = errs["tree"] / max(per_seq, 1e-30), name
    return dict(errors=errors, ok=ok, ratio=ratio, worst=worst)


def compare(run_file: str, truth_file: str) -> bool:
    result = truth_errors(torch.load(run_file), torch.load(truth_file)["unshared"])
    layers: dict[str, dict[str, float]] = {}
    for name, errs in result["errors"].items():
        m = re.search(r"layers\.(\d+)\.", name)
        row = layers.setdefault(f"layer {m.group(1)}" if m else "other", dict.fromkeys(errs, 0.0))
        for r, e in errs.items():
            row[r] = max(row[r], e)
    print(os.path.basename(run_file))
    for layer, row in layers.items():
        print(f"  {layer:9s} " + " ".join(f"{r}={e:.2e}" for r, e in row.items()))
    total = {r: max(row[r] for row in layers.values()) for r in ("tree", "unshared", "upstream")}
    print("  all       " + " ".join(f"{r}={e:.2e}" for r, e in total.items())
          + f"  ratio<={result['ratio']:.2f} ({result['worst']}) {'PASS' if result['ok'] else 'FAIL'}", flush=True)
    return result["ok"]


def main(argv: list[str]) -> int:
    work_dir, *archs = argv
    failed = 0
    for arch in archs or ("qwen3_next", "qwen3_5"):
        truth = os.path.join(work_dir, f"{arch}-local-fp64.pt")
        for run_file in sorted(glob.glob(os.path.join(work_dir, f"{arch}-*-fp32.pt"))):
            failed += not compare(run_file, truth)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where the Gated DeltaNet families' gradient gap under sharing enters: per parameter, the tiny hybrid models' tree
gradients against the same model run unshared (each sequence its own tree), and the other pairs families_gpu.py
measures, one line per parameter, grouped by layer.

Run: NVIDIA_TF32_OVERRIDE=0 PYTHONPATH=.:tests python tests/scripts/gdn_grad_gap.py WORK_DIR [--no-te [--fp64]]
[--save DIR] [ARCH ...] (ARCH: ``qwen3_next`` and ``qwen3_5`` by default). fp32, TF32 off on CUDA; the Transformer Engine spec
when TE imports, ``--no-te`` megatron-core's local spec; runs on the CPU without CUDA (the reference numbers).
``--fp64`` (local spec only): the models cast to fp64 (the GDN scan then computes in fp64; log-probs stay fp32):
``own`` then shows what sharing changes beyond the fp32 log-prob op (which sums a shared slot's sequences' weights in
fp32): on the CPU <= 1.7e-7 on every parameter alike (GDN or not) against fp32's ~6e-6, ``floor`` <= 3.2e-14, ``noise``
<= 6.3e-15. A defect of the tree path would not shrink with fp64: fp64 ``own`` ~1e-7 on the GPU says the fp32 gap is
rounding.
``--save DIR``: also writes each family's gradients by run to ``DIR/ARCH-SPEC-DTYPE.pt`` (``{run: {parameter:
tensor}}``, CPU), so that runs of different processes (the TE spec in fp32, the local spec in fp64: the truth) can be
compared afterwards (``tests/scripts/gdn_truth.py``).
Prints per family ``ARCH spec=... device=... dtype=...``, then per parameter ``own`` (tree vs unshared: what sharing
changes), ``floor`` (unshared vs upstream per sequence: two implementations' rounding), ``noise`` (tree vs itself in
one micro-batch: same segments, same scan chunks), each ``max|a - b| / max|b|``, ``own_l2`` (``||tree - unshared|| /
||unshared||``) and ``max|grad|``, then per layer the largest of each and the parameter with the largest ``own``;
exits 1 when a family fails to build or run (the error on its line).
"""

from __future__ import annotations

import os
import re
import sys
import traceback

if "--no-te" in sys.argv:  # before megatron-core looks for TE: its imports then see none
    sys.modules.update(transformer_engine=None, transformer_engine_torch=None)

import torch  # noqa: E402
from scripts.families_gpu import family_gradients  # noqa: E402
from scripts.parity_common import relative_error  # noqa: E402

from megatron_tree.compat import apply_compat_patches  # noqa: E402
from megatron_tree.core.platform import have_transformer_engine  # noqa: E402
from megatron_tree.runtime import cpu_mode, destroy_distributed, init_cpu_distributed  # noqa: E402

PAIRS = {"own": ("tree", "unshared"), "floor": ("unshared", "upstream"), "noise": ("tree", "repacked")}


def gap_table(runs: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Parameter name -> {``own``, ``floor``, ``noise`` (max-relative), ``own_l2`` (norm-relative), ``max``
    (max |unshared gradient|)} from :func:`scripts.families_gpu.family_gradients`' runs."""
    table = {}
    for name, ref in runs["unshared"].items():
        row = {}
        for col, (a, b) in PAIRS.items():
            row[col] = relative_error(runs[a][name], runs[b][name])
        tree, ref = runs["tree"][name].double(), ref.double()
        row["own_l2"] = float((tree - ref).norm() / ref.norm().clamp_min(1e-30))
        row["max"] = float(ref.abs().max())
        table[name] = row
    return table


def layer_of(name: str) -> str:
    """``decoder.layers.3.mlp...`` -> ``layer 3``; the other parameters (embedding, final norm, output layer) ->
    ``other``."""
    m = re.search(r"layers\.(\d+)\.", name)
    return f"layer {m.group(1)}" if m else "other"


def main(argv: list[str]) -> int:
    save = argv[argv.index("--save") + 1] if "--save" in argv else None
    work_dir, *archs = [a for a in argv if a not in ("--no-te", "--fp64", "--save", save)]
    fp64 = "--fp64" in argv
    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    spec = "te" if have_transformer_engine() else "local"
    if fp64 and spec == "te":
        print("gdn_grad_gap: --fp64 needs megatron-core's local spec (Transformer Engine's layers run no fp64): "
              "add --no-te")
        return 2
    cols = ("own", "floor", "noise", "own_l2", "max")
    failed = 0
    with apply_compat_patches(), cpu_mode():
        init_cpu_distributed(tp=1)
        for arch in archs or ("qwen3_next", "qwen3_5"):
            try:
                lp_err, runs = family_gradients(arch, work_dir, fp64=fp64)
            except Exception as e:  # one family's failure must not hide the others' results
                traceback.print_exc()
                print(f"{arch} spec={spec} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                      flush=True)
                failed += 1
                continue
            if save:
                os.makedirs(save, exist_ok=True)
                torch.save({r: {n: g.cpu() for n, g in grads.items()} for r, grads in runs.items()},
                           os.path.join(save, f"{arch}-{spec}-{'fp64' if fp64 else 'fp32'}.pt"))
            table = gap_table(runs)
            print(f"{arch} spec={spec} device={'cuda' if cuda else 'cpu'} dtype={'fp64' if fp64 else 'fp32'}"
                  f" logprob={lp_err:.3g}")
            print(f"  {'parameter':66s}" + "".join(f"{c:>10s}" for c in cols))
            layers: dict[str, dict[str, float]] = {}
            for name, row in table.items():
                print(f"  {name:66s}" + "".join(f"{row[c]:10.2e}" for c in cols))
                worst = layers.setdefault(layer_of(name), dict.fromkeys(cols[:-1], 0.0))
                for c in cols[:-1]:
                    worst[c] = max(worst[c], row[c])
            for layer, worst in layers.items():
                print(f"  {arch} {layer}: " + " ".join(f"{c}={v:.2e}" for c, v in worst.items()))
            top = max(table, key=lambda n: table[n]["own"])
            print(f"  {arch} worst own: {top} " + " ".join(f"{c}={table[top][c]:.2e}" for c in cols), flush=True)
        destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

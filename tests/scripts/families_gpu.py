"""Every tiny model family on one GPU, fp32 with TF32 off: tree log-probs vs Hugging Face per sequence,
and parameter gradients (full recompute) vs the upstream model run per sequence.

Run: NVIDIA_TF32_OVERRIDE=0 PYTHONPATH=.:tests python tests/scripts/families_gpu.py WORK_DIR [--no-te] [--truth DIR] [ARCH ...]
(ARCH: TINY_ARCHS, OTHER_TINY_ARCHS (Gemma 3 text) and the sliding-window cases of parity_common.SLIDING_WINDOW_CASES,
all by default)
(``tests/mcore/test_families_gpu.py`` runs it both ways). With Transformer Engine importable the
models are built on the TE spec (mbridge builds it whenever TE runs); ``--no-te`` hides TE from
this process first (megatron-core's local spec on the GPU). Hugging Face runs on the CPU in fp32.
Prints one line per family, ``ARCH spec=te|local logprob=... grad=... decay_grad=... floor=... own=... (worst:
PARAM)`` with ``floor``, ``own``, ``noise`` (:func:`check` says what each is), and exits 1 when any family fails :func:`passes` or fails to build / run
(with the error on its line). ``--truth DIR``: the fp64 gradients ``gdn_grad_gap.py --no-te --fp64 --save DIR``
wrote (Gated DeltaNet families, whose fp32 gradients round further than 1e-5 on the GPU) judge the families whose
rounding criterion alone does not pass (:func:`passes`).
"""

from __future__ import annotations

import os
import sys
import traceback

if "--no-te" in sys.argv:  # before megatron-core looks for TE: its imports then see none
    sys.modules.update(transformer_engine=None, transformer_engine_torch=None)

import torch  # noqa: E402
from scripts.gdn_truth import truth_errors  # noqa: E402
from scripts.parity_common import (  # noqa: E402
    SLIDING_WINDOW_CASES,
    branching_forest,
    build_model,
    flat_logprobs,
    hf_logprobs,
    max_diff,
    micro_batches,
    param_grads,
    relative_error,
    tree_logprobs,
    weighted_sum,
)

from megatron_tree.compat import apply_compat_patches  # noqa: E402
from megatron_tree.core.platform import have_transformer_engine  # noqa: E402
from megatron_tree.runtime import (  # noqa: E402
    OTHER_TINY_ARCHS,
    TINY_ARCHS,
    destroy_distributed,
    init_cpu_distributed,
    save_tiny_hf_checkpoint,
)

TOL = 1e-5


DECAY = ("self_attention.A_log", "self_attention.dt_bias")
"""Gated DeltaNet's per-head decay parameters: their gradient sums every slot's decay gradient, formed by reverse
cumulative sums (fp32 cancellation, whatever the packing); held to ``DECAY_TOL`` as on CPU
(``tests/mcore/test_gated_delta_net_parity.py``)."""
DECAY_TOL = 3 * TOL


def family_gradients(arch: str, work_dir: str, fp64: bool = False) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    """One family (an arch of ``TINY_ARCHS`` / ``OTHER_TINY_ARCHS`` or a sliding-window case of
    ``SLIDING_WINDOW_CASES``) on :func:`branching_forest`: (max |tree log-prob - HF|, parameter gradients by run):
    ``tree`` (the tree model, full recompute, one micro-batch at a time), ``repacked`` (the same trees in one
    micro-batch), ``unshared`` (the same model, each sequence its own tree) and ``upstream`` (megatron-core's model,
    each sequence alone). ``fp64``: both models cast to fp64 after loading (megatron-core's local spec; log-probs
    and a few elementwise ops stay fp32)."""
    base, overrides = SLIDING_WINDOW_CASES.get(arch, (arch, {}))
    path = save_tiny_hf_checkpoint(base, os.path.join(work_dir, arch), **overrides)
    seqs = branching_forest()
    mbs = micro_batches(seqs)
    tree = build_model(path, tree=True, recompute="full")[0]
    tree = tree.double() if fp64 else tree
    with torch.no_grad():
        lp_err = max_diff(tree_logprobs(tree.eval(), mbs), hf_logprobs(path, seqs))
    tree.train()
    for mb in mbs:  # one micro-batch at a time, as training does
        weighted_sum(tree_logprobs(tree, [mb])).backward()
    runs = {"tree": param_grads(tree)}
    weighted_sum(tree_logprobs(tree, micro_batches(seqs, max_tokens=len(sum(seqs, []))))).backward()  # one micro-batch
    runs["repacked"] = param_grads(tree)
    for sid, seq in enumerate(seqs):  # no sharing: each sequence its own tree
        weighted_sum({sid: tree_logprobs(tree, micro_batches([seq]))[0]}).backward()
    runs["unshared"] = param_grads(tree)
    # The reference runs megatron-core's unfused RoPE: its fused MLA RoPE (a Triton kernel, TE spec) does not
    # compile on the GPU host's Triton 3.6 (CompilationError), and the tree model runs unfused RoPE for MLA anyway.
    flat = build_model(path, tree=False, extra_args={"apply_rope_fusion": False})[0].train()
    flat = flat.double() if fp64 else flat
    weighted_sum(flat_logprobs(flat, seqs)).backward()
    runs["upstream"] = param_grads(flat)
    return lp_err, runs


def check(arch: str, work_dir: str, truth_dir: str | None = None) -> dict[str, float | str | bool]:
    """One family (:func:`family_gradients`): ``logprob`` max |tree - HF|; relative gradient errors outside
    :data:`DECAY` / over it (0 without GDN layers) of the tree vs the upstream model run per sequence (``grad`` /
    ``decay_grad``, ``worst`` the parameter with the largest), of the same tree model run with no sharing (each
    sequence its own tree) vs upstream (``floor``: the two implementations' fp32 rounding, no tree in it) and of the
    tree vs that unshared run (``own``: what sharing alone changes) and of the tree vs itself packed into one
    micro-batch instead of several (``noise``: the same trees, other kernel shapes: fp32 rounding alone). With
    ``truth_dir`` holding ``ARCH-local-fp64.pt`` (``gdn_grad_gap.py --no-te --fp64 --save``: the same checkpoint in
    fp64) also ``tree64`` / ``seq64``: the tree's and the per-sequence runs' (the larger of unshared and upstream)
    largest error against that truth, ``truth_ok`` (:func:`scripts.gdn_truth.truth_errors`)."""
    lp_err, runs = family_gradients(arch, work_dir)
    got, repacked, unshared, want = (runs[k] for k in ("tree", "repacked", "unshared", "upstream"))

    def errors(a, b):
        errs = {n: relative_error(a[n], b[n]) for n in b}
        decay = [e for n, e in errs.items() if n.endswith(DECAY)]
        return max(e for n, e in errs.items() if not n.endswith(DECAY)), max(decay, default=0.0), errs

    grad, decay, errs = errors(got, want)
    floor = max(errors(unshared, want)[:2])
    own = max(errors(got, unshared)[:2])
    noise = max(errors(got, repacked)[:2])
    out = dict(logprob=lp_err, grad=grad, decay_grad=decay, floor=floor, own=own, noise=noise,
               worst=max(errs, key=errs.get))
    truth_file = os.path.join(truth_dir, f"{arch}-local-fp64.pt") if truth_dir else None
    if truth_file and os.path.exists(truth_file):
        result = truth_errors(runs, torch.load(truth_file)["unshared"])
        per_param = result["errors"].values()
        out.update(tree64=max(e["tree"] for e in per_param),
                   seq64=max(max(e["unshared"], e["upstream"]) for e in per_param), truth_ok=result["ok"])
    return out


def passes(r: dict) -> bool:
    """Log-probs within :data:`TOL` of HF; gradients within :data:`TOL` (:data:`DECAY_TOL` over :data:`DECAY`) of
    upstream, or, where fp32 rounding is larger (``floor``, ``noise``), within twice it while sharing alone (``own``)
    stays within :data:`TOL` or twice the tree's own rounding (``noise``), or, with the fp64 truth at hand, the
    tree's every gradient is within :data:`TOL` or twice the per-sequence runs' error against it (``truth_ok``: the
    tree rounds as running each sequence alone does)."""
    close = r["grad"] < TOL and r["decay_grad"] < DECAY_TOL
    rounding = max(r["grad"], r["decay_grad"]) <= 2 * max(r["floor"], r["noise"]) and r["own"] <= max(TOL, 2 * r["noise"])
    return r["logprob"] < TOL and (close or rounding or r.get("truth_ok", False))


def main(argv: list[str]) -> int:
    truth_dir = argv[argv.index("--truth") + 1] if "--truth" in argv else None
    work_dir, *archs = [a for a in argv if a not in ("--no-te", "--truth", truth_dir)]
    if not torch.cuda.is_available():
        print("families_gpu: needs a CUDA GPU")
        return 2
    if os.environ.get("NVIDIA_TF32_OVERRIDE") != "0":
        print("families_gpu: set NVIDIA_TF32_OVERRIDE=0 (Transformer Engine's fp32 GEMMs use TF32 otherwise)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    spec = "te" if have_transformer_engine() else "local"
    failed = 0
    with apply_compat_patches():
        init_cpu_distributed(tp=1)
        for arch in archs or (*TINY_ARCHS, *OTHER_TINY_ARCHS, *SLIDING_WINDOW_CASES):
            try:
                r = check(arch, work_dir, truth_dir)
                ok = passes(r)
                print(f"{arch} spec={spec} " + " ".join(f"{k}={v:.3g}" for k, v in r.items() if k not in ("worst", "truth_ok"))
                      + f" (worst: {r['worst']}){'' if ok else ' FAIL'}", flush=True)
            except Exception as e:  # one family's failure must not hide the others' results
                ok = False
                traceback.print_exc()
                print(f"{arch} spec={spec} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            failed += not ok
            torch.cuda.empty_cache()
        destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Multi-process check: mbridge-built tiny models (HF weights loaded) give Hugging Face's fp32 logits,
and export back to the same HF tensors, all after the patch block that built them has closed.

Run: torchrun --standalone --nproc-per-node 2 tests/scripts/bridge_logits.py WORK_DIR CASE...
with CASE = ``tp<N>:<arch>`` or ``ep<N>:<arch>`` (e.g. ``tp2:qwen3 ep2:qwen3_moe``). Each
case writes its checkpoint under WORK_DIR, builds the model at that parallel size on every
rank (``build_tree_model`` opens and closes the compatibility patches), zeroes its weights and
loads them again with ``bridge.load_weights`` (local expert ids made global under EP), gathers
the vocab-parallel logits over the tensor-parallel group and compares them with the HF model's
on a plain causal batch-1 sequence; then ``bridge.export_weights`` (gathering TP shards / EP
experts) and ``bridge.save_weights`` must reproduce the checkpoint's tensors exactly. Rank 0
prints ``CASE max_abs_diff=... export_ok=...``; exit status 1 when logits differ by more
than 1e-5 or the export differs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from safetensors.torch import load_file

from megatron_tree.mcore.bridge import build_flat_model
from megatron_tree.runtime import (
    cpu_mode,
    destroy_distributed,
    init_cpu_distributed,
    save_tiny_hf_checkpoint,
)
from megatron_tree.testing import hf_reference_logits
TOL = 1e-5


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """``[b, S, V/tp]`` on each TP rank -> ``[b, S, V]`` (all_gather over the TP group)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def run_case(case: str, work_dir: str) -> tuple[float, bool]:
    kind, arch = case.split(":")
    size = int(kind[2:])
    sizes = {"tp": dict(tp=size), "ep": dict(ep=size)}[kind[:2]]
    init_cpu_distributed(**sizes)
    path = save_tiny_hf_checkpoint(arch, os.path.join(work_dir, case.replace(":", "_")))
    input_ids = torch.randint(0, 160, (1, 11), generator=torch.Generator().manual_seed(5))
    bridge, chunks = build_flat_model(path)
    model = chunks[0].eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    bridge.load_weights(chunks, path)
    with torch.no_grad():
        logits = gather_vocab_parallel(model(input_ids, torch.arange(11)[None], attention_mask=None))
    err = (logits - hf_reference_logits(path, input_ids)).abs().max().item()
    hf = load_file(os.path.join(path, "model.safetensors"))
    exported = dict(bridge.export_weights(chunks))
    saved_dir = os.path.join(work_dir, case.replace(":", "_") + "_saved")
    bridge.save_weights(chunks, saved_dir)  # rank 0 writes
    dist.barrier()
    saved = load_file(os.path.join(saved_dir, "model.safetensors"))
    export_ok = all(
        sorted(got) == sorted(hf) and all(torch.equal(got[k], v) for k, v in hf.items()) for got in (exported, saved)
    )
    return err, export_ok


def main() -> int:
    work_dir, cases = sys.argv[1], sys.argv[2:]
    failed = False
    with cpu_mode():  # the CPU shim only: no compatibility patch is held open
        for case in cases:
            err, export_ok = run_case(case, work_dir)
            failed |= not (err <= TOL and export_ok)
            if dist.get_rank() == 0:
                print(f"{case} max_abs_diff={err:.3e} export_ok={export_ok}", flush=True)
    destroy_distributed()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())

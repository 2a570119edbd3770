"""The FLOP ideal of a launcher PPO config on one GPU, tree vs flat, and the model TFLOP/s of measured runs: on the CPU,
from the same packing the launcher does (no model is built).

    python benchmarks/ppo_flops.py --config configs/ppo_qwen3_0.6b_shape.yaml --tree-forward-max-tokens-per-mb 65536 \
        --flat-forward-max-tokens-per-mb 32768 --tree-jsonl benchmarks/results/te/ppo_tree_fwd65536_h100.jsonl \
        --flat-jsonl benchmarks/results/te/ppo_no_fwd32768_h100.jsonl

Per mode: the model FLOPs of one step (``trainer.update_flops`` on the packing of the config's first rollout batch:
the actor's and the critic's updates and the four forward-only passes), its micro-batches (updates / forward-only
passes); with a run's ``--log-jsonl`` records, the median step after the first and the model TFLOP/s. Then the FLOP
ideal (flat FLOPs / tree FLOPs: tokens for the linear layers, computed (query, key) pairs for attention) and, with
both records, the measured speedup and its fraction of the ideal. Records written since the launcher logs
``tflops_per_gpu`` carry the same numbers; this reads older ones too.
"""

from __future__ import annotations

import argparse
import json

from megatron_tree import pack_trees
from megatron_tree.core.flops import ModelFlops, packed_work
from megatron_tree.train.config import ModelConfig, RunConfig
from megatron_tree.train.data import open_rollout_source
from megatron_tree.train.trainer import hf_text_config, micro_batch_specs, update_flops
from ppo_records import load, median_after_first


def step_flops(cfg: RunConfig, tree: bool) -> tuple[float, int, int]:
    """(model FLOPs of the first PPO step, update micro-batches, forward-only micro-batches) of ``cfg`` on one GPU
    (``tree``: prefix trees, else each sequence its own chain)."""
    hf = hf_text_config(cfg.model)
    reward = (hf_text_config(ModelConfig(hf_path=cfg.train.reward_model, trust_remote_code=cfg.model.trust_remote_code))
              if cfg.train.reward_model else hf)
    mb = cfg.micro_batch
    chunk = mb.chunk_trees and tree
    spec, forward = micro_batch_specs(cfg, chunk=chunk)
    source = open_rollout_source(cfg.data, vocab=hf.vocab_size,
                                 max_len=None if chunk else mb.max_tokens_per_mb, seed=cfg.train.seed,
                                 need_advantages=False)
    seqs = source.next_batch().sequences
    mbs, forward_mbs = (pack_trees(seqs, s, share_prefixes=tree) for s in (spec, forward))
    part = {"work": packed_work(mbs), "forward_work": packed_work(forward_mbs)}
    return update_flops(ModelFlops.of(hf), ModelFlops.of(reward), part, True), len(mbs), len(forward_mbs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    for mode in ("tree", "flat"):
        ap.add_argument(f"--{mode}-forward-max-tokens-per-mb", type=int, help=f"the {mode} run's value of the flag")
        ap.add_argument(f"--{mode}-jsonl", help=f"the {mode} run's --log-jsonl records")
    args = ap.parse_args()
    loss = RunConfig.from_yaml(args.config).train.loss
    if loss != "ppo":
        raise SystemExit(f"{args.config}: train.loss is {loss!r}; this counts a PPO step (train.loss: ppo)")
    rows = {}
    for mode in ("tree", "flat"):
        forward = getattr(args, f"{mode}_forward_max_tokens_per_mb")
        cfg = RunConfig.from_yaml(args.config, {"train": {"forward_max_tokens_per_mb": forward}} if forward else None)
        flops, updates, forwards = step_flops(cfg, mode == "tree")
        row = rows[mode] = dict(flops=flops, micro_batches=updates, forward_micro_batches=forwards)
        path = getattr(args, f"{mode}_jsonl")
        if path:
            row["step_s"] = median_after_first(load(path))
            row["tflops_per_s"] = flops / row["step_s"] / 1e12
        print(mode, json.dumps(row))
    ideal = rows["flat"]["flops"] / rows["tree"]["flops"]
    line = f"FLOP ideal {ideal:.2f}x"
    if "step_s" in rows["tree"] and "step_s" in rows["flat"]:
        measured = rows["flat"]["step_s"] / rows["tree"]["step_s"]
        line += f", measured {measured:.2f}x = {measured / ideal:.2f} of it"
    print(line)


if __name__ == "__main__":
    main()

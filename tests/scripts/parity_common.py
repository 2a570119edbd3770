"""Shared pieces of the tree-vs-per-sequence parity checks (pytest and torchrun scripts).

Everything runs on CPU in fp32 inside :func:`megatron_tree.runtime.cpu.cpu_mode`, after
:func:`megatron_tree.runtime.cpu.init_cpu_distributed`. Log-probs are dicts
``{sequence id: fp32 [len - 1]}`` (``log p(s[t+1] | s[:t+1])``).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
from megatron.core import parallel_state

from megatron_tree import ImageInput, MicroBatchSpec, pack_trees, pack_vision_trees
from megatron_tree.mcore import bridge, chunk_context
from megatron_tree.ops.logprobs import gather_tree_logprobs, vocab_parallel_logprobs
from megatron_tree.runtime.tiny_models import QWEN2_5_VL_TOKENS

VOCAB = 160  # save_tiny_hf_checkpoint's vocabulary

SLIDING_WINDOW_CASES = {
    # Qwen2: layer 0 full, layer 1 sliding (transformers 5: layer i slides iff i >= max_window_layers)
    "qwen2_swa": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3_swa": ("qwen3", dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)),  # every layer
    "mixtral_swa": ("mixtral", dict(sliding_window=4)),  # every layer
}
"""Tiny sliding-window families: name -> (``save_tiny_hf_checkpoint`` arch, HF config overrides). The windows are
shorter than :func:`branching_forest`'s branches (up to 12 tokens after the prompt)."""


def branching_forest(seed: int = 0) -> list[list[int]]:
    """Two prompts, each with a short branch that sorts (and is laid out) first, then long ones.

    Per prompt p (6 tokens): ``p+[1]+2``, ``p+[2]+11``, ``p+[3]+9`` twice (a duplicate) and
    ``p`` alone (a prefix of the others). Tokens 1..3 sort before every random token, so the
    long branches come after a sibling in DFS order: rotating by packed index is wrong there.
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(10, VOCAB, (n,), generator=gen).tolist()

    seqs = []
    for _ in range(2):
        prompt = rand(6)
        long_c = prompt + [3] + rand(9)
        seqs += [prompt + [1] + rand(2), prompt + [2] + rand(11), long_c, list(long_c), prompt]
    return seqs


def recurrent_forest(seed: int = 0) -> list[list[int]]:
    """Edge trees for recurrent (Gated DeltaNet) layers, whose conv window and state follow each root path.

    - siblings ``p + [1] + 3``, ``p + [2] + 6`` (the long one laid out after the short one) and their strict
      prefixes ``p`` and ``p + [2] + 3``;
    - a comb: a 9-token chain ``c`` with a 2-token branch leaving it at every depth 1..8, and ``c`` itself;
    - a chain longer than 64 tokens (one chunk of the chunked scan): 70 tokens, then two 3-token branches.
    Token ids 1..3 sort before the random ones (>= 10), so short branches come first in DFS order.
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(10, VOCAB, (n,), generator=gen).tolist()

    prompt = rand(5)
    long_branch = prompt + [2] + rand(6)
    seqs = [prompt + [1] + rand(3), long_branch, prompt, long_branch[:9]]
    comb = rand(9)
    seqs += [comb[:depth] + [3] + rand(1) for depth in range(1, 9)] + [comb]
    trunk = rand(70)
    seqs += [trunk + [1] + rand(2), trunk + rand(3)]
    return seqs


def gdn_chunk_batch(seed: int = 0) -> list[list[int]]:
    """A 20-token prompt with a short sibling laid out before a 70-token branch (more than one 64-token chunk of the
    scan when run alone), a branch off that one deep down and a duplicate; a 40-token trunk with 3-token branches
    at depths 22-34 laid out after it (deepest first: one chunk holds several, each hanging from another earlier
    chunk's slot). 25-91 tokens."""
    rng = np.random.default_rng(seed)

    def rand(n: int, high: int = VOCAB) -> list[int]:
        return rng.integers(10, high, n).tolist()

    prompt = rand(20)
    long_a = prompt + [3] + rand(70)
    trunk = rand(40, high=150)  # branch tokens 150+ sort after the trunk's
    return [prompt + [1] + rand(6), long_a, long_a[:60] + [4] + rand(10), list(long_a), trunk,
            *(trunk[:depth] + [150 + depth % 7] + rand(2) for depth in (22, 25, 30, 34))]


def micro_batches(seqs: list[list[int]], max_tokens: int = 40):
    """``pack_trees`` with a capacity that splits the forest into several micro-batches."""
    return pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=max_tokens))


def build_model(hf_path: str, *, tree: bool, bf16: bool = False, recompute: str = "none", extra_args=None):
    """Model chunks built by :func:`build_tree_model` / :func:`build_flat_model` from ``hf_path`` with its weights loaded
    (fp32, or bf16 wrapped in ``Float16Module`` whose outputs are fp32): tree attention and
    per-token RoPE with ``tree=True``, the upstream (flat, causal) model with ``tree=False``; ``extra_args``: more
    TransformerConfig fields, as ``build_tree_model`` takes them."""
    return bridge.build_model(hf_path, tree=tree, bf16=bf16, recompute=recompute, wrap_with_ddp=False,
                              extra_args=extra_args)[1]


def _tp_group():
    group = parallel_state.get_tensor_model_parallel_group()
    return group if group.size() > 1 else None


def _device(model) -> torch.device:
    return next(model.parameters()).device


def tree_logprobs(model, mbs) -> dict[int, torch.Tensor]:
    """Log-probs of every sequence held by the tree micro-batches ``mbs`` (on the model's device); MoE models get
    the tree's ``padding_mask`` (router statistics weighted by sharing), as ``tree_forward_step`` passes it, and
    vision-language micro-batches their images (``mb.model_inputs()``)."""
    from megatron_tree.mcore.router_stats import tree_padding_mask

    out = {}
    moe = bool(getattr(getattr(model, "config", None), "num_moe_experts", None))
    for mb in mbs:
        mb = mb.to(_device(model))
        extra = {"padding_mask": tree_padding_mask(mb)} if moe else {}
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask, **extra, **mb.model_inputs())
        lp = gather_tree_logprobs(logits, mb, tp_group=_tp_group())
        for k, sid in enumerate(mb.sequence_ids):
            out[sid] = lp[mb.cu_targets[k] : mb.cu_targets[k + 1]]
    return out


def flat_logprobs(model, seqs: list[list[int]]) -> dict[int, torch.Tensor]:
    """Log-probs of each sequence run alone (batch 1, causal) through an upstream model."""
    out = {}
    device = _device(model)
    for sid, seq in enumerate(seqs):
        ids = torch.tensor(seq, device=device)[None]
        positions = torch.arange(len(seq), device=device)[None]
        logits = model(ids, positions, attention_mask=None)
        out[sid] = vocab_parallel_logprobs(
            logits[0], positions[0, :-1], ids[0, 1:], tp_group=_tp_group()
        )
    return out


_HF_LINEAR_ATTENTION_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                                 "causal_conv1d_update")


def _hf_linear_attention_modules() -> list:
    """Hugging Face's modelling modules with Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    return [modeling_qwen3_5, modeling_qwen3_5_moe, modeling_qwen3_next]


@contextlib.contextmanager
def hf_pytorch_linear_attention():
    """Hugging Face's Gated DeltaNet layers on their pure-PyTorch kernels: with flash-linear-attention or
    causal-conv1d installed (a GPU host), Hugging Face binds their Triton kernels at import, which cannot run
    the CPU reference. Unwraps each bound kernel name of the qwen3_5 / qwen3_5_moe / qwen3_next modules to the
    PyTorch function it decorates, for the block."""
    from unittest import mock

    with contextlib.ExitStack() as stack:
        for module in _hf_linear_attention_modules():
            for name in _HF_LINEAR_ATTENTION_KERNELS:
                fn = getattr(module, name, None)
                while fn is not None and hasattr(fn, "__wrapped__"):
                    fn = fn.__wrapped__
                if fn is not None:
                    stack.enter_context(mock.patch.object(module, name, fn))
        yield


def hf_model(hf_path: str, **kwargs):
    """The Hugging Face model of a checkpoint, in eval mode: a multimodal one (a config with ``text_config``) as its
    ``…ForConditionalGeneration`` (run on text-only ``input_ids``), else its causal LM; ``kwargs`` to
    ``from_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    path = os.fspath(hf_path)
    multimodal = getattr(AutoConfig.from_pretrained(path), "text_config", None) is not None
    return (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_pretrained(path, **kwargs).eval()


def hf_logprobs(hf_path: str, seqs: list[list[int]]) -> dict[int, torch.Tensor]:
    """Log-probs of each sequence run alone through the Hugging Face model (:func:`hf_model`, fp32; linear-attention
    layers on Hugging Face's PyTorch kernels)."""
    hf = hf_model(hf_path, dtype=torch.float32)
    out = {}
    with torch.no_grad(), hf_pytorch_linear_attention():
        for sid, seq in enumerate(seqs):
            ids = torch.tensor(seq)[None]
            logp = torch.log_softmax(hf(ids, use_cache=False).logits[0, :-1].float(), -1)
            out[sid] = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return out


def _fp64_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                 use_qk_l2norm_in_kernel=False, **kwargs):
    """Hugging Face's ``torch_chunk_gated_delta_rule`` contract (``[B, L, H, *]``), computed token by token in fp64
    (Hugging Face's own casts to fp32)."""
    from megatron_tree.testing import gated_delta_rule_reference

    assert initial_state is None and not output_final_state, "fp64 reference: whole sequences only (use_cache=False)"
    q, k = query.double(), key.double()
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    group = value.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    out = [gated_delta_rule_reference(q[i], k[i], value[i], g[i], beta[i])[0] for i in range(q.shape[0])]
    return torch.stack(out).to(query.dtype), None


def hf_logprobs_fp64(hf_path: str, seqs: list[list[int]]) -> dict[int, torch.Tensor]:
    """:func:`hf_logprobs` in fp64 throughout (the exact values fp32 runs round): the model in fp64, and for Gated
    DeltaNet layers (Qwen3-Next, Qwen3.5) a per-token fp64 delta rule in place of Hugging Face's fp32 one."""
    from unittest import mock

    hf = hf_model(hf_path, dtype=torch.float64, experts_implementation="eager")  # grouped_mm has no fp64
    out = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(hf_pytorch_linear_attention())
        for module in _hf_linear_attention_modules():
            stack.enter_context(mock.patch.object(module, "torch_chunk_gated_delta_rule", _fp64_chunk_gated_delta_rule))
        for sid, seq in enumerate(seqs):
            ids = torch.tensor(seq)[None]
            logp = torch.log_softmax(hf(ids, use_cache=False).logits[0, :-1], -1)
            out[sid] = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return out


def max_diff(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> float:
    """Largest absolute difference over all sequences (both dicts must hold the same ids and shapes; a sequence of one
    token has no targets: 0 when no sequence has any)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    assert all(a[k].shape == b[k].shape for k in a), {k: (a[k].shape, b[k].shape) for k in a}
    return max(((a[k].detach().cpu() - b[k].detach().cpu()).abs().max().item() for k in a if a[k].numel()),
               default=0.0)


def weighted_sum(logprobs: dict[int, torch.Tensor], seed: int = 1) -> torch.Tensor:
    """``sum_k <w_k, logprobs[k]>``; ``w_k`` is fixed random per (seed, sequence id), so sums over
    any split of the sequences (e.g. per micro-batch) add up to the sum over all of them."""
    total = 0.0
    for sid in sorted(logprobs):
        gen = torch.Generator().manual_seed(seed * 100_003 + sid)
        weights = torch.randn(logprobs[sid].shape, generator=gen).to(logprobs[sid].device)
        total = total + (weights * logprobs[sid]).sum()
    return total


def param_grads(model) -> dict[str, torch.Tensor]:
    """Gradient of every parameter that has one, by name (cloned; leaves ``.grad`` cleared)."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.detach().clone()
            p.grad = None
    return grads


def relative_error(got: torch.Tensor, want: torch.Tensor, least: float = 0.0) -> float:
    """``max|got - want| / max|want|`` in fp64 on the CPU (the two may sit on different devices); the denominator at
    least ``least`` (and 1e-30)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(max(least, 1e-30)))


def relative_grad_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], floor: float = 0.0) -> float:
    """max over parameters of :func:`relative_error` (same parameter names required), each parameter's scale at least
    ``floor`` times the largest gradient of all: on small random forests some weights get gradients of 1e-9 - 1e-7 (the
    q / k norms' on a repeated token: zero but for rounding), whose fp32 noise is no error (the property tests: 0.1)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    least = floor * max((float(w.abs().max()) for w in want.values()), default=0.0)
    return max(relative_error(got[n], want[n], least) for n in want)


def tree_and_flat_backward(tree, flat, seqs: list[list[int]], mbs) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Backward of :func:`weighted_sum` through the tree model one micro-batch at a time (as training does), then
    through the flat model, each sequence alone; returns (tree log-probs, flat log-probs), gradients left in
    ``.grad`` (read them with :func:`param_grads`)."""
    tree_lp = {}
    for mb in mbs:
        lp = tree_logprobs(tree, [mb])
        weighted_sum(lp).backward()
        tree_lp.update(lp)
    flat_lp = flat_logprobs(flat, seqs)
    weighted_sum(flat_lp).backward()
    return tree_lp, flat_lp


def weighted_loss_fn(seqs):
    """``loss_fn`` whose per-micro-batch sums add up to ``weighted_sum`` of all log-probs (count 1 each)."""
    whole = {}
    for sid, seq in enumerate(seqs):
        gen = torch.Generator().manual_seed(100_003 + sid)  # weighted_sum's weights, seed 1
        whole[sid] = torch.randn(len(seq) - 1, generator=gen)
    offsets = np.concatenate([[0], np.cumsum([len(s) - 1 for s in seqs])])
    flat = torch.cat([whole[sid] for sid in range(len(seqs))])

    def loss_fn(logprobs, mb):
        weights = flat[torch.from_numpy(mb.target_index(offsets))].to(logprobs)
        return (weights * logprobs).sum(), 1

    return loss_fn


def chunked_step(model, mbs, seqs):
    """Parameter gradients of one ``tree_forward_backward`` step (sums: no division, no DDP)."""
    config = model.config
    config.finalize_model_grads_func = lambda *args, **kwargs: None
    try:
        from megatron_tree.mcore.schedule import tree_forward_backward

        tree_forward_backward([model], mbs, weighted_loss_fn(seqs))
    finally:
        config.finalize_model_grads_func = None
    assert not chunk_context._LINKS  # every chunk's kept keys and values were released
    return param_grads(model)


def run_dist_cases(run_case, work_dir: str, cases: list[str], tol) -> int:
    """Under torchrun: ``run_case(case, work_dir) -> (log-prob error, gradient error)`` for each case (compat patches
    applied, CPU mode), the worst over ranks printed by rank 0 as ``CASE logprob=... grad=...``; 1 if any reached
    ``tol`` (a float, or a function of the case)."""
    import torch.distributed as dist

    from megatron_tree.compat import apply_compat_patches
    from megatron_tree.runtime import cpu_mode, destroy_distributed

    failed = torch.zeros(1)
    with apply_compat_patches(), cpu_mode():
        for case in cases:
            errs = torch.tensor(run_case(case, work_dir), dtype=torch.float32)
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            if dist.get_rank() == 0:
                print(f"{case} logprob={errs[0].item():.3g} grad={errs[1].item():.3g}", flush=True)
            failed += float(errs.max().item() >= (tol(case) if callable(tol) else tol))
        destroy_distributed()
    return int(failed.item() > 0)


# Vision-language (Qwen2.5-VL, GLM-4V) prompts: the tiny models' placeholder tokens (the same ids), images of random
# patches.
IMG, START, END = (QWEN2_5_VL_TOKENS[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"))
PATCH = 3 * 2 * 4 * 4  # channels x temporal patch x patch²


def _image(gen: torch.Generator, grid: tuple[int, int, int]) -> ImageInput:
    return ImageInput(torch.randn(grid[0] * grid[1] * grid[2], PATCH, generator=gen), grid)


def vision_forest(seed: int = 0) -> tuple[list[list[int]], list[list[ImageInput]]]:
    """Sequences and their images (module docstring); text tokens 1..3 sort before the random ones (>= 10)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(10, IMG, (n,), generator=gen).tolist()

    def block(img: ImageInput) -> list[int]:
        return [START] + [IMG] * img.num_tokens(2) + [END]

    a, b, wide = _image(gen, (1, 4, 4)), _image(gen, (1, 4, 4)), _image(gen, (1, 4, 8))
    text = rand(4)
    seqs, images = [], []
    for img in (a, b):  # same grid, same placeholder ids, different pixels
        prompt = block(img) + text
        long_c = prompt + [3] + rand(7)
        seqs += [prompt + [1] + rand(2), prompt + [2] + rand(9), long_c, list(long_c)]
        images += [[img]] * 4
    prompt = rand(3) + block(a) + rand(2)  # image a again, under another prefix
    seqs += [prompt + [1] + rand(3), prompt + [2] + rand(6)]
    images += [[a]] * 2
    prompt = rand(2) + block(wide) + rand(3)
    seqs += [prompt + [1], prompt + [2] + rand(8), prompt + block(a) + rand(4)]
    images += [[wide], [wide], [wide, a]]
    return seqs, images


def vision_micro_batches(seqs, images, max_tokens: int = 64):
    return pack_vision_trees(seqs, images, MicroBatchSpec(max_tokens_per_mb=max_tokens), image_token_id=IMG)


def hf_vision_logprobs(path, seqs, images) -> dict[int, torch.Tensor]:
    """Each sequence alone through the checkpoint's Hugging Face ``…ForConditionalGeneration`` (fp32)."""
    hf = hf_model(path, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for sid, (seq, imgs) in enumerate(zip(seqs, images)):
            ids = torch.tensor(seq)[None]
            kwargs = dict(pixel_values=torch.cat([i.pixel_values for i in imgs]),
                          image_grid_thw=torch.tensor([i.grid_thw for i in imgs])) if imgs else {}
            logits = hf(ids, mm_token_type_ids=(ids == IMG).int(), **kwargs).logits[0, :-1]
            out[sid] = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return out




def tree_and_alone_backward(model, seqs, images, mbs):
    """Backward of :func:`weighted_sum` through the tree micro-batches ``mbs`` (one at a time), then through each
    vision-language sequence alone as its own micro-batch, same model. Returns (tree gradients, tree log-probs,
    log-probs alone); the second backward's gradients are left in ``.grad`` (:func:`param_grads`)."""
    tree_lp = {}
    for mb in mbs:
        lp = tree_logprobs(model, [mb])
        weighted_sum(lp).backward()
        tree_lp.update(lp)
    tree_grads = param_grads(model)
    alone = {sid: tree_logprobs(model, vision_micro_batches([seq], [imgs]))[0]
             for sid, (seq, imgs) in enumerate(zip(seqs, images))}
    weighted_sum(alone).backward()
    return tree_grads, tree_lp, alone


MIMO_CONFIG_CODE = """from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)
"""


def save_tiny_mimo_checkpoint(qwen2_path, path) -> str:
    """A MiMo checkpoint as MiMo's ship (transformers has no ``mimo``): the tiny Qwen2 checkpoint at ``qwen2_path``
    (MiMo's main model is Qwen2's) with ``model_type`` ``mimo``, one multi-token prediction layer in its config (no
    weights: builds without it do not read them) and its config class in ``configuration_mimo.py`` through
    ``auto_map`` (read with ``trust_remote_code``). Returns ``path``."""
    import json
    import shutil
    from pathlib import Path

    path = Path(path)
    shutil.copytree(qwen2_path, path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1,
                  auto_map={"AutoConfig": "configuration_mimo.MiMoConfig"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_mimo.py").write_text(MIMO_CONFIG_CODE)
    return str(path)

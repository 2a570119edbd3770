"""Gated DeltaNet (GDN) layers that compute on a tree: megatron-core's ``GatedDeltaNet`` contract, tree-aware.

Shape legend: s = slots, b = batch, h = hidden, C = conv channels per TP rank (q, k, v), Hk / Hv = key / value
heads per TP rank, dk / dv = their head dims, K = conv kernel width.

:class:`TreeGatedDeltaNet` has megatron-core's parameters and submodules (``in_proj``, ``conv1d``, ``A_log``,
``dt_bias``, ``out_norm``, ``out_proj``: the names mbridge tables and megatron checkpoints use) and its per-TP-rank
``in_proj`` layout ``[q | k | v | z | b | a]``. Given a tree micro-batch's interval vector as ``attention_mask``
(int ``[1, s]``), each slot's causal conv window and its recurrent state come from its root path
(:func:`megatron_tree.linear_attention.tree_causal_conv1d` / ``tree_gated_delta_rule``), not from the slots
laid out before it; the scan layout is built once per micro-batch and cached on the mask's memory (shared by
the layers and by activation recompute, as the tree attention's prepared mask is). A chunk of a tree larger
than a micro-batch starts the slots hanging from earlier chunks from the recurrent states and conv windows
those chunks ended with there, and keeps its own for later chunks (:mod:`megatron_tree.mcore.chunk_context`).
Given THD ``packed_seq_params`` (Megatron's sequence packing, the flat baseline: batch 1, sequence n in slots
``[cu_seqlens_q[n], cu_seqlens_q[n+1])``) each sequence runs alone, its conv window and state starting at its first
slot, on the same kernels as a tree (:func:`megatron_tree.linear_attention.packed_scan_layout`: each sequence a chain;
cached on ``cu_seqlens_q``'s memory). Given no mask (or a boolean one, which megatron-core's layer ignores too) each
row is one causal sequence (``chunk_gated_delta_rule``): the flat reference. Computes on CPU without
flash-linear-attention (the ops pick their kernels).

Per value head (GQA-like: key head ``i // (Hv / Hk)`` serves value head i)::

    q, k, v = split(silu(conv(x W_qkv)));   q, k = l2norm(q), l2norm(k)
    g = -exp(A_log) * softplus(x W_a + dt_bias);   beta = sigmoid(x W_b)
    S_t = exp(g_t) S_parent + beta_t k_t (v_t - (exp(g_t) S_parent)^T k_t)^T;   o_t = S_t^T q_t / sqrt(dk)
    y = out_proj(out_norm(o) * silu(x W_z))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tree.attention.dispatch import PREPARED_MASKS
from megatron_tree.mcore.chunk_context import chunk_link
from megatron_tree.linear_attention import (
    TreeScanLayout,
    chunk_gated_delta_rule,
    compute_dtype,
    packed_scan_layout,
    tree_causal_conv1d,
    tree_conv_windows,
    tree_gated_delta_rule,
    tree_scan_layout,
)

__all__ = ["TreeGatedDeltaNet", "check_gated_delta_net_config"]

_L2NORM_EPS = 1e-6  # flash-linear-attention's and Hugging Face's l2norm


def check_gated_delta_net_config(config: TransformerConfig) -> None:
    """Raise ``ValueError`` for a config whose GDN layers tree training cannot run."""
    if config.context_parallel_size > 1:
        raise ValueError(
            f"Gated DeltaNet layers cannot run under context parallel (size {config.context_parallel_size}): each "
            f"slot's recurrent state depends on every ancestor, which other ranks hold. Use context_parallel_size=1"
        )
    if config.activation_func is not F.silu:
        raise ValueError(
            f"Gated DeltaNet's conv and output gate use SiLU, but the config's activation_func is "
            f"{getattr(config.activation_func, '__name__', config.activation_func)}; build with activation_func=F.silu"
        )


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xc = x.to(compute_dtype(x.dtype))
    return (xc * torch.rsqrt(xc.pow(2).sum(-1, keepdim=True) + _L2NORM_EPS)).to(x.dtype)


class TreeGatedDeltaNet(MegatronModule):
    """megatron-core's ``GatedDeltaNet`` (same constructor, parameters, forward contract and sharded state
    dict) whose forward follows the tree of a tree micro-batch (module docstring).

    ``forward(hidden_states [s, b, h], attention_mask, ..., packed_seq_params) -> (out [s, b, h], bias)``;
    ``attention_mask``: a tree micro-batch's interval vector int ``[1, s]`` (b = 1), or None / a boolean mask (each
    row causal, or with THD ``packed_seq_params`` (b = 1) each packed sequence alone).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int | None = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: float | None = None,
        use_qk_l2norm: bool = True,
        A_init_range: tuple[float, float] = (1, 16),
        pg_collection: ProcessGroupCollection | None = None,
        *,
        name: str | None = None,
        cp_comm_type: str | None = None,
    ):
        """megatron-core's arguments; ``name`` / ``cp_comm_type`` are what megatron-core >= 0.19 passes (the
        submodules' names; context parallel is refused for GDN models when the config is built)."""
        super().__init__(config)
        check_gated_delta_net_config(config)
        if pg_collection is None:
            raise TypeError("TreeGatedDeltaNet needs pg_collection (TransformerLayer passes it)")
        self.layer_number = layer_number
        self.bias = bias
        self.conv_bias = conv_bias
        self.conv_init = conv_init
        self.use_qk_l2norm = use_qk_l2norm
        self.A_init_range = A_init_range
        self.pg_collection = pg_collection
        self.tp_size = pg_collection.tp.size()
        for field in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(config, field) % self.tp_size:
                raise ValueError(f"{field}={getattr(config, field)} must be a multiple of the tensor-parallel size "
                                 f"{self.tp_size}")

        self.hidden_size = config.hidden_size
        self.act_fn = config.activation_func
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
        self.conv_dim = self.qk_dim * 2 + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()

        self.in_proj = build_module(
            submodules.in_proj, self.hidden_size, self.in_proj_dim, config=config, init_method=config.init_method,
            gather_output=False, bias=bias, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
            tp_group=pg_collection.tp, **({} if name is None else {"name": f"{name}.in_proj"}),
        )
        # conv1d.weight [C, 1, K] (depthwise), as megatron-core's and Hugging Face's
        self.conv1d = torch.nn.Conv1d(
            self.conv_dim_local_tp, self.conv_dim_local_tp, kernel_size=self.conv_kernel_dim,
            groups=self.conv_dim_local_tp, padding=self.conv_kernel_dim - 1, bias=conv_bias, device=device,
            dtype=config.params_dtype,
        )
        for param in (self.conv1d.weight, self.conv1d.bias) if conv_bias else (self.conv1d.weight,):
            setattr(param, "tensor_model_parallel", True)
            setattr(param, "partition_dim", 0)
        heads = dict(dtype=config.params_dtype, device=device)
        self.dt_bias = torch.nn.Parameter(torch.empty(self.num_v_heads_local_tp, **heads))
        self.A_log = torch.nn.Parameter(torch.empty(self.num_v_heads_local_tp, **heads))
        for param in (self.dt_bias, self.A_log):
            setattr(param, "tensor_model_parallel", True)
            setattr(param, "partition_dim", 0)
        self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.value_head_dim,
                                     eps=config.layernorm_epsilon)
        self.out_proj = build_module(
            submodules.out_proj, self.v_dim, self.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", tp_group=pg_collection.tp,
            **({} if name is None else {"name": f"{name}.out_proj"}),
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """megatron-core's initialisation: dt_bias = 1, A = U(A_init_range), conv weights U(±conv_init) if set."""
        if not self.config.perform_initialization:
            return
        with get_cuda_rng_tracker().fork(), torch.no_grad():
            if self.conv_init is not None:
                torch.nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*self.A_init_range).log())

    # Megatron distributed checkpoints: the same sharding as megatron-core's GatedDeltaNet (in_proj and conv1d
    # split per component under TP), read from the attributes set above.
    sharded_state_dict = GatedDeltaNet.sharded_state_dict

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **kwargs):
        """``hidden_states [s, b, h]`` -> ``(out [s, b, h], out_proj bias)``; other arguments as megatron-core's."""
        if inference_context is not None or inference_params is not None:
            raise ValueError("TreeGatedDeltaNet has no KV-cache inference; call the model with inference_context=None")
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim / tp] (sequence-parallel: gathered)
        s, b, _ = qkvzba.shape
        tp = self.tp_size
        qkv, gate, beta, alpha = torch.split(
            qkvzba.transpose(0, 1),
            [self.conv_dim_local_tp, self.v_dim // tp, self.num_value_heads // tp, self.num_value_heads // tp],
            dim=-1,
        )  # [b, s, *]
        tree = isinstance(attention_mask, torch.Tensor) and attention_mask.dtype in (torch.int32, torch.int64)
        packed = None if packed_seq_params is None else self._packed_layout(packed_seq_params, tree, s, b)
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        if tree:
            # A chunk of a tree larger than a micro-batch (megatron_tree.mcore.chunk_context): its mask has its
            # context in front; slots hanging from the context start from the states and conv windows earlier
            # chunks kept, and the chunk keeps those at its own state exports.
            link = chunk_link(attention_mask)
            context = 0 if link is None else link.context_len
            if b != 1 or tuple(attention_mask.shape) != (1, context + s):
                raise ValueError(
                    f"a tree attention_mask must be [1, C + s] = [1, {context + s}] (C = {context} context slots of a "
                    f"chunk) with hidden states of batch 1, got mask {tuple(attention_mask.shape)} and batch {b}"
                )
            k = self.conv_kernel_dim
            layout = PREPARED_MASKS.lookup(attention_mask, ("gdn-scan", k, context), lambda: tree_scan_layout(
                attention_mask[0], conv_kernel=k, context=context,
                state_exports=() if link is None else link.state_exports))
            carried = None if link is None else link.carried_recurrent(self.layer_number)
            windows, states = (None, None) if carried is None else carried
            conv_input = qkv[0]
            qkv = tree_causal_conv1d(conv_input, weight, self.conv1d.bias, layout, windows)[None]  # [1, s, C]
        elif packed is not None:
            qkv = tree_causal_conv1d(qkv[0], weight, self.conv1d.bias, packed)[None]
        else:
            qkv = F.conv1d(qkv.transpose(1, 2), weight[:, None, :], self.conv1d.bias, padding=self.conv_kernel_dim - 1,
                           groups=self.conv_dim_local_tp)[..., :s].transpose(1, 2)  # [b, s, C]
        qkv = self.act_fn(qkv)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = query.reshape(b, s, -1, self.key_head_dim)
        key = key.reshape(b, s, -1, self.key_head_dim)
        value = value.reshape(b, s, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query, key = _l2norm(query), _l2norm(key)
        group = self.num_value_heads // self.num_key_heads
        if group > 1:
            query = query.repeat_interleave(group, dim=2)
            key = key.repeat_interleave(group, dim=2)
        dtype = compute_dtype(self.A_log.dtype)  # fp32, or fp64 for an fp64 model (the exactness checks)
        g = -self.A_log.to(dtype).exp() * F.softplus(alpha.to(dtype) + self.dt_bias.to(dtype))  # [b, s, Hv]
        beta = beta.sigmoid()
        if tree and layout.state_exports.size:
            out, kept = tree_gated_delta_rule(query[0], key[0], value[0], g[0], beta[0], layout, initial_states=states,
                                              output_states=True)
            out = link.keep(self.layer_number, out, tree_conv_windows(conv_input, layout, windows), kept)[None]
        elif tree:
            out = tree_gated_delta_rule(query[0], key[0], value[0], g[0], beta[0], layout, initial_states=states)[None]
        elif packed is not None:
            out = tree_gated_delta_rule(query[0], key[0], value[0], g[0], beta[0], packed)[None]
        else:
            out, _ = chunk_gated_delta_rule(query, key, value, g, beta)
        out = self._apply_gated_norm(out, gate.reshape(b, s, -1, self.value_head_dim))  # [b, s, Hv, dv]
        out = out.reshape(b, s, -1).transpose(0, 1).contiguous()  # [s, b, v_dim / tp]
        return self.out_proj(out)

    def _packed_layout(self, params: PackedSeqParams, tree: bool, s: int, b: int) -> TreeScanLayout:
        """The scan layout of THD ``params`` (each packed sequence a chain of its own), built once per micro-batch and
        cached on ``cu_seqlens_q``'s memory for every layer and recompute."""
        if tree:
            raise ValueError("TreeGatedDeltaNet got a tree attention_mask and packed_seq_params: a tree micro-batch's "
                             "layout is its attention_mask; pass packed_seq_params=None (or no tree mask for THD)")
        cu = params.cu_seqlens_q
        if params.qkv_format != "thd" or cu is None or b != 1:
            raise ValueError(f"TreeGatedDeltaNet takes packed_seq_params in THD format (qkv_format='thd', "
                             f"cu_seqlens_q set, hidden states of batch 1), got qkv_format={params.qkv_format!r}, "
                             f"cu_seqlens_q {'missing' if cu is None else 'set'}, batch {b}")
        for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            other = getattr(params, name)
            if other is not None and other is not cu:
                raise ValueError(f"TreeGatedDeltaNet reads one set of offsets, cu_seqlens_q; packed_seq_params."
                                 f"{name} must be None or the same tensor (padded THD segments are not supported)")
        k = self.conv_kernel_dim
        layout = PREPARED_MASKS.lookup(cu, ("gdn-thd", k), lambda: packed_scan_layout(cu, conv_kernel=k))
        if layout.num_slots != s:
            raise ValueError(f"packed_seq_params.cu_seqlens_q ends at {layout.num_slots}, but the packed row holds "
                             f"s = {s} slots: the offsets must cover the row exactly")
        return layout

    def _apply_gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``out_norm(x) * silu(gate)`` per value head (``x``, ``gate`` ``[..., dv]``), in ``x``'s dtype."""
        y = self.out_norm(x.reshape(-1, x.shape[-1])) * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
        return y.to(x.dtype).reshape(x.shape)


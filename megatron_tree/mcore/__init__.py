"""The Megatron adapters: tree core attention, layer spec, per-token RoPE, router statistics, model build,
the schedule, forward-only passes and the self-check.

Layer: megatron-core's public API (mbridge's for building); imports :mod:`megatron_tree.core`,
:mod:`megatron_tree.ops`, :mod:`megatron_tree.attention` and :mod:`megatron_tree.compat`.
"""

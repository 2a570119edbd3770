"""The tree data model and packing: forests, the interval mask, micro-batches, packing, balance, statistics.

Layer: numpy and torch only (no Megatron), so it runs anywhere a rollout is prepared.
"""

"""Keys and values that the chunks of one tree share across micro-batches (:mod:`megatron_tree.core.chunks`).

Shape legend: s = a chunk's slots, C = its context slots, E = its exported slots, b = batch (1),
ng = key/value heads per TP rank, hn / hv = key / value head dims.

In every tree attention layer a chunk (run with ``attention_mask = mb.context_mask``, int ``[1, C + s]``)

* keeps its exported slots' keys and values (post-RoPE, as attention reads them) as *leaf* tensors
  ``[E, b, ng, hn]`` that require grad, one pair per layer: the chunks after it read them as context,
  and their backwards accumulate ``dK`` / ``dV`` into the leaves' ``.grad``;
* passes its own keys and values through :class:`_AddContextGrad`, an identity whose backward adds
  those accumulated gradients at the exported slots: the chunk's backward, which the chunk driver
  (:mod:`megatron_tree.mcore.chunk_schedule`) runs after every reader's backward, carries them on into
  the layers below, once;
* attends with ``[context keys | own keys]``: the context read from the earlier chunks' leaves.

A chunk finds its :class:`ChunkLink` by the storage of the mask it is run with (weakly): the mask reaches
every attention layer in the forward and again in activation recompute, full or selective (recompute
keeps the leaves: they are not replaced once made, so the descendants' gradients stay where they were
accumulated). The driver registers a chunk's link before its forward and drops it after its backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["ChunkLink", "chunk_link", "drop_chunk_link", "register_chunk_link"]


class _AddContextGrad(torch.autograd.Function):
    """Identity on ``x [s, ...]`` whose backward adds ``leaf.grad [E, ...]`` (read then) at rows ``slots [E]``."""

    @staticmethod
    def forward(ctx, x, leaf, slots):
        ctx.leaf = leaf
        ctx.save_for_backward(slots)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        extra = ctx.leaf.grad
        if extra is None:  # no later chunk read these slots in a backward (forward-only readers)
            return grad, None, None
        return grad.index_add(0, slots, extra.to(grad.dtype)), None, None


@dataclass(eq=False)
class ChunkLink:
    """What one chunk's attention layers read and keep.

    context       ``[(the source chunk's store, k)]``, root first: the first k exported rows of each.
    export_slots  LongTensor ``[E]`` on the model's device, or None: the chunk's own slots later chunks read.
    store         layer number -> ``(key [E, b, ng, hn], value [E, b, ng, hv])`` leaves, filled by the forward.
    """

    context: list[tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], int]]
    export_slots: torch.Tensor | None
    store: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def context_len(self) -> int:
        return sum(k for _, k in self.context)

    def keys_and_values(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(key, value)`` to attend with: ``[C + s, ...]``, the context first (module docstring)."""
        if self.export_slots is not None:
            if layer not in self.store:  # the first forward; a recompute finds the leaves it made
                self.store[layer] = tuple(
                    x.detach().index_select(0, self.export_slots).requires_grad_() for x in (key, value)
                )
            leaf_k, leaf_v = self.store[layer]
            if torch.is_grad_enabled():
                key = _AddContextGrad.apply(key, leaf_k, self.export_slots)
                value = _AddContextGrad.apply(value, leaf_v, self.export_slots)
        if self.context:
            key = torch.cat([*(store[layer][0][:k] for store, k in self.context), key])
            value = torch.cat([*(store[layer][1][:k] for store, k in self.context), value])
        return key, value


_LINKS: "weakref.WeakKeyDictionary[torch.UntypedStorage, ChunkLink]" = weakref.WeakKeyDictionary()


def register_chunk_link(mask: torch.Tensor, link: ChunkLink) -> None:
    """Make the attention layers of a forward run with ``attention_mask = mask`` use ``link``."""
    _LINKS[mask.untyped_storage()] = link


def chunk_link(mask: torch.Tensor) -> ChunkLink | None:
    """The link registered for ``mask`` (or a detached copy of it), None for any other mask."""
    return _LINKS.get(mask.untyped_storage())


def drop_chunk_link(mask: torch.Tensor) -> None:
    """Forget ``mask``'s link and free the keys and values it kept (after the chunk's backward)."""
    link = _LINKS.pop(mask.untyped_storage(), None)
    if link is not None:
        link.store.clear()

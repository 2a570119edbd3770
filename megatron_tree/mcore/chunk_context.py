"""Keys and values that the chunks of one tree share across micro-batches (:mod:`megatron_tree.core.chunks`).

Shape legend: s = a chunk's slots, C = its context slots, E = its exported slots, b = batch (1),
ng = key/value heads per TP rank, hn / hv = key / value head dims; recurrent layers: Q = the chunk's state exports,
R = its carried states, Hv = value heads per TP rank, dk / dv = their head dims, K = conv width, D = conv channels
per TP rank.

In every tree attention layer a chunk (run with ``attention_mask = mb.context_mask``, int ``[1, C + s]``)

* keeps its exported slots' keys and values (post-RoPE, as attention reads them) as *leaf* tensors
  ``[E, b, ng, hn]`` that require grad, one pair per layer: the chunks after it read them as context,
  and their backwards accumulate ``dK`` / ``dV`` into the leaves' ``.grad``;
* passes its own keys through :class:`_AddLeafGrads`, an identity whose backward hands the exported rows
  of the keys and values those accumulated gradients: the chunk's backward, which the chunk driver
  (:mod:`megatron_tree.mcore.chunk_schedule`) runs after every reader's backward, carries them on into
  the layers below, once;
* attends with ``[context keys | own keys]``: the context read from the earlier chunks' leaves.

In every Gated DeltaNet layer likewise a chunk keeps, at its state exports (``TreeChunk.state_exports``: the
parents of later chunks' slots), the recurrent states ``[Q, Hv, dk, dv]`` and conv windows ``[Q, K-1, D]``
as leaves (its output passes through :class:`_AddLeafGrads`), and starts the slots hanging from its carried
context slots (``TreeChunk.carried``) from the earlier chunks' leaves (:meth:`ChunkLink.carried_recurrent`).

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


class _AddLeafGrads(torch.autograd.Function):
    """``forward(out, x_1..x_n, leaf_1..leaf_n)``: identity on ``out``, whose backward hands each kept tensor
    ``x_i`` the gradient its detached copy ``leaf_i`` accumulated (``leaf_i.grad``, read then; None when no
    later chunk read it in a backward)."""

    @staticmethod
    def forward(ctx, out, *kept):
        ctx.leaves = kept[len(kept) // 2 :]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(leaf.grad for leaf in ctx.leaves), *(None for _ in ctx.leaves))


@dataclass(eq=False)
class ChunkLink:
    """What one chunk's attention and recurrent layers read and keep.

    context       ``[(the source chunk's store, k)]``, root first: the first k exported rows of each.
    export_slots  LongTensor ``[E]`` on the model's device, or None: the chunk's own slots later chunks read.
    state_exports host ints ``(Q)``: own slots whose recurrent state and conv window later chunks read.
    carried       ``[(the source chunk's store, rows LongTensor [R_s])]``, root first: the recurrent states and
                  windows the chunk's slots hanging from its context start from (rows of the sources' kept ones).
    store         layer number -> leaves filled by the forward: ``(key [E, b, ng, hn], value [E, b, ng, hv])``
                  in an attention layer, ``(windows [Q, K-1, D], states [Q, Hv, dk, dv])`` in a recurrent one.
    """

    context: list[tuple[dict[int, tuple[torch.Tensor, ...]], int]]
    export_slots: torch.Tensor | None
    state_exports: tuple[int, ...] = ()
    carried: list[tuple[dict[int, tuple[torch.Tensor, ...]], torch.Tensor]] = field(default_factory=list)
    store: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @property
    def context_len(self) -> int:
        return sum(k for _, k in self.context)

    def keep(self, layer: int, out: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        """Keep detached copies of ``kept`` as layer ``layer``'s leaves (the first forward makes them; a recompute
        finds them) and return ``out`` tied to them: its backward hands ``kept`` the gradients the leaves
        accumulated (:class:`_AddLeafGrads`)."""
        if layer not in self.store:
            self.store[layer] = tuple(x.detach().requires_grad_() for x in kept)
        if not torch.is_grad_enabled():
            return out
        return _AddLeafGrads.apply(out, *kept, *self.store[layer])

    def keys_and_values(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(key, value)`` to attend with: ``[C + s, ...]``, the context first (module docstring)."""
        if self.export_slots is not None:
            key = self.keep(layer, key, key.index_select(0, self.export_slots), value.index_select(0, self.export_slots))
        if self.context:
            key = torch.cat([*(store[layer][0][:k] for store, k in self.context), key])
            value = torch.cat([*(store[layer][1][:k] for store, k in self.context), value])
        return key, value

    def carried_recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Recurrent layer ``layer``'s ``(windows [R, K-1, D], states [R, Hv, dk, dv])`` that the chunk's slots
        hanging from its context start from, root first; None when none does."""
        if not self.carried:
            return None
        windows, states = zip(*((store[layer][0][rows], store[layer][1][rows]) for store, rows in self.carried))
        return torch.cat(windows), torch.cat(states)


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

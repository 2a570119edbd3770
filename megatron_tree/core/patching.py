"""Reversible attribute swaps and a nesting-safe, reference-counted patch scope.

Every patch in this package is an :class:`AttrPatch` (set ``owner.name = new``, keep the
original, put it back on revert) so that applying and reverting is uniform and exact:
an attribute the owner did not define itself (inherited, or absent) is deleted on
revert instead of being copied onto the owner.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

_ABSENT = object()


@dataclass
class AttrPatch:
    """``owner.name = new`` while applied; ``owner.name`` exactly as before after :meth:`revert`.

    ``owner`` is a module, class or object; ``why`` is a one-line reason kept for
    introspection (``repr``) and error messages.
    """

    owner: Any
    name: str
    new: Any
    why: str = ""
    _saved: Any = field(default=_ABSENT, init=False, repr=False)
    _applied: bool = field(default=False, init=False, repr=False)

    @property
    def original(self) -> Any:
        """The attribute as it is when the patch is not applied (``None`` if absent)."""
        if self._applied:
            return None if self._saved is _ABSENT else self._saved
        return getattr(self.owner, self.name, None)

    def apply(self) -> None:
        if self._applied:
            raise RuntimeError(f"{self!r} is already applied")
        self._saved = vars(self.owner).get(self.name, _ABSENT)
        setattr(self.owner, self.name, self.new)
        self._applied = True

    def revert(self) -> None:
        if not self._applied:
            raise RuntimeError(f"{self!r} is not applied")
        if self._saved is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._saved)
        self._saved = _ABSENT
        self._applied = False


class PatchScope:
    """Applies the patches ``build()`` returns on the first entry and reverts them on the last exit.

    Nested or repeated entries (``with scope.active(): with scope.active(): ...``) share one
    application, so entering twice is harmless and the patches stay until the outermost
    context exits. ``build`` is called at each first entry, so version/feature checks see
    the state of the process at that moment and nothing happens at import time.
    """

    def __init__(self, build: Callable[[], list[AttrPatch]]):
        self._build = build
        self._depth = 0
        self._applied: list[AttrPatch] = []

    @property
    def applied(self) -> tuple[AttrPatch, ...]:
        """Patches currently applied by this scope (empty outside it)."""
        return tuple(self._applied)

    @contextlib.contextmanager
    def active(self) -> Iterator[tuple[AttrPatch, ...]]:
        if self._depth == 0:
            try:
                for patch in self._build():
                    patch.apply()
                    self._applied.append(patch)
            except BaseException:
                self._revert_all()
                raise
        self._depth += 1
        try:
            yield self.applied
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._revert_all()

    def _revert_all(self) -> None:
        while self._applied:
            self._applied.pop().revert()

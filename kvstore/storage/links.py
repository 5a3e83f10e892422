"""Prefix links: which chunk comes before which, so that a prefix is removed tail first.

A chunk is reachable only through the chunks before it: ``lookup`` counts the *leading* chunks
some tier holds, so chunk i of a prefix whose chunk i-1 is gone everywhere is bytes no engine
will load again. Keys are one-way hashes of the prefix (:mod:`kvstore.keys`): a key alone does
not say its parent. So the store keeps what its callers tell it (``put(key, kv, parent=...)``)
and what the headers of the chunks it reads say, and every chunk written to a tier carries its
parent's key in its header (:mod:`kvstore.storage.container`, a padding record). ``kvstore gc``
reads those records back and removes a prefix tail first (:func:`tail_first`).

:class:`PrefixLinks` is the store's memory of them: a bounded map, least recently noted first out,
thread-safe (tiers note parents from their reader threads). A chunk whose link was forgotten, or
never given, is written without one: to ``gc`` it is the first chunk of its own prefix, as every
chunk was before links existed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

from kvstore.keys import ChunkKey

N = TypeVar("N", bound=Hashable)


class PrefixLinks:
    """Each chunk's parent key, as far as this store knows it (see the module docstring)."""

    def __init__(self, remembered: int = 1 << 16) -> None:
        """``remembered``: how many chunks' links are kept (about 200 bytes each)."""
        self._remembered = remembered
        self._parents: OrderedDict[ChunkKey, ChunkKey] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, key: ChunkKey, parent: ChunkKey | None) -> None:
        """``parent`` is the chunk before ``key`` in its prefix (None: nothing to note). Non-blocking."""
        if parent is None:
            return
        with self._lock:
            self._parents[key] = parent
            self._parents.move_to_end(key)
            if len(self._parents) > self._remembered:
                self._parents.popitem(last=False)

    def note_chain(self, keys: Sequence[ChunkKey], parents: Sequence[ChunkKey | None]) -> None:
        """:meth:`note` for each of ``keys`` and its parent."""
        for key, parent in zip(keys, parents, strict=True):
            self.note(key, parent)

    def parent_of(self, key: ChunkKey) -> ChunkKey | None:
        with self._lock:
            return self._parents.get(key)

    def __len__(self) -> int:
        return len(self._parents)


def tail_first(nodes: Iterable[N], parent_of: dict[N, N], recency: dict[N, float]) -> tuple[list[N], dict[N, float]]:
    """``nodes`` in the order a prefix cache should let them go, and each one's effective recency.

    A chunk is needed as long as any chunk after it is (a lookup that reaches a later chunk passes
    through it), so its effective recency is the latest of its own and its descendants' (among
    ``nodes``; ``parent_of`` maps a node to its parent where known, ``recency`` is each node's own
    time). The order is by effective recency, oldest first, and on a tie the deeper chunk first:
    a chunk always comes after every descendant of it, so removing any leading part of the order
    never leaves a chunk whose parent was removed. Links that point outside ``nodes``, or that
    loop (a damaged record), are ignored: such a chunk counts as the first of its prefix.
    """
    members = list(nodes)
    present = set(members)
    depth: dict[N, int] = {}
    for node in members:  # each chain walked once: depths are memoised, a loop is cut where it closes
        path: list[N] = []
        seen: set[N] = set()
        current: N | None = node
        while current is not None and current not in depth and current not in seen:
            seen.add(current)
            path.append(current)
            parent = parent_of.get(current)
            current = parent if parent in present else None
        base = depth[current] + 1 if current is not None and current in depth else 0
        for offset, member in enumerate(reversed(path)):
            depth[member] = base + offset
    effective = {node: recency[node] for node in members}
    for node in sorted(members, key=lambda n: -depth[n]):  # deepest first: children before their parents
        parent = parent_of.get(node)
        if parent in present and depth[parent] < depth[node]:
            effective[parent] = max(effective[parent], effective[node])
    order = sorted(members, key=lambda n: (effective[n], -depth[n]))
    return order, effective

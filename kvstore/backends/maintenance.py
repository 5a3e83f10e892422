"""The operator's side of a backend: what ``kvstore ls``, ``stats``, ``gc`` and ``verify`` need.

Apart from the data path (:mod:`kvstore.backends.base`), because it works differently: on every
namespace at once rather than on the engine's own, on listings rather than on keys an engine
computed, and beside live engines, so a removal spares an object that changed since it was
listed. A backend the tools should serve implements :meth:`Maintenance.scan`,
:meth:`~Maintenance.read_object` and :meth:`~Maintenance.remove_unchanged_batches`; the batch
loop of :meth:`~Maintenance.remove_unchanged` (totals and progress) is written once, here.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, TypeVar

T = TypeVar("T")

LIST_PAGE = 1000  # objects per listing page and per batch delete (S3 DeleteObjects takes at most 1000)


@dataclass(frozen=True, slots=True)
class StoredObject:
    """A chunk object as a listing saw it: enough to choose it, and to delete it only if unchanged."""

    namespace: str  # its namespace directory (kvstore.keys.namespace_dir)
    key: str
    size: int  # bytes the tier spends on it
    when: float  # Unix time of its last write, or of its last access where the tier records one
    version: tuple[object, ...]  # this exact object: a rewrite (and, where recorded, an access) changes it


class Removed(NamedTuple):
    """One object a removal deleted, with its first bytes when they were asked for (``head_bytes``)."""

    item: StoredObject  # as it was given to the removal
    head: bytes | None  # read just before it was deleted; None if not asked for or unreadable


@dataclass
class RemoveReport:
    """What a batch delete did; tools add these up for their summary."""

    removed: int = 0
    removed_bytes: int = 0
    changed: int = 0  # rewritten or used since it was listed: kept
    gone: int = 0  # already absent (evicted, expired, another gc): nothing to do
    errors: list[str] = field(default_factory=list)
    deleted: list[Removed] = field(default_factory=list)  # which objects were removed (``removed`` of them)

    def count_removed(self, item: StoredObject, size: int, head: bytes | None = None) -> None:
        """``item`` (``size`` bytes) was deleted; ``head``: its first bytes, read just before."""
        self.removed += 1
        self.removed_bytes += size
        self.deleted.append(Removed(item, head))

    def add(self, other: RemoveReport) -> None:
        """Fold ``other`` into this report (a total over batches)."""
        self.removed += other.removed
        self.removed_bytes += other.removed_bytes
        self.changed += other.changed
        self.gone += other.gone
        self.errors.extend(other.errors)
        self.deleted.extend(other.deleted)

    @property
    def handled(self) -> int:
        """Objects this report accounts for, whatever became of them."""
        return self.removed + self.changed + self.gone + len(self.errors)


Progress = Callable[[RemoveReport], None]
"""Called after each batch of a removal with that batch's report (for progress bars)."""


def pages(items: Sequence[T], size: int = LIST_PAGE) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size``: the batches of a removal."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Maintenance:
    """The tools' interface to a backend. Defaults raise NotImplementedError: a backend the tools cannot serve."""

    name: ClassVar[str]
    # What StoredObject.when means here: "last write" or "last access" (reads refresh it).
    age_basis: ClassVar[str] = "last write"
    # Whether reading an object refreshes that age (Redis: its idle time), so a tool that only
    # looks (ls reading chunk headers) would make everything it read look fresh to gc.
    reads_refresh_age: ClassVar[bool] = False

    def scan(self, namespaces: Callable[[str], bool] | None = None) -> AsyncIterator[list[StoredObject]]:
        """Every chunk object of every namespace ``namespaces`` accepts (default all), a page at a time."""
        raise NotImplementedError(f"the {self.name} backend cannot be listed by the kvstore tools")

    async def read_object(self, item: StoredObject) -> bytes | None:
        """The listed object's bytes (None if it is gone), for ``kvstore verify``."""
        raise NotImplementedError(f"the {self.name} backend cannot be read by the kvstore tools")

    async def read_head(self, item: StoredObject, size: int) -> bytes | None:
        """The listed object's first ``size`` bytes (all of it if shorter), for ``kvstore ls``'s codec
        column; None if it is gone. Default: the whole object, cut; backends override with a ranged read."""
        data = await self.read_object(item)
        return None if data is None else data[:size]

    async def read_parents(self, items: Sequence[StoredObject]) -> list[str | None] | None:
        """Each listed object's parent key as recorded apart from it (:meth:`Backend.set_link`; None where
        none is), for ``kvstore gc`` to remove prefixes tail first without reading the chunks. None (the
        default): this backend keeps none apart, and the tools read parents from the chunks' headers."""
        return None

    async def prune_links(self, namespaces: Callable[[str], bool] | None = None) -> int:
        """Remove the parent links kept apart (:meth:`read_parents`) whose chunk is gone, in the namespaces
        ``namespaces`` accepts (default all); how many went. Default: none kept apart, nothing to do."""
        return 0

    def read_version(self, item: StoredObject, data: bytes) -> StoredObject:
        """``item`` as :meth:`read_object` found it, for a removal that must spare a rewritten object.

        The listing's version, unless reading changes what it records (Redis: the idle time).
        """
        return item

    async def remove_unchanged(
        self, items: Sequence[StoredObject], progress: Progress | None = None, *, head_bytes: int = 0
    ) -> RemoveReport:
        """Delete each object only if it is still the one listed (same ``version``), in batches.

        Safe beside live engines: a reader of a removed chunk sees a miss, and a chunk rewritten
        or (where recorded) read since it was listed is kept, counted as ``changed``. The total
        of every batch's report (``deleted`` says which objects went); ``progress`` sees each
        batch's report as it completes. ``head_bytes``: read each object's first that many bytes
        (its chunk header, for ``kvstore gc``'s events) just before deleting it, without counting
        as an access (a Redis idle time is not restarted by it); 0 reads nothing.
        """
        total = RemoveReport()
        # A backend written before heads were asked for takes the items alone: its heads are None.
        takes_heads = "head_bytes" in inspect.signature(self.remove_unchanged_batches).parameters
        batches = self.remove_unchanged_batches(*((items, head_bytes) if takes_heads else (items,)))
        async for report in batches:
            total.add(report)
            if progress is not None:
                progress(report)
        return total

    def remove_unchanged_batches(
        self, items: Sequence[StoredObject], head_bytes: int = 0
    ) -> AsyncIterator[RemoveReport]:
        """The removal itself, one report per batch (an async generator): what a backend implements.

        Each of ``items`` is accounted for in exactly one report (removed, with its head when
        ``head_bytes`` asks for it: see :meth:`RemoveReport.count_removed`; changed, gone or an
        error); a batch's failure is reported as errors for its objects, never raised. A head
        that cannot be read is None, never an error: the object is removed all the same.
        """
        raise NotImplementedError(f"the {self.name} backend cannot be cleaned by the kvstore tools")

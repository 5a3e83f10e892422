"""What ``kvstore gc`` keeps, and its removals: by age, then down to a byte budget, a prefix tail first.

A plan lists every tier (:func:`plan_gc`), chooses what goes (:func:`choose_victims`) and deletes
nothing: a dry run is exactly that. :func:`run_gc` then removes each victim that is still as listed
(:meth:`Backend.remove_unchanged`), so running it beside live engines is safe.

**Tail first.** A chunk is loaded only through the chunks before it in its prefix (``lookup``
counts leading chunks), so gc never deletes a chunk and keeps one after it: each chunk's header
records its parent where the engine said it (:mod:`kvstore.storage.links`), and gc orders a
tier's chunks by :func:`~kvstore.storage.links.tail_first`, a chunk as recent as its most recent
descendant. Parents are read only when a rule would remove something (one small read of each
chunk's header; on Redis the link kept beside each chunk, since reading a chunk would restart its
idle time). A chunk without a recorded parent counts as the first of its prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.backends import Backend, Progress, RemoveReport, StoredObject
from kvstore.cli.inventory import list_objects, read_header_fields
from kvstore.cli.removal_events import HEAD_BYTES, RemovalEvents
from kvstore.keys import ChunkKey
from kvstore.storage.container import header_records
from kvstore.storage.links import tail_first

PARENT_READS = 32  # header reads in flight while gc learns a tier's prefix links
Node = tuple[str, str]  # (namespace directory, key): a chunk in one tier


@dataclass(frozen=True)
class Retention:
    """What gc keeps: chunks younger than ``max_age``, then the newest that fit in ``max_bytes`` per tier."""

    max_age: float | None = None  # seconds since the last write (or access, where the tier records it)
    max_bytes: int | None = None  # per tier, over the namespaces selected

    def __post_init__(self) -> None:
        if self.max_age is None and self.max_bytes is None:
            raise ValueError("give a maximum age, a byte budget, or both")
        if (self.max_age is not None and self.max_age < 0) or (self.max_bytes is not None and self.max_bytes < 0):
            raise ValueError("the maximum age and the byte budget cannot be negative")


def node_of(item: StoredObject) -> Node:
    return (item.namespace, item.key)


def prefix_links(objects: Sequence[StoredObject], parents: Sequence[ChunkKey | None]) -> dict[Node, Node]:
    """Each object's parent as a node of the same tier and namespace (``parents[i]``: ``objects[i]``'s, or None)."""
    return {
        node_of(item): (item.namespace, parent)
        for item, parent in zip(objects, parents, strict=True)
        if parent is not None
    }


def choose_victims(
    objects: Sequence[StoredObject],
    retention: Retention,
    now: float,
    links: dict[Node, Node] | None = None,
) -> list[StoredObject]:
    """Everything older than the maximum age, then the oldest of the rest until the budget holds: a prefix
    tail first.

    ``links``: each object's parent (:func:`prefix_links`), where known. A chunk's age is that of its
    most recent descendant among ``objects`` (a lookup reaching it passes through this one), so an old
    chunk with a young descendant is kept, and of a prefix its tail goes before its head; ties go
    deepest first, then by key, so the same listing always gives the same choice.
    """
    items = {node_of(item): item for item in sorted(objects, key=node_of)}
    order, recency = tail_first(items, links or {}, {node: item.when for node, item in items.items()})
    victims: list[StoredObject] = []
    kept: list[StoredObject] = []
    for node in order:
        too_old = retention.max_age is not None and now - recency[node] > retention.max_age
        (victims if too_old else kept).append(items[node])
    if retention.max_bytes is not None:
        remaining = sum(item.size for item in kept)
        for item in kept:
            if remaining <= retention.max_bytes:
                break
            victims.append(item)
            remaining -= item.size
    return victims


def removal_rounds(victims: Sequence[StoredObject], links: dict[Node, Node]) -> list[list[StoredObject]]:
    """``victims`` in rounds: first those with no victim after them in their prefix, then their parents, ...

    A round is removed once the ones before it are (see :func:`run_gc`). Without links: one round.
    """
    members = {node_of(item) for item in victims}
    height: dict[Node, int] = {}
    for item in victims:  # in the plan's order: every victim comes after its descendants
        node = node_of(item)
        height.setdefault(node, 0)
        parent = links.get(node)
        if parent in members:
            height[parent] = max(height.get(parent, 0), height[node] + 1)
    rounds: list[list[StoredObject]] = [[] for _ in range(max(height.values(), default=-1) + 1)]
    for item in victims:
        rounds[height[node_of(item)]].append(item)
    return rounds


def _removes_something(objects: Sequence[StoredObject], retention: Retention, now: float) -> bool:
    """Whether the rules remove anything, links aside (they change which chunks go, never whether any does)."""
    if retention.max_bytes is not None and sum(item.size for item in objects) > retention.max_bytes:
        return True
    return retention.max_age is not None and any(now - item.when > retention.max_age for item in objects)


async def read_parents(backend: Backend, objects: Sequence[StoredObject]) -> list[ChunkKey | None]:
    """Each object's parent key (None where none is recorded): the links the backend keeps apart from its
    chunks (Redis), else each chunk header's record."""
    kept_apart = await backend.read_parents(objects)
    if kept_apart is not None:
        return kept_apart
    return await read_header_fields(backend, objects, lambda head: header_records(head).parent, None, PARENT_READS)


@dataclass
class TierPlan:
    """One tier's gc plan: everything listed, and the victims chosen from it (deleted only if still as listed)."""

    tier: str
    age_basis: str
    listed: list[StoredObject]
    victims: list[StoredObject]
    namespaces: Callable[[str], bool] | None = None  # the namespace directories listed (None: all)
    links: dict[Node, Node] = field(default_factory=dict)  # each chunk's parent, where read (see prefix_links)

    @property
    def listed_bytes(self) -> int:
        """Bytes of everything listed."""
        return sum(item.size for item in self.listed)

    @property
    def victim_bytes(self) -> int:
        """Bytes of the chosen victims."""
        return sum(item.size for item in self.victims)


async def plan_gc(
    backends: dict[str, Backend],
    accept: Callable[[str], bool] | None,
    retention: Retention,
    *,
    now: float | None = None,
    on_page: Callable[[str, int], None] | None = None,
) -> list[TierPlan]:
    """List every tier, read its prefix links if anything is to go, then choose what goes. Nothing is deleted:
    a dry run is exactly this."""
    plans = []
    for name, backend in backends.items():
        objects = await list_objects(backend, accept, None if on_page is None else lambda n, t=name: on_page(t, n))
        moment = time.time() if now is None else now
        links = {}
        if _removes_something(objects, retention, moment):
            links = prefix_links(objects, await read_parents(backend, objects))
        victims = choose_victims(objects, retention, moment, links)
        plans.append(TierPlan(name, backend.age_basis, objects, victims, accept, links))
    return plans


async def run_gc(
    backends: dict[str, Backend],
    plans: Sequence[TierPlan],
    progress: Callable[[str, RemoveReport], None] | None = None,
    events: RemovalEvents | None = None,
) -> dict[str, RemoveReport]:
    """Remove each plan's victims that are still as listed; per tier, what happened.

    A prefix's victims go in rounds, its tail first (:func:`removal_rounds`): a victim whose descendant
    was kept (used or rewritten since the listing, or not removed for an error) is kept too, counted as
    changed, so gc never leaves a chunk whose parent it removed. ``events``: publish each tier's removals,
    each chunk named from its header (read just before its deletion: one small read per deleted object,
    only then).
    """
    reports = {}
    for plan in plans:
        backend = backends[plan.tier]
        step: Progress | None = None if progress is None else (lambda report, t=plan.tier: progress(t, report))
        head_bytes = HEAD_BYTES if events is not None else 0
        report, spared = RemoveReport(), set[Node]()
        for round_ in removal_rounds(plan.victims, plan.links):
            batch = [item for item in round_ if node_of(item) not in spared]
            kept = RemoveReport(changed=len(round_) - len(batch))
            if kept.changed and step is not None:
                step(kept)
            done = await backend.remove_unchanged(batch, step, head_bytes=head_bytes) if batch else RemoveReport()
            report.add(kept)
            report.add(done)
            removed = {node_of(removal.item) for removal in done.deleted}
            for item in round_:  # a victim kept keeps its parent, which keeps its own, ... (later rounds)
                if node_of(item) not in removed and (parent := plan.links.get(node_of(item))) is not None:
                    spared.add(parent)
        await backend.prune_links(plan.namespaces)  # links of chunks gone (Redis keeps them apart)
        reports[plan.tier] = report
        if events is not None:
            events.report(plan.tier, backend, report)
    return reports

"""What ``kvstore gc`` and ``kvstore verify --delete`` tell routers: a ``BlockRemoved`` for what they removed.

With ``events.enabled``, a removal publishes, per tier, one ``BlockRemoved`` of the chunks it
actually deleted (not those kept because they changed since listed, already gone, or failed),
with the tier's ``medium`` and ``locality`` (:meth:`Medium.of_tier`) and ``ownership`` "kvstore".

- **Names.** A chunk is named as the store that wrote it named it: by the engine's hash kept in
  its header (:func:`~kvstore.storage.container.header_name`), else by its key's 32 bytes. gc
  has each removed object's first :data:`HEAD_BYTES` read just before its deletion (one small
  read per deleted object, only with events on); verify has read every object whole already.
  A header longer than :data:`HEAD_BYTES` (a model of over ~125 layers) names the chunk by its key.
- **Topics.** A namespace's chunks go under the topic a store of that namespace publishes on:
  ``events.topic`` with ``{model}`` = ``events.model``, else the namespace directory (the
  namespace itself, for a plain name). One publisher per distinct topic.
- **Sockets.** ``events.admin_endpoint``, else ``events.endpoint`` (see the events page): an
  :class:`~kvstore.events.publisher.EventPublisher` per topic, opened before the removal. A
  command publishes once and exits: its publisher holds the batches until a subscription has
  come (at most :data:`SUBSCRIBER_WAIT` seconds) and closing lingers up to 1 s for them to
  leave. Meant to be the router's SUB address, connected to; a bound fixed port
  (``tcp://*:5567``) serves one topic only, and only a subscriber already trying to connect to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvstore.backends.base import CHUNK_HEAD_BYTES
from kvstore.config import EventsConfig, StoreConfig
from kvstore.errors import ConfigError
from kvstore.events import ChunkEvents, Medium
from kvstore.events.wire import BlockHash
from kvstore.keys import key_to_bytes
from kvstore.storage.container import name_in_head

if TYPE_CHECKING:
    from kvstore.backends import Backend, RemoveReport

HEAD_BYTES = CHUNK_HEAD_BYTES  # what gc reads of each object it deletes: a header of up to ~125 layers
SUBSCRIBER_WAIT = 1.0  # seconds a command's events wait for a subscriber once the removal is done


def chunk_name(head: bytes | None, key: str) -> BlockHash | None:
    """How events name a removed chunk: the engine's name its header keeps, else its key's 32 bytes.

    ``head``: the object's first bytes (None: not read, or unreadable); a damaged or foreign
    header falls back to the key. None only for an object whose name is no kvstore key, which
    no store can have advertised.
    """
    name = name_in_head(head)
    if name is not None:
        return name
    try:
        return key_to_bytes(key)
    except ValueError:
        return None


class RemovalEvents:
    """The publishers of one command's removals, one per topic (see the module docstring)."""

    def __init__(self, config: EventsConfig, namespaces: Iterable[str]) -> None:
        """Open a publisher for each topic the ``namespaces`` (directories) publish under.

        Opened before anything is removed, so a socket that cannot be opened stops the command
        first (a ConfigError naming the option and the fix), and a subscriber has the removal's
        duration to connect to a bound one.
        """
        from kvstore.events.publisher import EventPublisher, binds, offset_port  # zmq: only when events are on

        self._endpoint = config.admin_endpoint or config.endpoint
        self._events: dict[str, ChunkEvents] = {}  # per topic
        self._topics: dict[str, str] = {}  # per namespace directory
        for namespace in sorted(set(namespaces)):
            self._topics[namespace] = config.resolved_topic(namespace)
        topics = sorted(set(self._topics.values()))
        if len(topics) > 1 and binds(self._endpoint) and not self._endpoint.endswith(":0"):
            raise ConfigError(
                f"events.admin_endpoint: {self._endpoint!r} binds one socket, but the chunks to remove belong to "
                f"{len(topics)} namespaces, each published under its own topic; set events.admin_endpoint to "
                "the router's address (connected to), or events.model (one topic), or run once per --namespace"
            )
        rank = config.data_parallel_rank
        try:
            for topic in topics:
                events = ChunkEvents(chunk_tokens=0)  # only BlockRemoved, which has no block size
                publisher = EventPublisher(
                    offset_port(self._endpoint, rank),
                    topic=topic,
                    data_parallel_rank=rank,
                    subscriber_wait=SUBSCRIBER_WAIT,
                    option="admin_endpoint",
                )
                events.start(publisher)
                self._events[topic] = events
        except ConfigError:
            self.close()
            raise

    def report(
        self,
        tier: str,
        backend: Backend,
        report: RemoveReport,
        names: Mapping[tuple[str, str], BlockHash | None] | None = None,
    ) -> None:
        """Publish the chunks ``report`` says were deleted from ``tier``: each named by ``names``
        ((namespace, key) to name) where given, else by the head the removal read (:func:`chunk_name`)."""
        chunks: list[tuple[str, BlockHash | None]] = []
        for item, head in report.deleted:
            name = names.get((item.namespace, item.key)) if names is not None else None
            chunks.append((item.namespace, name if name is not None else chunk_name(head, item.key)))
        self.removed(tier, backend.is_local, chunks)

    def removed(self, tier: str, is_local: bool, chunks: Sequence[tuple[str, BlockHash | None]]) -> None:
        """``chunks`` (namespace directory, name) left tier ``tier``: a BlockRemoved per topic."""
        medium = Medium.of_tier(tier, is_local)
        by_topic: dict[str, list[BlockHash]] = {}
        for namespace, name in chunks:
            if name is not None and namespace in self._topics:
                by_topic.setdefault(self._topics[namespace], []).append(name)
        for topic, names in by_topic.items():
            self._events[topic].removed_hashes(medium, names)

    def close(self) -> None:
        """Send everything held, once subscribed (see the module docstring), and close."""
        for events in self._events.values():
            events.close()
        self._events.clear()


@contextmanager
def removal_events(config: StoreConfig, namespaces: Iterable[str]) -> Iterator[RemovalEvents | None]:
    """The publishers for removing chunks of ``namespaces`` when ``config.events`` is enabled (else
    None), closed when the block ends, whatever happened in it."""
    if not config.events.enabled:
        yield None
        return
    if not config.events.model and "{model}" in config.events.topic:
        from kvstore.cli.console import errors

        errors.print(
            "kvstore: events.model is not set: removals are published under each namespace as the model; "
            "an engine publishes under its model's name (vLLM: the served model name). Set events.model "
            "(and events.engine_id, where this is not the engine's host) to the engine's, so routers match them",
            highlight=False,
        )
    events = RemovalEvents(config.events, namespaces)
    try:
        yield events
    finally:
        events.close()

"""ZeroMQ publisher of KV-event batches, on vLLM's sockets and framing (so vLLM's subscribers read it).

- PUB socket: each batch is a multipart message ``(topic, sequence, payload)``: the topic in
  UTF-8, the batch's sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher), the
  msgpack ``KVEventBatch`` (:mod:`kvstore.events.wire`).
- Replay (optional ROUTER socket): a subscriber that saw a gap sends ``(b"", start)`` from a
  DEALER socket (``start``: 8 bytes big-endian; a REQ socket would take one reply only); it gets
  back every batch still buffered from ``start`` on, each as ``(b"", topic, sequence, payload)``,
  then ``(b"", b"", -1, b"")``.

An endpoint with ``*`` or ``::``, or an ``ipc://``/``inproc://`` one, is bound; any other is
connected to (a router's or proxy's bound SUB socket): vLLM's rule. A connecting publisher holds
its first batch until the subscriber's subscription has come (at most ``subscriber_wait``
seconds): a PUB socket drops what it sends before then, and ``kvstore gc`` publishes once, at
once. A bound one does not wait (subscribers that join late ask the replay socket).
The replay socket is always bound. ``tcp://*:0`` binds a free port, which :attr:`EventPublisher.endpoint` then names.

:meth:`EventPublisher.publish` never blocks and never raises for a slow subscriber: events go
into a bounded queue, and one thread sends them, batched for up to ``flush_interval`` seconds.
A full queue drops the events, counted in ``dropped``: the engine never waits on a router.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq

from kvstore.config.sections import MAX_PORT
from kvstore.errors import ConfigError
from kvstore.events.wire import KVEvent, KVEventBatch, encode_batch

log = logging.getLogger("kvstore.events")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
BATCH_EVENTS = 512  # at most this many events in one batch


def offset_port(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank``: its TCP port plus ``rank`` (vLLM's rule; port 0 stays 0)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"events endpoint {endpoint!r} has no TCP port to offset for data-parallel rank {rank}")
    if port == "0":
        return endpoint
    if int(port) + rank > MAX_PORT:  # ZeroMQ would wrap it (65542 binds port 6): EventsConfig refuses these too
        raise ConfigError(
            f"events endpoint {endpoint!r} with data-parallel rank {rank} gives port {int(port) + rank}, past "
            f"{MAX_PORT}; lower the port to at most {MAX_PORT - rank}"
        )
    return f"{base}:{int(port) + rank}"


def binds(endpoint: str) -> bool:
    """Whether an endpoint is bound (wildcards, ipc, inproc) rather than connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """Sends batches of events to subscribers (see the module docstring). Thread-safe ``publish``."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int | None = None,
        buffer_batches: int = 10_000,
        max_queue: int = 100_000,
        hwm: int = 100_000,
        flush_interval: float = 0.01,
        linger: float = 1.0,
        subscriber_wait: float = 5.0,
        option: str = "endpoint",
    ) -> None:
        """Opens the sockets (a ConfigError naming ``events.<option>`` if one cannot be opened), starts the thread."""
        self.topic = topic
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._flush_interval = flush_interval
        self._linger_ms = int(linger * 1000)
        self._queue: queue.Queue[list[KVEvent] | Callable[[], Sequence[KVEvent]] | None] = queue.Queue(
            maxsize=max_queue
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.batches = 0  # sent
        self.events = 0  # sent
        self.dropped = 0  # events refused by a full queue, or published after close
        self._context = zmq.Context.instance()
        # XPUB: a PUB that also hears subscriptions (subscribers see no difference)
        self._pub = self._context.socket(zmq.XPUB)
        self._subscribed = False
        self._subscriber_wait = subscriber_wait
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = self._open(self._pub, endpoint, option)
            self._connects = not binds(endpoint)
            if replay_endpoint:  # always bound: subscribers come to it
                self._replay = self._context.socket(zmq.ROUTER)
                self.replay_endpoint: str | None = self._open(self._replay, replay_endpoint, "replay_endpoint", True)
            else:
                self.replay_endpoint = None
        except BaseException:
            self._close_sockets(0)
            raise
        self._poller = zmq.Poller()  # the thread's sockets: subscriptions and replay requests come in on them
        self._poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            self._poller.register(self._replay, zmq.POLLIN)
        self._closed = False
        self._stop = False  # set by close(): the thread stops at its next turn
        self._lock = threading.Lock()  # publish against close, and the counters publishers write
        self._failed = False  # a batch could not be encoded or sent: said once
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket: zmq.Socket[bytes], endpoint: str, option: str, bind: bool = False) -> str:
        try:
            if bind or binds(endpoint):
                socket.bind(endpoint)
                return socket.getsockopt_string(zmq.LAST_ENDPOINT)
            socket.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            raise ConfigError(
                f"events.{option} = {endpoint!r} cannot be opened ({exc}); bind a free port ('tcp://*:5567', "
                "'tcp://*:0' for any) or connect to a subscriber's address ('tcp://router-host:5567')"
            ) from None

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue events for the next batch; never blocks (a full queue, or a closed publisher, drops them, counted)."""
        if events:
            self._enqueue(list(events), len(events))

    def publish_later(self, make: Callable[[], Sequence[KVEvent]], count: int) -> None:
        """Queue ``count`` events that the publisher's thread makes (``make()``), off the caller's path."""
        if count:
            self._enqueue(make, count)

    def _enqueue(self, item: list[KVEvent] | Callable[[], Sequence[KVEvent]], count: int) -> None:
        with self._lock:
            if not self._closed:
                try:
                    self._queue.put_nowait(item)
                    return
                except queue.Full:
                    pass
            self.dropped += count

    def close(self) -> None:
        """Send what is queued, then close; never hangs: at most ``subscriber_wait`` + ``linger`` + 1 s.

        A connected socket keeps sending for ``linger`` seconds after (ZeroMQ's own thread).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(None, timeout=1.0)  # the thread sends everything before it, then stops
        except queue.Full:  # the thread is gone or stuck: what is queued is dropped
            self._stop = True
        self._thread.join(timeout=self._subscriber_wait + 1.0)
        self._stop = True  # a thread still running stops at its next turn, and sends nothing more
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        if not self._thread.is_alive():  # sockets belong to the thread while it runs
            self._close_sockets(self._linger_ms)

    def _close_sockets(self, linger_ms: int) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        """Send batches until closed; any failure is logged once and costs its batch, never the thread."""
        pending: list[KVEvent] = []
        stopping = False
        while not stopping and not self._stop:
            try:
                stopping = self._turn(pending)
            except Exception as exc:
                self._dropped_batch(pending, exc)
                pending.clear()

    def _turn(self, pending: list[KVEvent]) -> bool:
        """One turn of the thread: the sockets, then a batch if events came; whether to stop.

        A batch's first events wait ``flush_interval`` for more to join them, the sockets served
        meanwhile: one wake-up per batch, not per event (an engine's puts never wait on this thread).
        """
        self._serve_sockets(0.0)
        try:
            item = self._queue.get(timeout=0.05)
        except queue.Empty:
            return False
        if item is None:
            return True
        pending.extend(item() if callable(item) else item)
        self._serve_sockets(self._flush_interval)
        stopping = False
        while len(pending) < BATCH_EVENTS:  # what else is queued joins the batch
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                stopping = True
                break
            pending.extend(more() if callable(more) else more)
        while pending:
            batch = pending[:BATCH_EVENTS]
            del pending[:BATCH_EVENTS]
            try:
                self._send(batch)
            except Exception as exc:
                self._dropped_batch(batch, exc)
        return stopping

    def _serve_sockets(self, seconds: float) -> None:
        """Take subscriptions and answer replay requests as they come, for ``seconds`` (0: those waiting now)."""
        deadline = time.monotonic() + seconds
        while True:
            ready = dict(self._poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self._pub in ready:
                self._take_subscriptions(0)
            if self._replay is not None and self._replay in ready:
                self._serve_replay()
            if not ready or time.monotonic() >= deadline:
                return

    def _dropped_batch(self, events: list[KVEvent], exc: Exception) -> None:
        with self._lock:
            self.dropped += len(events)
        if not self._failed:
            self._failed = True
            log.warning(
                "kvstore events: %d events dropped (%r); later failures are counted in dropped", len(events), exc
            )

    def _take_subscriptions(self, timeout_ms: int) -> None:
        """Read the subscriptions that came (within ``timeout_ms``): they only say a subscriber is there."""
        while self._pub.poll(timeout_ms):
            self._pub.recv()
            self._subscribed = True
            timeout_ms = 0

    def _send(self, events: list[KVEvent]) -> None:
        if self._connects and not self._subscribed and self.batches == 0:
            self._take_subscriptions(int(self._subscriber_wait * 1000))
        sequence = self.batches
        try:
            payload = encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        except (TypeError, ValueError, OverflowError):  # an event msgpack cannot carry: it goes, not its batch
            events = [event for event in events if self._encodable(event)]
            if not events:
                return
            payload = encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        try:
            self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
        except zmq.ZMQError as exc:  # never the engine's problem: the batch stays in the replay buffer
            log.debug("kvstore events: batch %d not sent (%s)", sequence, exc)
        self._buffer.append((sequence, payload))
        self.batches += 1
        self.events += len(events)

    def _encodable(self, event: KVEvent) -> bool:
        try:
            encode_batch(KVEventBatch(ts=0.0, events=[event]))
            return True
        except (TypeError, ValueError, OverflowError) as exc:
            self._dropped_batch([event], exc)
            return False

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.debug("kvstore events: a malformed replay request (%d frames) is ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart((client, b"", self._topic, sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

"""SyncKVStore: the whole contract between an engine integration and the store.

An engine's connector (vLLM, SGLang, transformers, or a new one) uses this class and nothing
behind it: the layout, the tiers' names, KV events' chunk names, the load planner's plans and
observations, the bound on a layer's wait, and the store's calls, blocking or as futures. The
asynchronous :class:`~kvstore.KVStore` it drives runs on an event loop in one background thread
and stays private to it (``tests/test_package_layout.py`` fails if a connector reaches it). The
store's rules (how long a call or a layer may take, where a measured load's time goes) are
decided here or below, once, never re-derived by a connector.

Each blocking method submits the async method to that loop and waits for its result: a thin
wrapper, so behaviour and errors are the async core's. ``put`` waits only for the DRAM copy; the
writes to slower tiers continue on the loop thread while the engine goes on. Each ``*_future``
method returns at once (for an engine's scheduler, which never waits on I/O).

A call that ends early never leaves work behind in the caller's memory. A ``*_future`` returns a
:class:`~kvstore.engine.loop_thread.LoopCall`, whose ``cancel()`` returns only once its coroutine
has stopped (a read that fills the caller's ``outs`` writes nothing into them after that; see
``KVStore.get_many``), and a blocking call interrupted in the engine thread (a ``flush(timeout)``
that times out, a KeyboardInterrupt) cancels its coroutine the same way before the exception
reaches the caller. The wait is bounded by ``timeouts.close``: the store's own operations stop
within it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from kvstore.config import StoreConfig
from kvstore.engine.arguments import check_tensor, check_tensors
from kvstore.engine.loop_thread import LoopCall, LoopWaker, on_loop
from kvstore.engine.planner import LoadPlan, PrefillClock
from kvstore.engine.store import KVStore
from kvstore.engine.streams import LayerStream
from kvstore.engine.transfer import DONE, Completion, ready_on_current_stream
from kvstore.errors import KVStoreError, LayerTimeout, StoreClosedError
from kvstore.events import ChunkEvents, ChunkIdentity
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.sizing.advice import Advice

T = TypeVar("T")
log = logging.getLogger("kvstore")
HOP_MARGIN_S = 5.0  # beyond the store's own deadline, for the hop to its loop thread and back


class SyncKVStore:
    """:class:`~kvstore.KVStore` for engine threads: the contract every connector uses (see the module's doc)."""

    def __init__(self, config: StoreConfig, layout: KVLayout, namespace: str, **kwargs: Any) -> None:
        """Open a store (blocking); ``kwargs`` are :class:`~kvstore.KVStore`'s (``salt``, ``tiers``)."""
        self._settle_s = config.timeouts.close  # how long a cancelled call may take to stop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-loop", daemon=True)
        self._thread.start()
        self._waker = LoopWaker(self._loop)
        try:
            self._store = self._call(self._create(config, layout, namespace, kwargs))
        except BaseException:
            self._stop_loop()
            raise
        timeouts = config.timeouts
        # A layer waits at most for the tiers' header reads plus its own read, each bounded by timeouts.get.
        self.layer_wait_timeout: float = (len(self._store.tiers) + 2) * timeouts.get
        # A call the caller bounds (call_within): the store's own deadline for it, and the hop.
        self.call_timeout: float = timeouts.get + HOP_MARGIN_S
        tiers = self._store.tiers  # fixed once the store is open: what depends on them is said once, here
        # The tiers, fastest first: "dram", then each secondary tier's name ("disk", "redis", ...).
        self.tier_names: tuple[str, ...] = ("dram", *(tier.name for tier in tiers))
        # The tiers read on this machine ("dram", a disk): a load from them alone may run inside an engine's
        # forward pass, when expected fast enough; one that needs another tier (Redis, S3, a remote plugin) never.
        self.local_tiers: frozenset[str] = frozenset(("dram", *(tier.name for tier in tiers if tier.is_local)))
        # The store in one line, for an engine's start-up log: namespace, layout, each tier's place, size and codec.
        self.description: str = self._store.describe()

    @staticmethod
    async def _create(config: StoreConfig, layout: KVLayout, namespace: str, kwargs: dict[str, Any]) -> KVStore:
        return await KVStore(config, layout, namespace, **kwargs).open()

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for it; if the wait ends early (a timeout, an interrupt),
        the coroutine is cancelled, and has stopped, before the exception is raised."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("SyncKVStore methods cannot be called from its own event-loop thread")
        call = self._submit(coroutine)
        try:
            return call.result(timeout)
        except BaseException:
            call.cancel()  # False if it had ended: then nothing is left running
            raise

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> LoopCall[T]:
        """Run a coroutine on the store's loop without waiting for it (non-blocking)."""
        if self._loop.is_closed() or not self._thread.is_alive():
            coroutine.close()
            raise StoreClosedError("the SyncKVStore is closed")
        call: LoopCall[T] = LoopCall(self._loop, self._thread, self._settle_s)
        try:
            self._loop.call_soon_threadsafe(call.start, coroutine)
        except RuntimeError:  # the loop closed meanwhile
            coroutine.close()
            raise StoreClosedError("the SyncKVStore is closed") from None
        return call

    # -- what the store is -------------------------------------------------------------------

    @property
    def layout(self) -> KVLayout:
        """The chunk layout the store was opened with."""
        return self._store.layout

    @property
    def metrics_port(self) -> int | None:
        """Where the store's Prometheus exporter listens (``metrics.enabled``), else None."""
        return self._store.metrics_port

    @property
    def publishes_events(self) -> bool:
        """Whether the store publishes KV events (``events.enabled``); :meth:`name_chunks` is a no-op otherwise."""
        return isinstance(self._store.events, ChunkEvents)

    def name_chunks(self, names: Mapping[ChunkKey, ChunkIdentity]) -> None:
        """Advertise each chunk in KV events by the engine's own name for it (non-blocking; thread-safe)."""
        events = self._store.events
        if isinstance(events, ChunkEvents):
            for key, identity in names.items():
                events.attribute(key, identity)

    def chunk_keys(self, token_ids: Sequence[int], extra: bytes | None = None) -> list[ChunkKey]:
        return self._store.chunk_keys(token_ids, extra)

    # -- puts --------------------------------------------------------------------------------

    def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None) -> bool:
        """``KVStore.put``; a device ``kv`` is copied once the work queued on this thread's current stream is done."""
        check_tensor(kv, "put: kv")  # before its device is read here
        return self._call(self._store.put(key, kv, parent=parent, ready=ready_on_current_stream(kv.device)))

    def put_many(
        self,
        keys: Sequence[ChunkKey],
        kvs: Sequence[torch.Tensor],
        *,
        parents: Sequence[ChunkKey | None] | None = None,
    ) -> list[bool]:
        """``KVStore.put_many`` (one hop to the loop for all of them); device tensors as in :meth:`put`."""
        return self._call(self._puts(keys, kvs, parents, None, None))

    def put_many_future(
        self,
        keys: Sequence[ChunkKey],
        kvs: Sequence[torch.Tensor],
        *,
        parents: Sequence[ChunkKey | None] | None = None,
        prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
        then: Callable[[list[bool]], T] | None = None,
    ) -> LoopCall[Any]:
        """:meth:`put_many` without waiting (non-blocking): the chunks must stay unchanged until it resolves.

        Device tensors are copied once the work queued so far on this thread's current stream is done.
        ``prepare``: each chunk is ``prepare(kvs[i])``, made on the store's loop one chunk at a time
        just before its copy into DRAM (a caller's reordering, off its own thread and needing memory
        for one chunk, not all); the chunks are then put one by one, as by :meth:`put` (a chunk that
        fails its checks fails the call, the ones before it stay put). ``then``: called on the store's
        loop with the list of what each put returned, before the future resolves to its result.
        """
        return self._submit(self._puts(keys, kvs, parents, prepare, then))

    def _puts(
        self,
        keys: Sequence[ChunkKey],
        kvs: Sequence[torch.Tensor],
        parents: Sequence[ChunkKey | None] | None,
        prepare: Callable[[torch.Tensor], torch.Tensor] | None,
        then: Callable[[list[bool]], Any] | None,
    ) -> Coroutine[Any, Any, Any]:
        """The coroutine of :meth:`put_many_future`; its tensors checked here, on the caller's thread."""
        check_tensors(kvs, "put_many: kvs")  # before their devices are read here
        ready = _ready_for(kvs)

        def puts() -> Coroutine[Any, Any, list[bool]]:
            if prepare is None:
                return self._store.put_many(keys, kvs, parents=parents, ready=ready)
            return _put_prepared(self._store, keys, kvs, parents, prepare, ready)

        return puts() if then is None else _then(puts, then)

    # -- lookups and plans -------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        return self._call(self._store.lookup(keys))

    def lookup_future(self, keys: Sequence[ChunkKey]) -> LoopCall[int]:
        """``lookup`` without waiting: for callers that must not block (an engine's scheduler)."""
        return self._submit(self._store.lookup(keys))

    def plan(self, keys: Sequence[ChunkKey]) -> LoadPlan:
        """``KVStore.plan``: how many leading ``keys`` to load, and from which tier (blocking)."""
        return self._call(self._store.plan(keys))

    def plan_future(self, keys: Sequence[ChunkKey]) -> LoopCall[LoadPlan]:
        """``plan`` without waiting: for callers that must not block (an engine's scheduler)."""
        return self._submit(self._store.plan(keys))

    def plan_tiers(self, tiers: Sequence[str]) -> LoadPlan:
        """The plan for chunks already known to be held where ``tiers`` says (no I/O; on the calling thread)."""
        return self._store.planner.plan(tiers)

    def expected_load_seconds(self, tiers: Sequence[str]) -> float:
        """How long loading chunks held where ``tiers`` says is expected to take, a tier never measured at its
        seed bandwidth (no I/O; on the calling thread): how long such a load may hold an engine's step."""
        return self._store.planner.expected_seconds(tiers, [tier in self.local_tiers for tier in tiers])

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` of prefill in ``seconds``: the planner's recompute rate (non-blocking)."""
        self._store.planner.observe_prefill(tokens, seconds)

    def observe_load(self, plan: LoadPlan, seconds: float) -> None:
        """A planned load (``plan.load`` chunks) took ``seconds`` as the engine saw it (non-blocking).

        The time goes to the tier whose share of the plan was expected to cost the most; the other
        tiers' chunks are taken at their expected time (see ``LoadPlanner.observe_load``).
        """
        self._store.planner.observe_load(plan, seconds)

    def prefill_clock(self, min_tokens: int, timed: bool = True) -> PrefillClock:
        """A clock that times an engine's prefill steps into the planner (``timed`` False: a clock that
        measures nothing, for an engine whose steps cannot be timed)."""
        return PrefillClock(self._store.planner if timed else None, min_tokens)

    # -- reads -------------------------------------------------------------------------------

    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self._call(self._store.get(key, out))

    def get_many(
        self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor | None]:
        """``KVStore.get_many``: each chunk as ``outs[i]`` (or a new tensor), or None on a miss.

        Once this returns, or raises, nothing writes into ``outs`` any more; so too once a
        :meth:`get_many_future`'s ``cancel()`` has returned.
        """
        return self._call(self._store.get_many(keys, outs))

    def get_many_future(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[torch.Tensor] | None = None,
        *,
        then: Callable[[list[torch.Tensor | None]], T] | None = None,
    ) -> LoopCall[Any]:
        """:meth:`get_many` without waiting (non-blocking); its ``cancel()`` returns once nothing writes into ``outs``.

        ``then``: called on the store's loop with the chunks read, before the future resolves to its
        result (a caller's work on what was read, such as a reorder into its own buffers, off its thread).
        """
        if then is None:
            return self._submit(self._store.get_many(keys, outs))
        return self._submit(_then(lambda: self._store.get_many(keys, outs), then))

    def call_within(self, call: LoopCall[T], what: str) -> T | None:
        """Wait for ``call`` at most :attr:`call_timeout` (the store's ``timeouts.get`` and the hop); None if it
        failed (a KVStoreError, logged) or was late: then it is stopped first, so a late read writes nothing
        into the caller's memory afterwards. For engines that treat a slow or failed call as a miss."""
        try:
            return call.result(timeout=self.call_timeout)
        except TimeoutError:
            call.cancel()
            log.warning("kvstore %s did not end within %.1fs; treated as a miss", what, self.call_timeout)
        except KVStoreError as exc:
            log.warning("kvstore %s failed (%s); treated as a miss", what, exc)
        return None

    def prefetch(
        self, keys: Sequence[ChunkKey], *, depth: int = 2, outs: Sequence[torch.Tensor] | None = None
    ) -> SyncLayerStream:
        """The layer stream for engine threads: ``stream.wait_layer(i)`` blocks until layer i is in.

        Wait for a layer at most :attr:`layer_wait_timeout`: the longest a layer can take while the
        store keeps its own bounds.
        """
        if outs is not None:  # before their device is read here
            check_tensors(outs, "prefetch: outs")
        ready = ready_on_current_stream(outs[0].device) if outs else None  # this thread's stream, not the loop's
        stream = self._call(on_loop(lambda: self._store.prefetch(keys, depth=depth, outs=outs, ready=ready)))
        return SyncLayerStream(self, stream)

    # -- the rest ----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> None:
        self._call(self._store.flush(), timeout)

    def stats(self) -> dict[str, dict[str, Any]]:
        """The store's counters, per tier (read on its loop: blocking, briefly)."""
        return self._call(on_loop(self._store.stats))

    def stats_now(self) -> dict[str, dict[str, Any]]:
        """:meth:`stats` read on the calling thread, without the hop to the loop (non-blocking: for an engine's
        per-step report; a counter may be one update behind)."""
        return self._store.stats()

    def advise(self, bounds: tuple[int, int] | None = None) -> Advice:
        """:meth:`KVStore.advise`, run on the store's loop (the tracker is the loop's)."""
        return self._call(on_loop(lambda: self._store.advise(bounds)))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            # close() bounds each of its steps (streams, pending writes, tiers) by timeouts.close.
            self._call(self._store.close(), timeout=3 * self._settle_s + 5)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._waker.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SyncKVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _ready_for(kvs: Sequence[torch.Tensor]) -> Completion | None:
    """When chunks on a device may be read: after the work queued so far on this thread's current stream."""
    device = next((kv.device for kv in kvs if kv.device.type == "cuda"), None)
    return ready_on_current_stream(device) if device is not None else None


async def _put_prepared(
    store: KVStore,
    keys: Sequence[ChunkKey],
    kvs: Sequence[torch.Tensor],
    parents: Sequence[ChunkKey | None] | None,
    prepare: Callable[[torch.Tensor], torch.Tensor],
    ready: Completion | None,
) -> list[bool]:
    """Each chunk prepared and put in turn, on the loop (see :meth:`SyncKVStore.put_many_future`)."""
    if len(keys) != len(kvs):
        raise ValueError(f"put_many: {len(keys)} keys but {len(kvs)} chunks")
    chain = parents if parents is not None else [None] * len(keys)
    if len(chain) != len(keys):
        raise ValueError(f"put_many: {len(keys)} keys but {len(chain)} parents")
    return [
        await store.put(key, prepare(kv), parent=parent, ready=ready)
        for key, kv, parent in zip(keys, kvs, chain, strict=True)
    ]


async def _then(start: Callable[[], Coroutine[Any, Any, Any]], then: Callable[[Any], T]) -> T:
    """``then`` of what the call ``start()`` makes returns, on the loop (the call is made only once this runs:
    one never started leaves no coroutine behind)."""
    return then(await start())


class SyncLayerStream:
    """A :class:`~kvstore.engine.streams.LayerStream` driven from an engine thread; close it when done."""

    def __init__(self, owner: SyncKVStore, stream: LayerStream) -> None:
        self._owner, self._stream = owner, stream

    def wait_layer(self, index: int, timeout: float | None = None) -> torch.Tensor:
        """Layer ``index`` (blocking until it has arrived, at most ``timeout`` seconds if given).

        Raises :class:`PrefetchError` if it cannot be loaded, :class:`LayerTimeout` (a PrefetchError
        and a TimeoutError) if it is late, :class:`StoreClosedError` if the store closed first.
        No round trip through the loop: the request is recorded (the loop is woken only if the
        stream waits for it, see ``StreamPace.request_from_thread``), the arrival is a
        threading.Event (a layer that is already in costs microseconds, not a thread hop).
        With device outputs, the calling thread's current stream waits for the layer's copies
        (a device-side wait: this returns once the copies are queued, not once they are done).
        """
        stream = self._stream
        if not 0 <= index < stream.num_layers:
            raise IndexError(f"layer {index} out of range for {stream.num_layers} layers")
        loop = self._owner._loop
        if loop.is_closed():  # the store's loop is closed: what has arrived is all there will be
            if not stream.arrived[index].is_set():
                raise StoreClosedError(f"the store closed before layer {index} of its stream arrived")
        elif stream.pace.request_from_thread(index):
            self._owner._waker.post(stream.pace.request, index)
        if not stream.arrived[index].wait(timeout):
            raise LayerTimeout(f"layer {index} did not arrive within {timeout}s")
        outcome = stream.outcomes[index]
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        stream.completions[index].wait_on_current_stream()
        return outcome

    def release(self, index: int) -> None:
        """With a ring of outputs, this thread is done with layer ``index`` (see ``LayerStream``): its buffer
        takes a later layer once the work queued so far on this thread's current stream has ended. Non-blocking;
        no round trip through the loop unless the stream waits for it."""
        stream = self._stream
        if not stream.ring:
            return
        outcome = stream.outcomes[index]
        after = ready_on_current_stream(outcome.device) if isinstance(outcome, torch.Tensor) else DONE
        if stream.pace.release_from_thread(index, after) and not self._owner._loop.is_closed():
            self._owner._waker.post(stream.pace.wake, index)

    def on_arrival(self, index: int, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(None)`` on the store's loop when layer ``index`` has arrived and its copies into
        device outputs have completed (its error if it cannot); non-blocking. A load planner times a
        whole load this way (layer -1: the last)."""
        stream = self._stream

        async def notify() -> None:
            try:
                await stream.landed(index % stream.num_layers)
            except Exception as exc:
                callback(exc)
            else:
                callback(None)

        self._owner._submit(notify())

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Every layer in order; with a ring of outputs, each is released when the next is asked for."""
        for index in range(self._stream.num_layers):
            yield index, self.wait_layer(index)
            self.release(index)

    def close(self) -> None:
        """Stop the stream and release what it holds; bounded by ``timeouts.close`` (plus a margin).

        Once it returns, nothing of the stream writes into its ``outs`` again (see ``LayerStream.close``),
        unless it logged that the stream did not close in time: a read into them stalled (a hung disk), and
        they may still be written. A no-op once the store is closed (closing the store closed its streams).
        """
        try:
            limit = self._owner._settle_s + 5  # the stream bounds itself; the margin is the hop's
            self._owner._call(self._stream.close(), timeout=limit)
        except StoreClosedError:
            return
        except TimeoutError:
            log.warning(
                "a layer stream did not close within %.1fs (a stalled read?); its buffers may still be written", limit
            )

    def __enter__(self) -> SyncLayerStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

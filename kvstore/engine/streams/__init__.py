"""Layer streams: a prefix's KV arrives layer by layer, in the order the engine consumes it (``store.prefetch``).

A cache hit should shorten time-to-first-token, so the engine must not wait for the whole prefix:
``store.prefetch(keys)`` starts fetching layer 0 of every chunk, then layer 1, ..., running at most
``depth`` layers ahead of the consumer. Each chunk comes from the fastest place that has it: a DRAM slot
(a copy), or a secondary tier opened once and read one segment per layer (a positioned file read, or one
byte-range request). Every segment is verified before it is used. If a layer cannot be loaded (a chunk
vanished, a segment is corrupt, a tier timed out) the stream raises :class:`~kvstore.errors.PrefetchError`
for that layer and every later one: the engine keeps the layers it already has or, simpler, recomputes
the prefix. Nothing unverified reaches it.

A chunk read from a tier is promoted: its layers are read into a DRAM slot reserved for it when the
stream opens (the contiguous staging every read needs anyway, since a chunk's share of a layer is a
strided slice of the engine's tensor), and once every layer of it has arrived verified the store
publishes the slot and queues it for the faster tiers it skipped. A chunk read from a local tier
straight into contiguous CPU outputs is admitted to DRAM after the stream instead. Into device outputs,
each run of layers is assembled in host memory and crosses the bus as queued copies while the reads of
the next go on; a layer has *arrived* when its copies are queued, and its
:class:`~kvstore.engine.transfer.Completion` is what the consumer's compute stream waits on. Closing a
stream is bounded (``timeouts.close``), and once it returns nothing of the stream writes into the
caller's outputs again. A cancellation is never lost: every wait on a tier is under ``asyncio.timeout``
(``asyncio.wait_for`` can swallow a cancel on 3.11, which left a producer waiting forever for a consumer
that was gone).

The modules, read in this order:

- :mod:`~kvstore.engine.streams.stream`: :class:`LayerStream`, the consumer's side, the producer (which
  runs of layers are fetched, how many at once), and ``close``.
- :mod:`~kvstore.engine.streams.outputs`: where layers land; the outputs' kind (device, contiguous host,
  strided host), decided once; the write fence over them; the copies to a device.
- :mod:`~kvstore.engine.streams.sources`: where each chunk comes from, one class per kind of source (DRAM,
  a file read in place or through staging, a range-readable remote tier); staging, promotion, release.
- :mod:`~kvstore.engine.streams.reads`: one run's reads, run at once (I/O threads and the loop), and the
  blocking file reads.
- :mod:`~kvstore.engine.streams.pace`: how far the producer may run (the consumer's requests, a ring's
  releases).
- :mod:`~kvstore.engine.streams.resources`: what a stream draws on from the store, and
  :class:`StreamHooks`, what it tells the store.
"""

from kvstore.engine.streams.resources import StreamHooks, StreamResources
from kvstore.engine.streams.stream import LayerStream

__all__ = ["LayerStream", "StreamHooks", "StreamResources"]

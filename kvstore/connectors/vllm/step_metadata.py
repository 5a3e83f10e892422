"""What the connector's scheduler side sends its workers with each step: the loads and saves to do.

vLLM pickles this metadata from the scheduler to every worker; with tensor parallelism every
rank gets the same, which is what lets the ranks run their collectives in one order. It also
carries the scheduler's counters, so that a worker's ``stats()`` tells the whole story even
when the scheduler runs in another process (vLLM's default), and the scheduler's identity
(namespace and layout), which each worker checks against its own at the first step, before it
loads or saves anything: a worker that would file chunks where the scheduler never looks stops
the engine, naming both. (Not vLLM's connector handshake: under its MultiConnector that carries
one connector's metadata only, e.g. NIXL's, and kvstore's would displace it.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.events import ChunkIdentity
from kvstore.keys import ChunkKey


@dataclass
class BlockRun:
    """One KV cache group's part of a load or save: tokens from ``first_row`` on, in ``block_ids`` (in order).

    ``first_row`` counts from the start of the first chunk of the load (of the chunk, for a save).
    """

    first_row: int
    block_ids: list[int]


@dataclass
class LoadSpec:
    """Load chunks ``keys``; each KV cache group's ``runs`` entry says which of their rows go into which blocks.

    With one group, ``runs[0].first_row`` is the tokens of the first chunk vLLM already has (its
    own prefix cache) and the blocks follow on from there.
    """

    req_id: str
    keys: list[ChunkKey]
    runs: list[BlockRun]
    tokens: int  # tokens the request gets from the load
    background: bool = False  # loaded whole, outside the forward pass (whole_loads.py); else layer by layer


@dataclass
class SaveSpec:
    """Gather each group's ``runs`` (its rows of one chunk, from ``first_row``) and put them as chunk ``key``."""

    req_id: str
    key: ChunkKey
    runs: list[BlockRun]
    parent: ChunkKey | None = None  # the key of the chunk before it in the request's prompt (None: the first)


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    scheduler_counters: dict[str, int] = field(default_factory=dict)  # the scheduler's, as of this step
    identity: str = ""  # the scheduler's namespace and layout: a worker that keys chunks otherwise stops
    # with KV events on: the engine's name for each chunk this step loads or saves (kvstore.events)
    chunk_identities: dict[ChunkKey, ChunkIdentity] = field(default_factory=dict)

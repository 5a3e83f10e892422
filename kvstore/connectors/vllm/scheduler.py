"""The connector's scheduler side: what each request can load, and which chunks its workers save.

:class:`ConnectorScheduler` keeps one :class:`RequestState` per request vLLM is scheduling and
answers vLLM's scheduler-side connector calls (the connector forwards them):

- ``get_num_new_matched_tokens``: a new request's prompt is cut into chunks, their keys looked
  up in the store without blocking the scheduler (it answers "ask again", ``None``, until the
  lookup is back), and the store's load planner (:mod:`kvstore.engine.planner`) says how many of
  the tokens beyond vLLM's own prefix cache are worth loading rather than recomputing;
- ``update_state_after_alloc``: which blocks of each KV cache group the load fills
  (:func:`~kvstore.connectors.attention_groups.loaded_blocks`);
- ``build_connector_meta``: each step's loads and saves for the workers
  (:class:`~kvstore.connectors.vllm.step_metadata.KVStoreConnectorMetadata`): a prompt chunk is
  saved once all its tokens are computed, never twice (a chunk the store holds, or one this
  scheduler already had saved, is left out), and the scheduler's counters and identity ride along;
- ``update_connector_output``: a failed load's chunks are recomputed by vLLM and saved again.

No I/O on the scheduler's thread: lookups are futures on kvstore's loop
(:class:`~kvstore.engine.sync.SyncKVStore`), read once done. The workers' side (the loads and
saves themselves) is :mod:`~kvstore.connectors.vllm.layer_loads`,
:mod:`~kvstore.connectors.vllm.whole_loads` and :mod:`~kvstore.connectors.vllm.saves`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.connectors.attention_groups import AttentionGroup, loaded_blocks, saved_blocks
from kvstore.connectors.load_log import LoadLog
from kvstore.connectors.vllm.chunk_identity import chunk_identity
from kvstore.connectors.vllm.engine_config import request_extra
from kvstore.connectors.vllm.step_metadata import BlockRun, KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.engine.planner import DRAM, LoadPlan, PrefillClock
from kvstore.engine.sync import SyncKVStore
from kvstore.events import ChunkIdentity
from kvstore.keys import ChunkKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connectors.vllm")


@dataclass
class RequestState:
    """Scheduler-side state of one request."""

    keys: list[ChunkKey]  # one per full chunk of the prompt
    prompt_tokens: int
    request: Request | None = None  # vLLM's, for the engine's block hashes (KV events)
    lookup: concurrent.futures.Future[LoadPlan] | None = None
    plan: LoadPlan | None = None  # where the store holds the leading chunks, once the lookup is back
    decided: bool = False  # its chunks left to recompute are counted (once)
    local_tokens: int = 0  # what vLLM's own prefix cache had, as last told
    next_save: int = 0  # chunks before this one are in the store or queued for it
    block_ids: list[list[int]] = field(default_factory=list)  # the block table of each vLLM KV cache group
    load: LoadSpec | None = None  # to send to the worker with the next step
    loading: tuple[int, LoadSpec] | None = None  # (first chunk, spec) of the load planned
    load_failed: bool = False  # a whole-prefix load failed: the request is recomputed, not loaded again
    background: bool = False  # its load runs outside the forward pass (load_async): whole, reported per request


class ConnectorScheduler:
    """The requests vLLM's scheduler runs, their lookups, and the loads and saves each step sends the workers.

    Called on vLLM's scheduler thread only (no lock). ``held_store`` gives the store (raising
    KVStoreError when the connector holds none); ``counters`` is the connector's dict, updated in
    place (``lookups``, ``lookup_errors``, ``hit_tokens``, ``unsaveable_chunks``, ``recomputed_chunks``).
    """

    def __init__(
        self,
        *,
        held_store: Callable[[], SyncKVStore],
        groups: Sequence[AttentionGroup],
        chunk_tokens: int,
        hybrid: bool,
        saved_limit: int,
        prefill_clock: PrefillClock,
        identity: str,
        counters: dict[str, int],
        max_stall_s: float | None = 0.05,
        max_background_bytes: int = 1 << 30,
        hash_block_size: int | None = None,
    ) -> None:
        """``hybrid``: every load is whole-prefix and asynchronous (several groups, or a sliding window); else a
        load runs in the background when it would hold the batch past ``max_stall_s`` (see :meth:`_in_background`).
        Background loads stage at most ``max_background_bytes`` at once (one larger load alone, when none is).

        ``saved_limit``: how many keys of chunks sent for saving are remembered (about what the
        worker's DRAM tier holds). ``identity``: the namespace and layout sent to the workers.
        ``hash_block_size``: vLLM's, when KV events are on: each chunk loaded or saved is sent with
        the engine's name for it (:mod:`~kvstore.connectors.vllm.chunk_identity`).
        """
        self._held_store = held_store
        self.groups = list(groups)
        self.chunk_tokens = chunk_tokens
        self.block_size = self.groups[0].block_size  # the one group's, for one-group (block-level) failures
        self.hybrid = hybrid
        self.identity = identity
        self.counters = counters
        self._requests: dict[str, RequestState] = {}
        self._unsent_loads: list[LoadSpec] = []  # whole-prefix loads for the next step's metadata
        self._unsent_names: dict[ChunkKey, ChunkIdentity] = {}  # their chunks' names (KV events)
        self.max_stall_s, self.max_background_bytes = max_stall_s, max_background_bytes
        self._background: dict[str, int] = {}  # requests whose background load is in flight: its bytes staged
        # Chunks this scheduler had the worker put into its DRAM tier, newest last: the worker may
        # be another process, whose DRAM the scheduler's lookups cannot see.
        self._saved: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._saved_limit = saved_limit
        self._prefill_clock = prefill_clock
        self._hash_block_size = hash_block_size
        self._load_log = LoadLog(log)  # one INFO line per load, at most one every 10 s (the rest summed)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            tokens = list(request.prompt_token_ids or [])  # none for prompt embeddings: nothing to key
            keys = self._held_store().chunk_keys(tokens, request_extra(request))
            state = RequestState(keys=keys, prompt_tokens=len(tokens), request=request)
            self._requests[request.request_id] = state
        state.local_tokens = num_computed_tokens
        if state.load_failed:
            return 0, False  # its load failed: vLLM computes the prompt (and it is saved again)
        if state.lookup is None and state.keys:
            # Every full chunk, even one vLLM has itself: the answer also tells what not to save again.
            self.counters["lookups"] += 1
            state.lookup = self._lookup(state.keys)
        # At least one prompt token must be computed: it yields the first output token.
        usable = min(len(state.keys), (state.prompt_tokens - 1) // self.chunk_tokens)
        if usable * self.chunk_tokens <= num_computed_tokens:
            return 0, False  # nothing to load beyond vLLM's own cache (the lookup goes on, for saves)
        plan = self._found(state)
        if plan is None:
            return None, False  # vLLM asks again next step; the scheduler never waits on I/O
        # Only what vLLM lacks is loaded: the plan weighs the held chunks from its first missing one.
        start, held = num_computed_tokens // self.chunk_tokens, min(plan.held, usable)
        load = start + self._held_store().plan_tiers(plan.tiers[start:held]).load if held > start else 0
        if not state.decided:
            state.decided = True
            self.counters["recomputed_chunks"] += max(0, held - max(load, start))
        state.next_save = min(state.next_save, max(load, start))  # what it recomputes is saved again
        matched = load * self.chunk_tokens
        if matched <= num_computed_tokens:
            return 0, False
        # In the background, vLLM schedules the others meanwhile and takes a failure per request.
        state.background = self.hybrid or self._in_background(plan.tiers[start:load])
        staged = sum(self._background.values()) + (load - start) * self._held_store().layout.chunk_nbytes
        if state.background and self._background and staged > self.max_background_bytes:
            return None, False  # asked again next step: what background loads stage is bounded
        return matched - num_computed_tokens, state.background

    def _in_background(self, tiers: Sequence[str]) -> bool:
        """Whether a load of chunks held where ``tiers`` says would hold the batch too long inside the forward pass.

        It would if it needs a tier off this machine (Redis, S3, a remote plugin: their latency has no
        bound but their timeout), or if its expected time from DRAM and local disks (a disk never read
        yet at its seed speed) exceeds ``max_stall_s``. With no budget (None), every load runs inside.
        """
        if self.max_stall_s is None:
            return False
        store = self._held_store()
        if any(tier not in store.local_tiers for tier in tiers):
            return True
        return store.expected_load_seconds(tiers) > self.max_stall_s

    def _lookup(self, keys: list[ChunkKey]) -> concurrent.futures.Future[LoadPlan]:
        """The plan for ``keys``: those just saved to the worker's DRAM, then where the store holds the rest.

        The store's load planner (:mod:`kvstore.engine.planner`) says how many leading chunks are
        worth loading rather than recomputing, with the prefill rate this scheduler measures.
        """
        recent = 0
        while recent < len(keys) and keys[recent] in self._saved:
            recent += 1
        store = self._held_store()
        total: concurrent.futures.Future[LoadPlan] = concurrent.futures.Future()
        if recent == len(keys):
            total.set_result(store.plan_tiers([DRAM] * recent))
            return total

        def add_recent(rest: concurrent.futures.Future[LoadPlan]) -> None:
            if rest.exception() is not None:
                total.set_exception(rest.exception())  # type: ignore[arg-type]
            else:  # the tiers matter (get_num_new_matched_tokens plans what vLLM lacks), not this load
                total.set_result(store.plan_tiers([DRAM] * recent + list(rest.result().tiers)))

        store.plan_future(keys[recent:]).add_done_callback(add_recent)
        return total

    def _found(self, state: RequestState) -> LoadPlan | None:
        """The lookup's plan (None while it is out); a failed lookup is a miss."""
        if state.plan is None and state.lookup is not None and state.lookup.done():
            try:
                state.plan = state.lookup.result()
            except Exception as exc:
                self.counters["lookup_errors"] += 1
                log.warning("kvstore lookup failed (the prompt is computed instead): %r", exc)
                state.plan = LoadPlan((), 0, 0.0, 0.0)
            state.next_save = max(state.next_save, state.plan.held)  # held chunks are not saved again
        return state.plan

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        start, end = state.local_tokens, state.local_tokens + num_external_tokens
        first_chunk = start // self.chunk_tokens
        tables = blocks.get_block_ids()
        runs: list[BlockRun] = []
        for group in self.groups:
            try:  # which of the group's blocks the load fills: all from ``start``, or those in the window
                first, block_ids = loaded_blocks(group, list(tables[group.index]), start, end)
            except ValueError as exc:  # vLLM allocated what kvstore cannot account for: fail, never guess
                log.warning("kvstore: request %s's load is failed: %s", request.request_id, exc)
                held = tables[group.index][start // group.block_size : end // group.block_size]
                first, block_ids = start, [block for block in held if block]
                state.load_failed = True  # the worker fails the load (no keys), reporting these blocks
            runs.append(BlockRun(first - first_chunk * self.chunk_tokens, block_ids))
        state.load = LoadSpec(
            req_id=request.request_id,
            keys=[] if state.load_failed else state.keys[first_chunk : end // self.chunk_tokens],
            runs=runs,
            tokens=num_external_tokens,
            background=state.background,
        )
        state.loading = (first_chunk, state.load)
        if state.load.keys and state.plan is not None:
            tiers = state.plan.tiers[first_chunk : first_chunk + len(state.load.keys)]
            where = "in the background" if state.background else "in the forward pass"
            self._load_log.load(request.request_id, num_external_tokens, tiers, where)
        if state.background:  # asynchronous: sent with the next step, which does not schedule the request
            self._background[request.request_id] = len(state.load.keys) * self._held_store().layout.chunk_nbytes
            self.counters["background_loads"] += 1
            self._unsent_loads.append(state.load)
            self._name_chunks(self._unsent_names, state, range(first_chunk, first_chunk + len(state.load.keys)))
            state.load = None
        self.counters["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        self._prefill_clock.step(scheduler_output.total_num_scheduled_tokens)
        self._load_log.tick()
        meta = KVStoreConnectorMetadata(loads=self._unsent_loads, chunk_identities=self._unsent_names)
        self._unsent_loads, self._unsent_names = [], {}
        progress: list[tuple[str, int, int]] = []  # (request, tokens computed before this step, and after it)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(table) for table in new.block_ids]
            if state.load is not None:
                meta.loads.append(state.load)
                if state.loading is not None:
                    first = state.loading[0]
                    self._name_chunks(meta.chunk_identities, state, range(first, first + len(state.load.keys)))
                state.load = None
            scheduled = scheduler_output.num_scheduled_tokens[new.req_id]
            progress.append((new.req_id, new.num_computed_tokens, new.num_computed_tokens + scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(table) for table in new_blocks] if new_blocks is not None else []
            elif new_blocks is not None:
                if len(state.block_ids) != len(new_blocks):  # resumed without blocks before: tables start empty
                    state.block_ids = [[] for _ in new_blocks]
                for table, added in zip(state.block_ids, new_blocks, strict=True):
                    table.extend(added)
            computed = cached.num_computed_tokens[i]
            progress.append((req_id, computed, computed + scheduler_output.num_scheduled_tokens[req_id]))
        # A chunk already sent for saving (by this step's or an earlier step's request with the same
        # prefix, e.g. n > 1 sampling, or a twin request whose lookup answered a step later) is not
        # saved again: ``_saved`` holds every key emitted until a failed load takes it out.
        for req_id, before, after in progress:
            state = self._requests[req_id]
            self._found(state)  # chunks the store already holds are not saved again
            done = min(after, state.prompt_tokens) // self.chunk_tokens
            for chunk in range(state.next_save, done):
                if state.keys[chunk] in self._saved:
                    continue
                runs = self._saved_runs(state, chunk, before)
                if runs is None:
                    self.counters["unsaveable_chunks"] += 1
                    continue
                meta.saves.append(SaveSpec(req_id, state.keys[chunk], runs, state.keys[chunk - 1] if chunk else None))
                self._name_chunks(meta.chunk_identities, state, range(chunk, chunk + 1))
                self._saved[state.keys[chunk]] = None
                self._saved.move_to_end(state.keys[chunk])
                if len(self._saved) > self._saved_limit:
                    self._saved.popitem(last=False)
            state.next_save = max(state.next_save, done)
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            self._background.pop(req_id, None)
        meta.scheduler_counters = dict(self.counters)
        meta.identity = self.identity
        return meta

    def _name_chunks(self, names: dict[ChunkKey, ChunkIdentity], state: RequestState, chunks: range) -> None:
        """With KV events on, add the engine's name for each of ``state``'s ``chunks`` to ``names``."""
        if self._hash_block_size is None or state.request is None:
            return
        for chunk in chunks:
            identity = chunk_identity(state.request, chunk, self.chunk_tokens, self._hash_block_size)
            if identity is not None:
                names[state.keys[chunk]] = identity

    def _saved_runs(self, state: RequestState, chunk: int, computed_tokens: int) -> list[BlockRun] | None:
        """Each group's blocks of ``chunk`` (see :func:`saved_blocks`), or None if a group no longer has them all."""
        runs: list[BlockRun] = []
        for group in self.groups:
            if group.index >= len(state.block_ids):
                return None
            held = saved_blocks(group, state.block_ids[group.index], chunk, self.chunk_tokens, computed_tokens)
            if held is None:
                return None
            runs.append(BlockRun(*held))
        return runs

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A load that failed is recomputed by vLLM: its chunks are saved again once they are."""
        failed_requests = getattr(connector_output, "failed_recving", None) or set()
        for req_id in (getattr(connector_output, "finished_recving", None) or set()) | failed_requests:
            self._background.pop(req_id, None)
        for req_id in failed_requests:  # a whole-prefix (background) load: the request is recomputed whole
            state = self._requests.get(req_id)
            if state is not None and state.loading is not None:
                self._recompute_from(state, state.loading[0])
                state.load_failed = True
        failed = connector_output.invalid_block_ids
        if not failed:
            return
        for state in self._requests.values():
            if state.loading is None:
                continue
            first_chunk, spec = state.loading
            run = spec.runs[0]  # block-level failures come from one-group models only
            bad = [i for i, block in enumerate(run.block_ids) if block in failed]
            if bad:  # from the first failed block's chunk on: recomputed, to be saved again
                first_bad_row = run.first_row + bad[0] * self.block_size
                self._recompute_from(state, first_chunk + first_bad_row // self.chunk_tokens)

    def _recompute_from(self, state: RequestState, chunk: int) -> None:
        """vLLM recomputes ``state``'s chunks from ``chunk`` on: save them again once it has."""
        state.next_save = min(state.next_save, chunk)
        for key in state.keys[chunk:]:
            self._saved.pop(key, None)  # gone from the worker's DRAM, or bad: ask the store next time
        state.loading = None

    def request_finished(self, req_id: str) -> None:
        """vLLM is done with the request: its state goes (saves were copied within their steps)."""
        self._requests.pop(req_id, None)
        self._background.pop(req_id, None)

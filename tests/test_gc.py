"""kvstore gc / ls / stats on real tiers: a disk directory, redis-server and S3 (moto server), 10,000 chunks each.

Retention must be honoured exactly (the expected survivors are computed here from the ages the
test gave the objects, not from what gc lists), a dry run deletes nothing, and a chunk written
or read after gc listed it is never deleted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from support import TEST_BUCKET, raw_s3_client
from typer.testing import CliRunner

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.backends import RemoveReport, make_backend
from kvstore.backends.disk import DiskBackend, temporary_name
from kvstore.cli import app
from kvstore.cli.admin import EXIT_DAMAGED, EXIT_DECLINED, EXIT_OK, EXIT_USAGE
from kvstore.cli.inventory import namespace_filter, tool_backends
from kvstore.cli.retention import Retention, plan_gc, run_gc
from kvstore.codecs import make_codec
from kvstore.config import TimeoutConfig
from kvstore.keys import chain_parents, namespace_dir
from kvstore.storage.tier import ChunkTier

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=16)  # ~5 KB objects (a 4 KiB header)
MANY = 10_000
DAY = 86400.0
runner = CliRunner()


@dataclass
class Setup:
    """A kvstore TOML naming the three tiers (fresh prefixes on the shared servers) and how to reach under them."""

    config_file: Path
    config: StoreConfig
    disk_root: Path
    redis_url: str
    s3_prefix: str
    redis_prefix: str

    def invoke(self, *args: str) -> tuple[int, str]:
        """Exit code and output: stdout alone for --json (what was read is said on stderr), else both."""
        result = runner.invoke(app, [*args, "--config", str(self.config_file)], catch_exceptions=False)
        return result.exit_code, result.stdout if "--json" in args else result.output


@pytest.fixture
def setup(tmp_path: Path, redis_server, moto_server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    for name, value in moto_server.credentials_env().items():
        monkeypatch.setenv(name, value)
    unique = uuid.uuid4().hex[:10]
    config_file = tmp_path / "kvstore.toml"
    config_file.write_text(
        f"""
[disk]
path = "{tmp_path / "disk"}"
[redis]
enabled = true
url = "{redis_server.url}"
prefix = "gc-{unique}"
codec = "identity"
[s3]
enabled = true
bucket = "{TEST_BUCKET}"
prefix = "gc-{unique}"
codec = "identity"
"""
    )
    config = StoreConfig.load(config_file)
    yield Setup(config_file, config, tmp_path / "disk", redis_server.url, f"gc-{unique}", f"gc-{unique}")


def backend_for(setup: Setup, tier: str, namespace: str):
    directory = namespace_dir(namespace)
    if tier == "disk":
        return DiskBackend(setup.disk_root, 1 << 40, namespace=directory)
    return make_backend(getattr(setup.config, tier), TimeoutConfig(), directory)


def write_chunks(setup: Setup, tier: str, namespace: str, keys: list[str], codec: str = "identity") -> None:
    """Real chunk containers through the tier's own write path, 500 at a time; existing ones are rewritten.

    (The disk backend is not opened: its index would make the tier skip chunks already on disk.)
    """

    async def write() -> None:
        backend = backend_for(setup, tier, namespace)
        chunk_tier = ChunkTier(backend, make_codec(codec), LAYOUT, None)
        if tier != "disk":
            await chunk_tier.open()
        try:
            chunk = torch.arange(LAYOUT.chunk_nbytes // LAYOUT.dtype.itemsize).reshape(LAYOUT.chunk_shape)
            view = memoryview(chunk.to(LAYOUT.dtype).view(torch.uint8).numpy()).cast("B")
            for start in range(0, len(keys), 500):
                outcomes = await chunk_tier.write_many([(key, view) for key in keys[start : start + 500]])
                assert outcomes == [None] * len(outcomes), outcomes
        finally:
            await chunk_tier.close()

    asyncio.run(write())


def random_keys(count: int) -> list[str]:
    return [os.urandom(32).hex() for _ in range(count)]


def stored_keys(setup: Setup, tier: str, namespace: str | None = None) -> set[tuple[str, str]]:
    """(namespace directory, key) of every object the tier holds, found by the tools' own listing."""

    async def scan() -> set[tuple[str, str]]:
        async with tool_backends(setup.config, [tier]) as backends:
            accept = namespace_filter([namespace] if namespace else [])
            return {(item.namespace, item.key) async for page in backends[tier].scan(accept) for item in page}

    return asyncio.run(scan())


def disk_files(setup: Setup) -> set[tuple[str, str]]:
    """What is on disk, found with os.walk rather than the tools (a check independent of them)."""
    found = set()
    for directory, _, names in os.walk(setup.disk_root):
        for name in names:
            assert name.endswith(".kvc"), f"stray file {name} (a gc temporary left behind?)"
            found.add((Path(directory).relative_to(setup.disk_root).parts[0], name.removesuffix(".kvc")))
    return found


def age_disk_file(setup: Setup, namespace: str, key: str, age: float, now: float) -> None:
    path = DiskBackend(setup.disk_root, 1, namespace=namespace_dir(namespace)).path_for(key)
    os.utime(path, (now - age, now - age))


# == disk ======================================================================================


def test_gc_on_10000_disk_chunks_honours_age_and_budget_exactly(setup: Setup) -> None:
    keys = {"model-a": random_keys(MANY // 2), "vllm:/models/b": random_keys(MANY // 2)}
    now = time.time()
    ages: dict[tuple[str, str], float] = {}
    for namespace, names in keys.items():
        write_chunks(setup, "disk", namespace, names)
        for i, key in enumerate(names):
            age = 150 + i * 300.0  # every 5 minutes over ~17 days: distinct, known, 150 s from any whole day
            age_disk_file(setup, namespace, key, age, now)
            ages[(namespace_dir(namespace), key)] = age
    assert disk_files(setup) == set(ages)

    # A dry run reports what would go and deletes nothing.
    code, out = setup.invoke("gc", "--tier", "disk", "--max-age", "7d", "--dry-run")
    older = {name for name, age in ages.items() if age > 7 * DAY}
    assert code == EXIT_OK, out
    assert f"{len(older):,} chunks" in out and "would be deleted" in out, out
    assert disk_files(setup) == set(ages)

    # --max-age within one namespace, given as engines name it.
    code, out = setup.invoke("gc", "--tier", "disk", "--max-age", "7d", "--namespace", "vllm:/models/b", "--yes")
    assert code == EXIT_OK, out
    b = namespace_dir("vllm:/models/b")
    expected = {name for name, age in ages.items() if not (name[0] == b and age > 7 * DAY)}
    assert disk_files(setup) == expected
    assert len(expected) < MANY

    # --max-bytes over every namespace: the oldest go first until the rest fits.
    sizes = {
        name: DiskBackend(setup.disk_root, 1, namespace=name[0]).path_for(name[1]).stat().st_size for name in expected
    }
    budget = sum(sizes.values()) // 3
    survivors, total = set(), 0
    for name in sorted(expected, key=lambda n: ages[n]):  # youngest first: they are the ones kept
        if total + sizes[name] > budget:
            break
        survivors.add(name)
        total += sizes[name]
    code, out = setup.invoke("gc", "--tier", "disk", "--max-bytes", str(budget), "--yes")
    assert code == EXIT_OK, out
    assert disk_files(setup) == survivors

    # Idempotent: the same rules again delete nothing.
    code, out = setup.invoke("gc", "--tier", "disk", "--max-bytes", str(budget), "--max-age", "7d", "--yes")
    assert code == EXIT_OK and "nothing to delete" in out, out
    assert disk_files(setup) == survivors


def test_ls_and_stats_count_per_namespace(setup: Setup) -> None:
    write_chunks(setup, "disk", "alpha", random_keys(30))
    write_chunks(setup, "disk", "beta", random_keys(12))
    code, out = setup.invoke("ls", "--tier", "disk", "--json")
    assert code == EXIT_OK, out
    rows = {row["namespace"]: row for row in json.loads(out)}
    assert {name: row["chunks"] for name, row in rows.items()} == {"alpha": 30, "beta": 12}
    on_disk = sum(p.stat().st_size for p in (setup.disk_root / "alpha").rglob("*.kvc"))
    assert rows["alpha"]["bytes"] == on_disk
    code, out = setup.invoke("stats", "--tier", "disk", "--json", "--namespace", "b*")
    assert code == EXIT_OK, out
    (row,) = json.loads(out)
    assert row["namespace"] == "beta" and row["chunks"] == 12 and row["ages"]["< 1h"] == 12
    code, out = setup.invoke("ls", "--tier", "disk", "--chunks", "--limit", "5")
    assert code == EXIT_OK and out.count(" alpha ") + out.count(" beta ") == 5, out
    code, out = setup.invoke("stats", "--tier", "disk")
    assert code == EXIT_OK and "alpha" in out and "beta" in out, out


def test_ls_shows_the_codecs_each_namespace_is_stored_with(setup: Setup) -> None:
    for tier in ("disk", "redis", "s3"):
        write_chunks(setup, tier, "lossy", random_keys(3), codec="int4+zstd")
        write_chunks(setup, tier, "lossy", random_keys(2), codec="bytesplit")
        write_chunks(setup, tier, "plain", random_keys(4))
    code, out = setup.invoke("ls", "--json")
    assert code == EXIT_OK, out
    rows = {(row["tier"], row["namespace"]): row for row in json.loads(out)}
    for tier in ("disk", "s3"):  # read from each chunk's header
        assert rows[(tier, "lossy")]["codecs"] == {"int4+zstd": 3, "bytesplit": 2}
        assert rows[(tier, "plain")]["codecs"] == {"identity": 4}
    assert rows[("redis", "lossy")]["codecs"] is None, "by default a read would restart Redis idle times"
    code, out = setup.invoke("ls", "--tier", "redis", "--codecs", "--json")
    assert code == EXIT_OK, out
    assert {row["namespace"]: row["codecs"] for row in json.loads(out)} == {
        "lossy": {"int4+zstd": 3, "bytesplit": 2},
        "plain": {"identity": 4},
    }
    code, out = setup.invoke("ls", "--tier", "s3", "--chunks", "--json")
    assert code == EXIT_OK, out
    assert sorted(row["codec"] for row in json.loads(out)) == ["bytesplit"] * 2 + ["identity"] * 4 + ["int4+zstd"] * 3
    code, out = setup.invoke("ls", "--tier", "disk", "--no-codecs", "--json")
    assert code == EXIT_OK and all(row["codecs"] is None for row in json.loads(out)), out
    code, out = setup.invoke("ls")
    assert code == EXIT_OK and "int4+zstd" in out and "(not read" in out, out


# == Redis =====================================================================================


def test_gc_on_10000_redis_chunks_by_idle_time_and_budget(setup: Setup) -> None:
    keys = random_keys(MANY)
    write_chunks(setup, "redis", "model", keys)
    old = set(keys[: MANY // 2])
    idle = {key: (3 * DAY + i if key in old else 0) for i, key in enumerate(keys)}
    with redis.Redis.from_url(setup.redis_url) as raw:  # back-date idle times: RESTORE ... IDLETIME
        names = [f"{setup.redis_prefix}:model:{key}" for key in old]
        pipe = raw.pipeline(transaction=False)
        for name in names:
            pipe.dump(name)
        dumps = pipe.execute()
        pipe = raw.pipeline(transaction=False)
        for name, dump in zip(names, dumps, strict=True):
            pipe.restore(name, 0, dump, replace=True, idletime=int(idle[name.rpartition(":")[2]]))
        pipe.execute()

    code, out = setup.invoke("gc", "--tier", "redis", "--max-age", "2d", "--dry-run")
    assert code == EXIT_OK and f"{len(old):,} chunks" in out, out
    assert stored_keys(setup, "redis") == {("model", key) for key in keys}  # the listing left ages alone, too
    code, out = setup.invoke("gc", "--tier", "redis", "--max-age", "2d", "--yes")
    assert code == EXIT_OK, out
    young = [key for key in keys if key not in old]
    assert stored_keys(setup, "redis") == {("model", key) for key in young}

    # Budget: the idle ones go first. Make a quarter of the young ones idle for an hour.
    with redis.Redis.from_url(setup.redis_url) as raw:
        stale = young[: len(young) // 4]
        for key in stale:
            name = f"{setup.redis_prefix}:model:{key}"
            raw.restore(name, 0, raw.dump(name), replace=True, idletime=3600)
        sizes = {key: raw.memory_usage(f"{setup.redis_prefix}:model:{key}", samples=0) for key in young}
    budget = sum(sizes[key] for key in young if key not in stale)
    code, out = setup.invoke("gc", "--tier", "redis", "--max-bytes", str(budget), "--yes")
    assert code == EXIT_OK, out
    assert stored_keys(setup, "redis") == {("model", key) for key in young if key not in stale}


# == S3 ========================================================================================


def test_gc_on_10000_s3_chunks_by_last_write(setup: Setup) -> None:
    old, young = random_keys(MANY // 2), random_keys(MANY // 2)
    write_chunks(setup, "s3", "model", old)
    boundary = time.time() + 1.0  # S3 keeps whole seconds: the young batch starts 2 s later
    time.sleep(2.1)
    write_chunks(setup, "s3", "model", young)

    async def collect(dry: bool) -> tuple[int, int, int]:
        async with tool_backends(setup.config, ["s3"]) as backends:
            now = time.time()  # given to the plan: the listing of 10,000 objects takes seconds
            plans = await plan_gc(backends, None, Retention(max_age=now - boundary), now=now)
            assert {item.key for item in plans[0].victims} == set(old)
            removed = 0 if dry else (await run_gc(backends, plans))["s3"].removed
            return len(plans[0].listed), len(plans[0].victims), removed

    assert asyncio.run(collect(dry=True)) == (MANY, len(old), 0)
    assert asyncio.run(collect(dry=False)) == (MANY, len(old), len(old))  # the dry run deleted nothing
    assert stored_keys(setup, "s3") == {("model", key) for key in young}


def test_install_lifecycle_adds_one_rule_and_keeps_the_others(setup: Setup, moto_server) -> None:
    write_chunks(setup, "s3", "model", random_keys(3))
    client = raw_s3_client(moto_server)
    other = {"ID": "someone-else", "Filter": {"Prefix": "logs/"}, "Status": "Enabled", "Expiration": {"Days": 30}}
    client.put_bucket_lifecycle_configuration(Bucket=TEST_BUCKET, LifecycleConfiguration={"Rules": [other]})
    ours_id = f"kvstore-expire:{setup.s3_prefix}/"
    for days in (3, 5):
        code, out = setup.invoke("gc", "--tier", "s3", "--max-age", f"{days}d", "--install-lifecycle", "--yes")
        assert code == EXIT_OK and f"expire {days} days after" in out, out
        rules = {rule["ID"]: rule for rule in client.get_bucket_lifecycle_configuration(Bucket=TEST_BUCKET)["Rules"]}
        assert set(rules) == {"someone-else", ours_id}  # replaced on the second run, not added
        assert rules[ours_id]["Expiration"]["Days"] == days
        assert rules[ours_id]["Filter"]["Prefix"] == f"{setup.s3_prefix}/"
    code, out = setup.invoke(
        "gc", "--tier", "s3", "--max-age", "7d", "--namespace", "model", "--install-lifecycle", "--yes"
    )
    assert code == EXIT_OK, out
    rules = {rule["ID"]: rule for rule in client.get_bucket_lifecycle_configuration(Bucket=TEST_BUCKET)["Rules"]}
    assert rules[f"kvstore-expire:{setup.s3_prefix}/model/"]["Filter"]["Prefix"] == f"{setup.s3_prefix}/model/"
    assert len(stored_keys(setup, "s3")) == 3  # younger than every max age given
    client.delete_bucket_lifecycle(Bucket=TEST_BUCKET)


# == beside live engines =======================================================================


@pytest.mark.parametrize("tier", ["disk", "redis", "s3"])
def test_chunks_written_or_read_after_the_listing_are_kept(setup: Setup, tier: str) -> None:
    keys = random_keys(300)
    write_chunks(setup, tier, "live", keys)
    if tier == "disk":
        now = time.time()
        for key in keys:
            age_disk_file(setup, "live", key, 3 * DAY, now)
    elif tier == "redis":
        with redis.Redis.from_url(setup.redis_url) as raw:
            for key in keys:
                name = f"{setup.redis_prefix}:live:{key}"
                raw.restore(name, 0, raw.dump(name), replace=True, idletime=int(3 * DAY))
    else:
        time.sleep(2.1)  # S3 ages are whole seconds of last write

    rewritten, read, new = keys[:50], keys[50:80], random_keys(20)

    async def scenario() -> dict[str, int]:
        async with tool_backends(setup.config, [tier]) as backends:
            retention = Retention(max_age=1.5 if tier == "s3" else DAY)
            plans = await plan_gc(backends, None, retention)
            assert len(plans[0].victims) == len(keys)
            if tier == "s3":
                await asyncio.sleep(1.1)  # so a rewrite's LastModified differs from the listing's
            # An engine writes some victims again, reads others, and writes new chunks, all after the listing.
            await asyncio.to_thread(write_chunks, setup, tier, "live", rewritten + new)
            if tier != "s3":  # S3 records no reads
                backend = backend_for(setup, tier, "live")
                await backend.open()
                for key in read:
                    assert await backend.get(key, (0, 8)) is not None
                await backend.close()
            report = (await run_gc(backends, plans))[tier]
            return {"removed": report.removed, "changed": report.changed, "gone": report.gone}

    counts = asyncio.run(scenario())
    spared = set(rewritten) | (set(read) if tier != "s3" else set())
    assert stored_keys(setup, tier) == {("live", key) for key in spared | set(new)}
    assert counts == {"removed": len(keys) - len(spared), "changed": len(spared), "gone": 0}


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_gc_beside_an_engine_rewriting_its_victims_loses_nothing(setup: Setup, tier: str) -> None:
    """A real KVStore keeps writing while gc runs; everything it wrote after the listing survives."""
    config = setup.config.model_copy(deep=True)
    if tier == "disk":
        config.redis.enabled = False
    else:
        config.disk.enabled = False
    config.s3.enabled = False
    config.queue_depth = 1000  # a round of puts must not overflow the cascade queue (that drops writes)
    config.dram.capacity = 1 << 20  # the default 1 GiB of these tiny chunks is 2 million slots to set up
    tokens = list(range(LAYOUT.chunk_tokens * 400))

    async def engine(stop: threading.Event | None, written: list[str]) -> None:
        async with KVStore(config, LAYOUT, namespace="engine") as store:
            keys = store.chunk_keys(tokens)
            while True:  # put every chunk again (evicted from DRAM first, so it cascades), round after round
                for i, key in enumerate(keys):
                    store.pool.discard(key)
                    assert await store.put(key, torch.full(LAYOUT.chunk_shape, float(i), dtype=LAYOUT.dtype))
                await store.flush()
                written.extend(keys)  # every put of a round reached the tier (or was kept there as used)
                if stop is None or stop.is_set():
                    return

    first: list[str] = []
    asyncio.run(engine(None, first))
    if tier == "disk":
        now = time.time()
        for key in first:
            age_disk_file(setup, "engine", key, 3 * DAY, now)
    else:
        with redis.Redis.from_url(setup.redis_url) as raw:
            for key in first:
                name = f"{setup.redis_prefix}:engine:{key}"
                raw.restore(name, 0, raw.dump(name), replace=True, idletime=int(3 * DAY))

    async def collect_while_writing() -> list[str]:
        async with tool_backends(setup.config, [tier]) as backends:
            plans = await plan_gc(backends, None, Retention(max_age=DAY))
            assert len(plans[0].victims) == len(first)
            stop, rewritten = threading.Event(), []
            writer = threading.Thread(target=lambda: asyncio.run(engine(stop, rewritten)))
            writer.start()
            while len(rewritten) < 10:
                await asyncio.sleep(0.005)
            await run_gc(backends, plans)
            stop.set()
            await asyncio.to_thread(writer.join)
            return rewritten

    rewritten = asyncio.run(collect_while_writing())
    assert rewritten
    survivors = {key for _, key in stored_keys(setup, tier, "engine")}
    assert set(rewritten) <= survivors, "a chunk written after the listing was deleted"


# == prefixes go tail first =====================================================================


def store_prefix(setup: Setup, tier: str, chunks: int) -> list[str]:
    """One prefix of ``chunks`` chunks put through a real KVStore (each with its parent) onto ``tier`` only,
    then aged as an engine would leave it: written head first, so the head is the oldest (disk, Redis)."""
    config = setup.config.model_copy(deep=True)
    for other in {"disk", "redis", "s3"} - {tier}:
        getattr(config, other).enabled = False
    config.dram.capacity = 1 << 20

    async def put() -> list[str]:
        async with KVStore(config, LAYOUT, namespace="prefix") as store:
            keys = store.chunk_keys(list(range(chunks * LAYOUT.chunk_tokens)))
            kvs = [torch.full(LAYOUT.chunk_shape, float(i), dtype=LAYOUT.dtype) for i in range(chunks)]
            assert all(await store.put_many(keys, kvs, parents=chain_parents(keys)))
            await store.flush()
            return keys

    keys = asyncio.run(put())
    now = time.time()
    for i, key in enumerate(keys):
        age = (len(keys) - i) * 3600.0  # chunk 0 idle longest, as after a prompt read or written in order
        if tier == "disk":
            age_disk_file(setup, "prefix", key, age, now)
        elif tier == "redis":
            with redis.Redis.from_url(setup.redis_url) as raw:
                name = f"{setup.redis_prefix}:prefix:{key}"
                raw.restore(name, 0, raw.dump(name), replace=True, idletime=int(age))
    return keys


@pytest.mark.parametrize("tier", ["disk", "redis", "s3"])
def test_a_byte_budget_removes_a_prefix_tail_first(setup: Setup, tier: str) -> None:
    """The head of a prefix is its oldest chunk (written and read first); removing it would leave the rest
    unreachable (lookup counts leading chunks). A budget for about one and a half chunks keeps chunk 0."""
    keys = store_prefix(setup, tier, 3)
    sizes = [item.size for item in listed(setup, tier)]
    assert len(sizes) == 3
    code, out = setup.invoke("gc", "--tier", tier, "--max-age", "7d", "--max-bytes", str(max(sizes) * 3 // 2), "--yes")
    assert code == EXIT_OK, out
    assert stored_keys(setup, tier, "prefix") == {("prefix", keys[0])}, "a chunk kept whose parent gc removed"
    code, out = setup.invoke("gc", "--tier", tier, "--max-bytes", "0", "--yes")  # and then the head alone
    assert code == EXIT_OK and stored_keys(setup, tier, "prefix") == set(), out
    if tier == "redis":  # the links kept beside the chunks went with them
        with redis.Redis.from_url(setup.redis_url) as raw:
            assert list(raw.scan_iter(match=f"{setup.redis_prefix}:prefix:*")) == []


def test_a_victim_used_after_the_listing_keeps_the_chunks_before_it(setup: Setup) -> None:
    """gc planned to remove chunks 2 then 1; chunk 2 is read after the listing (kept, as changed): chunk 1, its
    parent, must stay too, or chunk 2 would be kept where no lookup can reach it."""
    keys = store_prefix(setup, "disk", 3)
    budget = max(item.size for item in listed(setup, "disk")) * 3 // 2

    async def scenario() -> RemoveReport:
        async with tool_backends(setup.config, ["disk"]) as backends:
            plans = await plan_gc(backends, None, Retention(max_bytes=budget))
            assert [item.key for item in plans[0].victims] == [keys[2], keys[1]]
            age_disk_file(setup, "prefix", keys[2], 0.0, time.time())  # an engine read it: its mtime moves on
            return (await run_gc(backends, plans))["disk"]

    report = asyncio.run(scenario())
    assert (report.removed, report.changed) == (0, 2)
    assert stored_keys(setup, "disk", "prefix") == {("prefix", key) for key in keys}


def test_an_old_chunk_with_a_young_descendant_outlives_a_max_age(setup: Setup) -> None:
    """A chunk is as recent as its most recent descendant: the lookup that reached the young one passed it."""
    keys = store_prefix(setup, "disk", 3)
    age_disk_file(setup, "prefix", keys[2], 60.0, time.time())  # the tail was read a minute ago
    code, out = setup.invoke("gc", "--tier", "disk", "--max-age", "2h", "--yes")
    assert code == EXIT_OK, out
    assert stored_keys(setup, "disk", "prefix") == {("prefix", key) for key in keys}


def listed(setup: Setup, tier: str) -> list:
    async def scan() -> list:
        async with tool_backends(setup.config, [tier]) as backends:
            return [item async for page in backends[tier].scan(namespace_filter(["prefix"])) for item in page]

    return asyncio.run(scan())


# == usage =====================================================================================


def test_gc_usage_errors_and_confirmation(setup: Setup) -> None:
    write_chunks(setup, "disk", "m", random_keys(3))
    now = time.time()
    for _, key in disk_files(setup):
        age_disk_file(setup, "m", key, 2 * DAY, now)
    code, out = setup.invoke("gc")
    assert code == EXIT_USAGE and "--max-age" in out, out
    code, out = setup.invoke("gc", "--max-age", "soon")
    assert code == EXIT_USAGE and "not a duration" in out, out
    code, out = setup.invoke("gc", "--max-age", "1d", "--tier", "tape")
    assert code == EXIT_USAGE and "unknown tier 'tape'" in out, out
    code, out = setup.invoke("gc", "--max-age", "1d", "--tier", "disk")  # no terminal, no --yes: refuse
    assert code == EXIT_USAGE and "--yes" in out, out
    assert len(disk_files(setup)) == 3
    result = runner.invoke(app, ["gc", "--max-age", "1d", "--tier", "disk", "--config", str(setup.config_file)])
    assert result.exit_code == EXIT_USAGE
    code, out = setup.invoke("gc", "--max-age", "12h", "--tier", "disk", "--install-lifecycle")
    assert code == EXIT_USAGE and "1d or more" in out, out
    bad = setup.config_file.with_name("bad.toml")
    bad.write_text("[disk]\npaht = '/tmp'\n")
    result = runner.invoke(app, ["gc", "--max-age", "1d", "--config", str(bad)])
    assert result.exit_code == EXIT_USAGE and "disk.paht" in result.output and "disk.path" in result.output
    assert EXIT_DECLINED == 4
    code, out = setup.invoke("gc", "--max-age", "1d", "--tier", "disk", "-y")
    assert code == EXIT_OK and len(disk_files(setup)) == 0, out


def test_namespace_directories_are_readable_and_distinct() -> None:
    assert namespace_dir("smollm2-135m") == "smollm2-135m"
    odd = namespace_dir("vllm:/models/llama#paged=cpu_vec")
    assert (
        odd.startswith("vllm-models-llama-paged-cpu_vec~") and len(odd) == len("vllm-models-llama-paged-cpu_vec~") + 12
    )
    assert namespace_dir("a:b") != namespace_dir("a/b") != namespace_dir("a-b")
    accept = namespace_filter(["vllm:/models/llama#paged=cpu_vec", "smol*"])
    assert accept is not None and accept(odd) and accept("smollm2") and not accept("other")


# == verify ====================================================================================


def corrupt_in_every_way(setup: Setup, tier: str, keys: list[str], moto_server) -> dict[str, str]:
    """Damage some objects, each differently, straight in the storage; returns key -> what was done."""
    damage = {
        keys[0]: "bit flip in a layer",
        keys[1]: "bit flip in the header",
        keys[2]: "truncated",
        keys[3]: "not a chunk at all",
        keys[4]: "another key's chunk",
        keys[5]: "empty",
    }

    def spoil(key: str, data: bytes) -> bytes:
        what = damage[key]
        if what == "bit flip in a layer":
            return data[:-5] + bytes([data[-5] ^ 0x01]) + data[-4:]
        if what == "bit flip in the header":
            return data[:100] + bytes([data[100] ^ 0x80]) + data[101:]
        if what == "truncated":
            return data[: len(data) - 100]
        if what == "not a chunk at all":
            return os.urandom(len(data))
        if what == "another key's chunk":
            return read(keys[10])
        return b""

    if tier == "disk":

        def read(key: str) -> bytes:
            return DiskBackend(setup.disk_root, 1, namespace="checked").path_for(key).read_bytes()

        for key in damage:
            DiskBackend(setup.disk_root, 1, namespace="checked").path_for(key).write_bytes(spoil(key, read(key)))
    elif tier == "redis":
        raw = redis.Redis.from_url(setup.redis_url)

        def read(key: str) -> bytes:
            return raw.get(f"{setup.redis_prefix}:checked:{key}")

        for key in damage:
            raw.set(f"{setup.redis_prefix}:checked:{key}", spoil(key, read(key)))
        raw.close()
    else:
        client = raw_s3_client(moto_server)

        def read(key: str) -> bytes:
            return client.get_object(Bucket=TEST_BUCKET, Key=f"{setup.s3_prefix}/checked/{key}")["Body"].read()

        for key in damage:
            client.put_object(Bucket=TEST_BUCKET, Key=f"{setup.s3_prefix}/checked/{key}", Body=spoil(key, read(key)))
    return damage


@pytest.mark.parametrize("tier", ["disk", "redis", "s3"])
def test_verify_finds_exactly_the_damaged_objects_and_removes_them(setup: Setup, tier: str, moto_server) -> None:
    keys = random_keys(200)
    write_chunks(setup, tier, "checked", keys)
    write_chunks(setup, tier, "other", random_keys(20))  # another namespace, left out by the filter
    damage = corrupt_in_every_way(setup, tier, keys, moto_server)

    code, out = setup.invoke("verify", "--tier", tier, "--namespace", "checked")
    assert code == EXIT_DAMAGED, out
    reported = dict(re.findall(rf"damaged: {tier} checked/([0-9a-f]{{64}}): (.+)", out))
    assert set(reported) == set(damage), out
    assert "checksum" in reported[keys[0]] and "another key" in reported[keys[4]], reported
    assert f"│ {tier} " in out and " 200 " in out, out  # all 200 checked, the other namespace not
    assert len(stored_keys(setup, tier, "checked")) == 200  # reporting removes nothing

    code, out = setup.invoke("verify", "--tier", tier, "--namespace", "checked", "--delete", "--yes")
    assert code == EXIT_OK, out
    assert {key for _, key in stored_keys(setup, tier, "checked")} == set(keys) - set(damage)
    assert len(stored_keys(setup, tier, "other")) == 20

    code, out = setup.invoke("verify", "--tier", tier)
    assert code == EXIT_OK and "damaged:" not in out, out


def test_verify_spares_a_damaged_chunk_an_engine_rewrote_meanwhile(setup: Setup, moto_server) -> None:
    """Between verify's read and its removal an engine heals the chunk: the good copy stays."""
    keys = random_keys(12)

    async def scenario(tier: str) -> tuple[int, int]:
        from kvstore.cli.inventory import list_objects, verify_tier

        async with tool_backends(setup.config, [tier]) as backends:
            objects = await list_objects(backends[tier], None)
            result = await verify_tier(tier, backends[tier], objects)
            assert len(result.damaged) == 6
            await asyncio.to_thread(write_chunks, setup, tier, "checked", keys[:6])  # the engine heals them
            report = await backends[tier].remove_unchanged([bad.item for bad in result.damaged])
            return report.removed, report.changed

    for tier in ("disk", "redis", "s3"):
        write_chunks(setup, tier, "checked", keys)
        corrupt_in_every_way(setup, tier, keys, moto_server)
        if tier == "s3":
            time.sleep(1.1)  # a rewrite within the same second would look unchanged to S3's listing
        assert asyncio.run(scenario(tier)) == (0, 6), tier
        assert len(stored_keys(setup, tier, "checked")) == 12, tier


# -- temporary files of writers that were killed ------------------------------------------------------


@pytest.mark.parametrize("args", [["gc", "--max-age", "1d", "--yes"], ["verify"]], ids=["gc", "verify"])
def test_gc_and_verify_remove_a_killed_writers_temporary_at_once_and_keep_a_live_ones(tmp_path, monkeypatch, args):
    """A temporary is named with its writer (pid, start time, machine): one whose writer has exited goes
    at once, not only once it is older than disk.STALE_TMP_SECONDS; a live writer's stays."""
    for name in list(os.environ):
        if name.upper().startswith("KVSTORE"):
            monkeypatch.delenv(name)
    root = tmp_path / "disk"
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[disk]\npath = "{root}"\n')
    shard = root / namespace_dir("model") / "ab" / "cd"
    shard.mkdir(parents=True)
    final = str(shard / f"abcd{'0' * 60}.kvc")
    writer = (  # a writer that dies mid-write: its temporary named as a store's write names it, never renamed
        "import os, sys\nfrom kvstore.backends.disk import temporary_name\n"
        "with open(temporary_name(sys.argv[1]), 'wb') as file:\n    file.write(b'half a chunk')\nos._exit(9)\n"
    )
    child = subprocess.run([sys.executable, "-c", writer, final], check=False)
    assert child.returncode == 9
    (killed,) = shard.glob("*.tmp-*")
    live = Path(temporary_name(final))  # this process: a write in progress
    live.write_bytes(b"being written")
    result = runner.invoke(app, [*args, "--config", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert not killed.exists(), "the killed writer's temporary is still there"
    assert live.exists(), "a live writer's temporary was removed"
    output = " ".join(result.output.split())
    assert "removed 1 temporary files (12 B) of writers that no longer run" in output, output
    assert "left 1 temporary files younger than 10 min" in output, output

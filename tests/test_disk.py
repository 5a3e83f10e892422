"""DiskBackend (one file per chunk, atomic, private, bounded, restart-proof) and ChunkTier over it."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import KVStore, StoreConfig
from kvstore.backends.base import Backend
from kvstore.backends.disk import DiskBackend
from kvstore.backends.temporaries import STALE_TMP_SECONDS
from kvstore.codecs import BytesBytesCodec, CodecRegistry, SegmentSpec, make_codec
from kvstore.codecs import registry as codec_registry
from kvstore.engine.dram import SlabPool
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.storage import container
from kvstore.storage.container import encode_chunk, header_size
from kvstore.storage.tier import ChunkTier
from kvstore.testing import MemoryBackend, listed_keys, read_chunk, write_chunk
from kvstore.util.buffers import as_bytes_view, tensor_bytes

REPO = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=16)
CODECS = ["identity", "bytesplit", "zstd"]


# -- helpers -----------------------------------------------------------------------------------


def hexkey(name: object) -> str:
    """A 64-hex chunk key (the shape chunk_keys produces)."""
    return hashlib.sha256(str(name).encode()).hexdigest()


def make_chunk(seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """A deterministic random chunk of ``layout``'s shape and dtype."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.chunk_shape, generator=generator, dtype=torch.float32).to(layout.dtype)


def chunk_view(chunk: torch.Tensor) -> memoryview:
    return tensor_bytes(chunk)


def files_under(root: Path) -> list[Path]:
    return sorted(Path(dirpath) / name for dirpath, _, names in os.walk(root) for name in names)


def temporaries_under(root: Path) -> list[Path]:
    return [path for path in files_under(root) if ".tmp-" in path.name]


def set_mtime(path: Path, when: float) -> None:
    os.utime(path, (when, when))


async def open_backend(root: Path, capacity: int = 1 << 30, **kwargs) -> DiskBackend:
    backend = DiskBackend(root, capacity, **kwargs)
    await backend.open()
    return backend


def make_tier(backend: Backend, codec: str, layout: KVLayout = LAYOUT) -> ChunkTier:
    return ChunkTier(backend, make_codec(codec), layout, None)


@pytest.fixture
async def disk(tmp_path: Path) -> AsyncIterator[DiskBackend]:
    backend = await open_backend(tmp_path / "disk")
    yield backend
    await backend.close()


# == DiskBackend: the basic interface ==========================================================


async def test_set_get_exists_delete(disk: DiskBackend):
    key = hexkey("a")
    assert await disk.get(key) is None
    assert not await disk.exists(key)

    await disk.set(key, [b"hello ", bytearray(b"kv "), memoryview(b"world")])
    assert await disk.exists(key)
    assert await disk.get(key) == b"hello kv world"
    assert disk.holds(key)

    await disk.delete(key)
    assert not await disk.exists(key)
    assert await disk.get(key) is None
    assert not disk.holds(key)
    await disk.delete(key)  # deleting an absent object is not an error
    assert disk.stats()["files"] == 0
    assert disk.stats()["bytes_used"] == 0


async def test_set_overwrites_and_accounts_the_new_size(disk: DiskBackend):
    key = hexkey("a")
    await disk.set(key, [b"x" * 100])
    await disk.set(key, [b"y" * 40])
    assert await disk.get(key) == b"y" * 40
    assert disk.stats()["files"] == 1
    assert disk.stats()["bytes_used"] == 40


async def test_get_with_byte_range(disk: DiskBackend):
    key = hexkey("a")
    await disk.set(key, [bytes(range(100))])
    assert await disk.get(key, (0, 10)) == bytes(range(10))
    assert await disk.get(key, (10, 25)) == bytes(range(10, 25))
    assert await disk.get(key, (95, 200)) == bytes(range(95, 100))  # clipped at the end
    assert await disk.get(key, (50, 50)) == b""
    assert await disk.get(key, (200, 300)) == b""
    assert await disk.get(hexkey("absent"), (0, 10)) is None


async def test_get_into_scatter_reads_leading_bytes(disk: DiskBackend):
    key = hexkey("a")
    payload = bytes(range(256)) * 4  # 1024 bytes
    await disk.set(key, [payload[:300], payload[300:]])

    first, second, third = bytearray(10), bytearray(500), bytearray(600)
    size = await disk.get_into(key, [memoryview(first), memoryview(second), memoryview(third)])
    assert size == 1024
    assert bytes(first) == payload[:10]
    assert bytes(second) == payload[10:510]
    assert bytes(third[:514]) == payload[510:]
    assert bytes(third[514:]) == bytes(86)  # beyond the file: untouched

    short = bytearray(b"\xff" * 16)
    assert await disk.get_into(key, [memoryview(short)]) == 1024  # the object's size, not the bytes read
    assert bytes(short) == payload[:16]

    assert await disk.get_into(hexkey("absent"), [memoryview(bytearray(8))]) is None


async def test_get_into_many_small_buffers(disk: DiskBackend):
    # more buffers than one preadv may take at once (IOV_MAX is 1024)
    key = hexkey("many")
    payload = os.urandom(3000)
    await disk.set(key, [payload])
    buffers = [bytearray(1) for _ in range(2500)] + [bytearray(1000)]
    assert await disk.get_into(key, [memoryview(b) for b in buffers]) == 3000
    assert b"".join(bytes(b) for b in buffers[:2500]) == payload[:2500]
    assert bytes(buffers[-1][:500]) == payload[2500:]


async def test_set_with_many_parts(disk: DiskBackend):
    key = hexkey("parts")
    parts = [bytes([i % 256]) * 3 for i in range(2100)]  # more parts than one writev may take
    await disk.set(key, parts)
    assert await disk.get(key) == b"".join(parts)


async def test_list_keys(disk: DiskBackend):
    keys = {hexkey(i) for i in range(20)}
    for key in keys:
        await disk.set(key, [b"data"])
    assert set(await listed_keys(disk)) == keys
    prefix = sorted(keys)[0][:1]
    assert set(await listed_keys(disk, prefix)) == {k for k in keys if k.startswith(prefix)}
    assert await listed_keys(disk, "zz") == []
    await disk.delete(sorted(keys)[0])
    assert set(await listed_keys(disk)) == keys - {sorted(keys)[0]}


async def test_prefix_count_checks_the_files(disk: DiskBackend):
    keys = [hexkey(i) for i in range(5)]
    for key in keys[:3]:
        await disk.set(key, [b"x"])
    assert await disk.prefix_count(keys) == 3
    assert await disk.prefix_count(keys[:2]) == 2
    assert await disk.prefix_count([]) == 0
    os.unlink(disk.path_for(keys[1]))  # removed behind the index's back (another process)
    assert await disk.prefix_count(keys) == 1


# == DiskBackend: paths and permissions ========================================================


async def test_layout_and_private_permissions(tmp_path: Path):
    root = tmp_path / "cache" / "disk"
    backend = await open_backend(root)
    key = hexkey("perm")
    await backend.set(key, [b"secret prompt kv"])

    path = root / "default" / key[:2] / key[2:4] / f"{key}.kvc"  # the namespace directory, then two shard levels
    assert backend.path_for(key) == path
    assert path.is_file()
    assert files_under(root) == [path]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for directory in (root, root / "default", root / "default" / key[:2], root / "default" / key[:2] / key[2:4]):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


async def test_directories_are_private_even_without_open(tmp_path: Path):
    root = tmp_path / "never-opened"
    backend = DiskBackend(root, 1 << 20)  # a write before open() must still create 0700 directories
    key = hexkey("x")
    await backend.set(key, [b"data"])
    path = backend.path_for(key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for directory in (root, path.parent.parent.parent, path.parent.parent, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


async def test_every_directory_kvstore_creates_is_private_and_existing_ones_keep_their_mode(tmp_path: Path):
    tmp_path.chmod(0o755)  # existing: never changed
    root = tmp_path / "made" / "by" / "kvstore"
    backend = await open_backend(root)
    await backend.set(hexkey("p"), [b"kv"])
    for directory in (tmp_path / "made", tmp_path / "made" / "by", root):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755


@pytest.mark.parametrize("where", ["root", "parent"])
async def test_disk_path_on_a_file_is_a_config_error_naming_disk_path(tmp_path: Path, where: str):
    a_file = tmp_path / "not-a-directory"
    a_file.write_bytes(b"x")
    root = a_file if where == "root" else a_file / "disk"
    with pytest.raises(ConfigError, match=r"disk\.path .*is a file; set disk\.path to a directory"):
        await open_backend(root)
    assert a_file.read_bytes() == b"x"


@pytest.mark.parametrize(
    "root, problem",
    [
        ("/proc/kvstore-test", "cannot be created"),  # procfs makes no directory
        ("/sys/kvstore-test/disk", "cannot be created"),  # nor does sysfs, even for root
        ("/sys", "cannot hold files"),  # a directory that is there, where no file can be made
    ],
)
async def test_disk_path_where_no_file_can_be_made_is_a_config_error_naming_disk_path(root: str, problem: str):
    """A read-only file system, /proc or /sys raised a bare OSError at open (or, existing, failed every write)."""
    with pytest.raises(ConfigError) as excinfo:
        await open_backend(Path(root))
    (line,) = str(excinfo.value).splitlines()
    assert line.startswith(f"disk.path {root} {problem}: ") and "set disk.path to a directory on a writable" in line
    config = StoreConfig(dram={"capacity": 4 * LAYOUT.chunk_nbytes}, disk={"path": root})
    with pytest.raises(ConfigError, match=rf"disk\.path {root} {problem}"):
        async with KVStore(config, LAYOUT, namespace="test"):
            pass


@pytest.mark.parametrize(
    "bad", ["../etc", "../../../../tmp/x", "ABCDEF0123", "abc", "", "0123456789abcdeg", "/etc/passwd", "a" * 129]
)
async def test_keys_that_are_not_lowercase_hex_are_rejected(tmp_path: Path, bad: str):
    root = tmp_path / "disk"
    backend = await open_backend(root)
    with pytest.raises(ValueError):
        backend.path_for(bad)
    with pytest.raises(ValueError):
        await backend.set(bad, [b"data"])
    with pytest.raises(ValueError):
        await backend.get(bad)
    with pytest.raises(ValueError):
        await backend.delete(bad)
    # nothing was written anywhere, inside the root or beside it
    assert files_under(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]


async def test_a_removed_shard_directory_is_recreated(disk: DiskBackend):
    # Someone cleared the cache directory while the engine runs: writes must not fail forever.
    key = hexkey("a")
    await disk.set(key, [b"one"])
    shutil.rmtree(disk.path_for(key).parent.parent)
    await disk.set(key, [b"two"])
    assert await disk.get(key) == b"two"


# == DiskBackend: atomicity ====================================================================


async def test_no_temporary_files_remain_after_writes(disk: DiskBackend):
    for i in range(50):
        await disk.set(hexkey(i % 10), [os.urandom(100 + i)])
    assert temporaries_under(disk.root) == []
    assert len(files_under(disk.root)) == 10


async def test_a_failed_write_leaves_no_temporary_and_keeps_the_old_file(disk: DiskBackend, monkeypatch):
    key = hexkey("a")
    await disk.set(key, [b"old contents"])

    def broken_write(fd, *args):
        os.write(fd, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvstore.backends.disk.write_fully", broken_write)
    with pytest.raises(OSError) as info:
        await disk.set(key, [b"new contents that never land"])
    assert info.value.errno == errno.ENOSPC  # a write never evicts its own key's current copy to make room
    monkeypatch.undo()

    assert temporaries_under(disk.root) == []
    assert await disk.get(key) == b"old contents"
    assert disk.stats()["bytes_used"] == len(b"old contents")


async def test_a_reader_never_sees_a_partial_file(disk: DiskBackend):
    key = hexkey("big")
    size = 4 << 20
    versions = [bytes([value]) * size for value in (0x11, 0x22, 0x33)]
    await disk.set(key, [versions[0]])
    writes_done = asyncio.Event()
    seen: list[int] = []

    async def writer() -> None:
        for i in range(24):
            await disk.set(key, [versions[i % 3]])
        writes_done.set()

    async def reader() -> None:
        out = bytearray(size + 1)
        while not writes_done.is_set():
            data = await disk.get(key)
            assert data is not None and len(data) == size
            assert data in versions, "a read saw a torn or partial file"
            got = await disk.get_into(key, [memoryview(out)])
            assert got == size
            assert bytes(out[:size]) in versions
            seen.append(data[0])

    await asyncio.wait_for(asyncio.gather(writer(), reader()), timeout=30)
    assert seen, "the reader never ran"
    assert temporaries_under(disk.root) == []


# == DiskBackend: byte budget and LRU ==========================================================


async def test_budget_evicts_least_recently_used(tmp_path: Path):
    backend = await open_backend(tmp_path / "disk", capacity=3000)
    a, b, c, d = (hexkey(n) for n in "abcd")
    for key in (a, b, c):
        await backend.set(key, [os.urandom(1000)])
    assert backend.stats()["bytes_used"] == 3000

    assert await backend.get(a) is not None  # a hit refreshes "a": "b" is now the oldest
    await backend.set(d, [os.urandom(1000)])
    assert backend.stats()["bytes_used"] <= 3000
    assert not backend.path_for(b).exists()
    assert await backend.get(b) is None
    for key in (a, c, d):
        assert backend.path_for(key).exists()
    assert backend.stats()["evictions"] == 1

    # get_into and byte-range gets refresh recency too
    assert await backend.get_into(c, [memoryview(bytearray(10))]) == 1000
    assert await backend.get(a, (0, 10)) is not None
    await backend.set(b, [os.urandom(1000)])  # evicts "d", now the least recent
    assert not backend.path_for(d).exists()
    assert {k for k in (a, b, c, d) if backend.path_for(k).exists()} == {a, b, c}


async def test_bytes_used_never_exceeds_capacity(tmp_path: Path):
    capacity = 10_000
    backend = await open_backend(tmp_path / "disk", capacity=capacity)
    sizes = [700, 1300, 2500, 90, 4000, 333, 1700, 5000, 10, 2222] * 5
    for i, size in enumerate(sizes):
        await backend.set(hexkey(i % 17), [os.urandom(size)])
        stats = backend.stats()
        assert stats["bytes_used"] <= capacity
        on_disk = sum(path.stat().st_size for path in files_under(backend.root))
        assert on_disk == stats["bytes_used"]
        assert len(files_under(backend.root)) == stats["files"]
    assert backend.stats()["evictions"] > 0


async def test_the_newest_write_is_never_its_own_victim(tmp_path: Path):
    backend = await open_backend(tmp_path / "disk", capacity=1000)
    await backend.set(hexkey("a"), [b"a" * 600])
    await backend.set(hexkey("b"), [b"b" * 1000])  # exactly the capacity: everything else goes
    assert await backend.get(hexkey("b")) == b"b" * 1000
    assert await backend.get(hexkey("a")) is None
    assert backend.stats()["bytes_used"] == 1000


async def test_an_object_larger_than_the_capacity_is_refused(tmp_path: Path):
    backend = await open_backend(tmp_path / "disk", capacity=1000)
    await backend.set(hexkey("small"), [b"s" * 500])
    with pytest.raises(OSError) as info:
        await backend.set(hexkey("huge"), [b"h" * 600, b"h" * 401])
    assert info.value.errno == errno.EFBIG
    assert "capacity" in str(info.value)
    assert not backend.path_for(hexkey("huge")).exists()
    assert temporaries_under(backend.root) == []
    # nothing was evicted to make room for it
    assert await backend.get(hexkey("small")) == b"s" * 500
    assert backend.stats()["evictions"] == 0


def bytes_on_disk_per_key(root: Path) -> int:
    """Bytes of chunk files and temporaries under ``root``, each key counted once.

    (A temporary renamed into place while the directory is listed could show under both names.)
    """
    sizes: dict[str, int] = {}
    for directory, _, names in os.walk(root):
        for name in names:
            try:
                size = os.stat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                continue
            key = name.partition(".")[0]
            sizes[key] = max(size, sizes.get(key, 0))
    return sum(sizes.values())


async def test_concurrent_writes_never_take_the_directory_past_the_budget(tmp_path: Path, monkeypatch):
    """Each write reserves its bytes before writing: even with 8 writers at once, temporaries included."""
    from concurrent.futures import ThreadPoolExecutor

    import kvstore.backends.disk as disk_module

    size, files = 64 << 10, 3
    capacity = size * files
    seen: list[int] = []
    real_write = disk_module.write_fully

    def write_and_measure(fd, views):
        real_write(fd, views)
        with backend._budget.lock:  # no eviction or reservation moves while the directory is measured
            seen.append(bytes_on_disk_per_key(backend.root))

    monkeypatch.setattr(disk_module, "write_fully", write_and_measure)
    with ThreadPoolExecutor(8) as pool:
        backend = await open_backend(tmp_path / "disk", capacity=capacity, executor=pool)

        async def one(i: int) -> None:
            await backend.set(hexkey(i), [os.urandom(size)])
            with backend._budget.lock:  # a walk is not atomic: measured while the writer threads cannot move
                seen.append(bytes_on_disk_per_key(backend.root))

        await asyncio.gather(*(one(i) for i in range(40)))
    assert len(seen) == 80
    assert max(seen) <= capacity, f"the directory held {max(seen)} bytes, the budget is {capacity}"
    stats = backend.stats()
    assert stats["files"] == files and stats["bytes_used"] == capacity == bytes_on_disk_per_key(backend.root)
    assert temporaries_under(backend.root) == []


async def test_enospc_evicts_the_oldest_and_retries_once(tmp_path: Path, monkeypatch, caplog):
    """An injected ENOSPC at the one call that writes file bytes (the errno path; a real full file system below)."""
    import kvstore.backends.disk as disk_module

    backend = await open_backend(tmp_path / "disk", capacity=1 << 20)
    a, b, c, d = (hexkey(n) for n in "abcd")
    for key in (a, b, c):
        await backend.set(key, [os.urandom(1000)])
    real_write, failures = disk_module.write_fully, [1]

    def full_once(fd, views):
        if failures:
            failures.pop()
            os.write(fd, b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, views)

    monkeypatch.setattr(disk_module, "write_fully", full_once)
    await backend.set(d, [b"d" * 1000])
    assert await backend.get(d) == b"d" * 1000
    assert not backend.path_for(a).exists(), "the least recently used file made room"
    assert backend.path_for(b).exists() and backend.path_for(c).exists()
    assert temporaries_under(backend.root) == []
    stats = backend.stats()
    assert stats["disk_full"] == 1 and stats["evictions"] == 1 and stats["bytes_used"] == 3000
    assert "file system is full" in caplog.text


@pytest.fixture
def small_file_system(tmp_path: Path):
    """A real 2 MiB tmpfs (needs root: the CI machine runs the suite as root; without it the test fails)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the full-disk test (run as root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


async def test_a_full_file_system_is_answered_by_eviction(small_file_system: Path):
    """A budget above the free space: every write still lands, the oldest chunks making room."""
    backend = await open_backend(small_file_system / "disk", capacity=1 << 30)
    size = 256 << 10
    for i in range(24):  # 6 MiB through a 2 MiB file system
        await backend.set(hexkey(i), [os.urandom(size)])
    assert await backend.get(hexkey(23)) is not None
    assert not backend.path_for(hexkey(0)).exists()
    stats = backend.stats()
    assert stats["disk_full"] > 0 and stats["evictions"] > 0
    assert stats["bytes_used"] == bytes_on_disk_per_key(backend.root) == stats["files"] * size
    assert temporaries_under(backend.root) == []


async def test_opening_a_small_budget_leaves_other_namespaces_alone(tmp_path: Path, caplog):
    """Two models share one directory: each store's budget covers its own namespace only."""
    root = tmp_path / "disk"
    model_a = await open_backend(root, namespace="model-a")
    theirs = {hexkey(f"a{i}"): os.urandom(1000) for i in range(4)}
    for key, data in theirs.items():
        await model_a.set(key, [data])
    await model_a.close()

    caplog.set_level("INFO", logger="kvstore.disk")
    model_b = await open_backend(root, capacity=1500, namespace="model-b")
    assert "4 chunk files (0.0 MiB) of other namespaces, outside this store's budget: left alone" in caplog.text
    for i in range(3):
        await model_b.set(hexkey(f"b{i}"), [os.urandom(1000)])
    assert model_b.stats()["bytes_used"] == 1000 and model_b.stats()["files"] == 1
    assert model_b.path_for(hexkey("b2")).exists() and not model_b.path_for(hexkey("b0")).exists()
    for key, data in theirs.items():
        assert (root / "model-a" / key[:2] / key[2:4] / f"{key}.kvc").read_bytes() == data


# == DiskBackend: restarts =====================================================================


async def test_restart_rebuilds_the_index_by_scanning(tmp_path: Path):
    root = tmp_path / "disk"
    first = await open_backend(root)
    contents = {hexkey(i): os.urandom(100 + i) for i in range(12)}
    for key, data in contents.items():
        await first.set(key, [data])
    await first.close()

    second = DiskBackend(root, 1 << 30)
    await second.open()
    stats = second.stats()
    assert stats["files"] == 12
    assert stats["bytes_used"] == sum(len(d) for d in contents.values())
    for key, data in contents.items():
        assert second.holds(key)
        assert await second.get(key) == data
    assert set(await listed_keys(second)) == set(contents)


async def test_a_hit_touches_mtime_so_lru_order_survives_restart(tmp_path: Path):
    root = tmp_path / "disk"
    first = await open_backend(root, capacity=3000)
    a, b, c, d = (hexkey(n) for n in "abcd")
    for key in (a, b, c):
        await first.set(key, [os.urandom(1000)])
    # Explicit, well-separated mtimes: file timestamps are coarse (a clock tick).
    now = time.time()
    for age, key in ((300, a), (200, b), (100, c)):
        set_mtime(first.path_for(key), now - age)

    assert await first.get(a) is not None  # touches the file
    assert first.path_for(a).stat().st_mtime > now - 60
    assert first.path_for(b).stat().st_mtime == pytest.approx(now - 200, abs=1)
    await first.close()

    second = await open_backend(root, capacity=3000)
    assert second.stats()["files"] == 3
    await second.set(d, [os.urandom(1000)])  # evicts "b": the oldest after "a" was refreshed
    assert not second.path_for(b).exists()
    assert all(second.path_for(k).exists() for k in (a, c, d))


async def test_get_into_touches_mtime(disk: DiskBackend):
    key = hexkey("a")
    await disk.set(key, [b"x" * 10])
    old = time.time() - 1000
    set_mtime(disk.path_for(key), old)
    assert await disk.get_into(key, [memoryview(bytearray(10))]) == 10
    assert disk.path_for(key).stat().st_mtime > old + 500


async def test_restart_with_a_smaller_budget_evicts_the_oldest(tmp_path: Path):
    root = tmp_path / "disk"
    first = await open_backend(root)
    keys = [hexkey(i) for i in range(5)]
    now = time.time()
    for age, key in zip((500, 100, 400, 200, 300), keys, strict=False):
        await first.set(key, [os.urandom(1000)])
        set_mtime(first.path_for(key), now - age)

    second = await open_backend(root, capacity=2500)
    assert second.stats()["bytes_used"] <= 2500
    survivors = {key for key in keys if second.path_for(key).exists()}
    assert survivors == {keys[1], keys[3]}  # the two most recent (ages 100 and 200)
    assert second.stats()["files"] == 2


async def test_restart_sweeps_stale_temporaries_and_keeps_fresh_ones(tmp_path: Path):
    root = tmp_path / "disk"
    first = await open_backend(root)
    key = hexkey("a")
    await first.set(key, [b"real"])
    shard = first.path_for(key).parent
    stale = shard / f"{key}.kvc.tmp-12345-deadbeef"
    fresh = shard / f"{key}.kvc.tmp-12346-cafebabe"
    other_shard = root / "another-namespace" / "00" / "11"  # swept in every namespace
    other_shard.mkdir(parents=True)
    stale_elsewhere = other_shard / f"0011{'0' * 60}.kvc.tmp-1-00000000"
    for path in (stale, fresh, stale_elsewhere):
        path.write_bytes(b"half-written")
    now = time.time()
    set_mtime(stale, now - STALE_TMP_SECONDS - 60)
    set_mtime(stale_elsewhere, now - 10 * STALE_TMP_SECONDS)
    set_mtime(fresh, now - STALE_TMP_SECONDS / 2)  # maybe a live writer in another process
    unrelated = shard / "notes.txt"
    unrelated.write_bytes(b"not ours")

    second = await open_backend(root)
    assert not stale.exists()
    assert not stale_elsewhere.exists()
    assert fresh.exists()
    assert unrelated.exists()  # files that are not ours are left alone
    stats = second.stats()
    assert stats["files"] == 1
    assert stats["bytes_used"] == len(b"real")
    assert await listed_keys(second) == [key]
    assert await second.get(key) == b"real"


# == two processes sharing one directory =======================================================

BIG = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, chunk_tokens=64)  # 256 KiB chunks
VERSIONS = 3

WRITER = textwrap.dedent(
    """
    import asyncio, sys, time
    import torch
    from kvstore.backends.disk import DiskBackend
    from kvstore.util.buffers import tensor_bytes
    from kvstore.codecs import make_codec
    from kvstore.layout import KVLayout
    from kvstore.storage.container import encode_chunk

    root, duration, versions = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    keys = sys.argv[4].split(",")
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, chunk_tokens=64)

    def make_chunk(seed):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(layout.chunk_shape, generator=generator, dtype=torch.float32).to(layout.dtype)

    async def main():
        backend = DiskBackend(root, 1 << 30)
        await backend.open()
        # alternate codecs so the reader meets files of different sizes under one name; write
        # through the backend, which always replaces (the tier skips a key it already has)
        codecs = [make_codec(name) for name in ("identity", "zstd")]
        chunks = [[make_chunk(1000 * k + v) for v in range(versions)] for k in range(len(keys))]
        print("ready", flush=True)
        deadline = time.monotonic() + duration
        rounds = 0
        while time.monotonic() < deadline:
            for k, key in enumerate(keys):
                chunk = tensor_bytes(chunks[k][(rounds + k) % versions])
                backend.write(key, encode_chunk(layout, key, chunk, codecs[(rounds + k) % 2]))
            rounds += 1
        await backend.delete(keys[0])
        print("rounds", rounds, flush=True)

    asyncio.run(main())
    """
)


async def test_two_processes_share_a_directory_without_torn_reads(tmp_path: Path):
    root = tmp_path / "shared"
    keys = [hexkey(f"shared-{i}") for i in range(6)]
    expected = {
        key: {tensor_bytes(make_chunk(1000 * k + v, BIG)).tobytes() for v in range(VERSIONS)}
        for k, key in enumerate(keys)
    }
    backend = await open_backend(root)  # opened before the other process wrote anything
    assert backend.stats()["files"] == 0
    readers = [make_tier(backend, "identity", BIG), make_tier(backend, "bytesplit", BIG)]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), "2.0", str(VERSIONS), ",".join(keys)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), timeout=60)
        assert line.strip() == "ready", process.stderr.read() if not line else line

        hits, versions_seen = 0, {key: set() for key in keys}
        out = bytearray(BIG.chunk_nbytes)
        deadline = time.monotonic() + 30
        while process.poll() is None and time.monotonic() < deadline:
            for key in keys:
                for tier in readers:
                    out[:] = bytes(len(out))
                    if await read_chunk(tier, key, memoryview(out)):
                        data = bytes(out)
                        assert data in expected[key], "a read returned KV that was never written (torn or mixed)"
                        versions_seen[key].add(data)
                        hits += 1
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    rounds = int(stdout.split()[-1])
    assert rounds > 1

    for tier in readers:
        assert tier.stats.corrupt == 0
        assert tier.stats.errors == 0
        assert tier.stats.hits > 0
    assert hits > 0
    # the other process's rewrites were observed as different, whole versions
    assert any(len(seen) > 1 for seen in versions_seen.values())

    # files the other process wrote are found, and the one it deleted is a miss here
    for key in keys[1:]:
        assert await backend.exists(key)
        out = bytearray(BIG.chunk_nbytes)
        assert await read_chunk(readers[0], key, memoryview(out))
        assert bytes(out) in expected[key]
    misses = readers[0].stats.misses
    assert not await read_chunk(readers[0], keys[0], memoryview(bytearray(BIG.chunk_nbytes)))
    assert readers[0].stats.misses == misses + 1
    assert await backend.prefix_count(keys) == 0
    assert await backend.prefix_count(keys[1:]) == len(keys) - 1
    assert temporaries_under(root) == []


# == ChunkTier =================================================================================


@pytest.mark.parametrize("codec", CODECS)
async def test_tier_roundtrip_is_bit_exact(disk: DiskBackend, codec: str):
    tier = make_tier(disk, codec)
    key, chunk = hexkey("chunk"), make_chunk(1)
    await write_chunk(tier, key, chunk_view(chunk))
    assert disk.holds(key)
    assert tier.stats.writes == 1
    stored = disk.path_for(key).stat().st_size
    assert tier.stats.bytes_written == stored

    out = torch.empty(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
    assert await read_chunk(tier, key, tensor_bytes(out)) is True
    assert torch.equal(out.view(torch.int16), chunk.view(torch.int16))  # bit-exact, NaN-proof
    assert tier.stats.hits == 1
    assert tier.stats.misses == 0 and tier.stats.corrupt == 0 and tier.stats.errors == 0
    assert tier.stats.bytes_read == stored
    assert tier.stats_dict()["codec"] == make_codec(codec).id
    assert tier.stats_dict()["files"] == 1


@pytest.mark.parametrize("codec", CODECS)
async def test_tier_reads_straight_into_a_dram_slot(disk: DiskBackend, codec: str):
    pool = SlabPool(LAYOUT, 4 * LAYOUT.chunk_nbytes)
    tier = make_tier(disk, codec)
    chunks = {hexkey(i): make_chunk(i) for i in range(3)}
    for key, chunk in chunks.items():
        await write_chunk(tier, key, chunk_view(chunk))
    for key, chunk in chunks.items():
        slot = pool.reserve()
        assert await read_chunk(tier, key, pool.buffer(slot))
        assert torch.equal(pool.tensor(slot).view(torch.int16), chunk.view(torch.int16))
        assert pool.publish(slot, key)
        pool.release(slot)
    assert tier.stats.hits == 3


# A layout whose chunk spans several write runs (CHECK_HOT_BYTES each): 3 runs of 2 layers, then 1.
RUNS_LAYOUT = KVLayout(num_layers=7, num_kv_heads=8, head_dim=64, chunk_tokens=256)  # 512 KiB a layer


async def test_an_identity_chunk_is_written_a_run_at_a_time_into_the_same_bytes(disk: DiskBackend, monkeypatch):
    """The tier writes each run of layers right after checksumming it, the header last: the file holds exactly the
    container encode_chunk makes (header, segment table, checksums, the parent's record), and reads back bit-exact."""
    import kvstore.backends.files as files_module

    assert container.CHECK_HOT_BYTES // RUNS_LAYOUT.layer_nbytes == 2
    writes: list[int] = []
    real_write = files_module.write_fully
    monkeypatch.setattr(
        files_module, "write_fully", lambda fd, views: (writes.append(len(views)), real_write(fd, views))
    )
    tier = make_tier(disk, "identity", RUNS_LAYOUT)
    parent, key, chunk = hexkey("parent"), hexkey("child"), make_chunk(3, RUNS_LAYOUT)
    tier.links.note(key, parent)
    await write_chunk(tier, key, chunk_view(chunk))
    assert writes == [2, 2, 2, 1]  # one write per run, header not among them (written at offset 0 last)
    expected = encode_chunk(RUNS_LAYOUT, key, chunk_view(chunk), make_codec("identity"), None, None, None, parent)
    assert disk.path_for(key).read_bytes() == b"".join(bytes(part) for part in expected)
    out = torch.empty(RUNS_LAYOUT.chunk_shape, dtype=RUNS_LAYOUT.dtype)
    assert await read_chunk(tier, key, tensor_bytes(out))
    assert torch.equal(out.view(torch.int16), chunk.view(torch.int16))


async def test_a_streamed_write_that_meets_a_full_disk_is_written_again_whole(tmp_path: Path, monkeypatch):
    """ENOSPC in the middle of a run-at-a-time write: the oldest file makes room and the chunk is written from its
    first run again (not from where the failed attempt stopped)."""
    import kvstore.backends.files as files_module

    backend = await open_backend(tmp_path / "disk", capacity=1 << 30)
    await backend.set(hexkey("old"), [os.urandom(1000)])
    real_write, failures = files_module.write_fully, [1]

    def full_on_the_second_run(fd, views):
        if failures and os.lseek(fd, 0, os.SEEK_CUR) > header_size(RUNS_LAYOUT.num_layers, "identity"):
            failures.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, views)

    monkeypatch.setattr(files_module, "write_fully", full_on_the_second_run)
    tier = make_tier(backend, "identity", RUNS_LAYOUT)
    key, chunk = hexkey("big"), make_chunk(4, RUNS_LAYOUT)
    await write_chunk(tier, key, chunk_view(chunk))
    assert not failures and not backend.path_for(hexkey("old")).exists()
    expected = encode_chunk(RUNS_LAYOUT, key, chunk_view(chunk), make_codec("identity"))
    assert backend.path_for(key).read_bytes() == b"".join(bytes(part) for part in expected)
    assert temporaries_under(backend.root) == []
    await backend.close()


async def test_identity_codec_uses_the_scatter_path(disk: DiskBackend, monkeypatch):
    tier = make_tier(disk, "identity")
    key, chunk = hexkey("direct"), make_chunk(7)
    await write_chunk(tier, key, chunk_view(chunk))
    # header + the slot's exact bytes: nothing else is stored
    assert disk.path_for(key).stat().st_size == header_size(LAYOUT.num_layers, "identity") + LAYOUT.chunk_nbytes

    async def no_whole_reads(*args, **kwargs):
        raise AssertionError("the identity codec must not read the whole object into a new buffer")

    monkeypatch.setattr(disk, "get", no_whole_reads)
    out = bytearray(LAYOUT.chunk_nbytes)
    assert await read_chunk(tier, key, memoryview(out))
    assert bytes(out) == chunk_view(chunk).tobytes()
    assert tier.stats.errors == 0


@pytest.mark.parametrize("writer", CODECS)
@pytest.mark.parametrize("reader", CODECS)
async def test_a_chunk_written_with_one_codec_is_readable_with_another(disk: DiskBackend, writer: str, reader: str):
    key, chunk = hexkey(f"{writer}-{reader}"), make_chunk(42)
    await write_chunk(make_tier(disk, writer), key, chunk_view(chunk))
    tier = make_tier(disk, reader)
    out = bytearray(LAYOUT.chunk_nbytes)
    assert await read_chunk(tier, key, memoryview(out))
    assert bytes(out) == chunk_view(chunk).tobytes()
    assert tier.stats.hits == 1 and tier.stats.corrupt == 0


def _chunk_whose_container_has_size(codec: str, size: int) -> torch.Tensor:
    """Bytes of a chunk that ``codec`` stores in exactly ``size`` bytes (searched, deterministic)."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (LAYOUT.chunk_nbytes,), dtype=torch.uint8, generator=generator)
    pipeline = make_codec(codec)
    for zeros in range(LAYOUT.chunk_nbytes):
        candidate = base.clone()
        candidate[:zeros] = 0
        parts = encode_chunk(LAYOUT, hexkey("x"), memoryview(candidate.numpy()), pipeline)
        if sum(len(as_bytes_view(p)) for p in parts) == size:
            return candidate
    raise AssertionError(f"no {codec} chunk of {size} bytes found")


@pytest.mark.parametrize("writer", ["zstd", "bytesplit", "lz4"])
async def test_another_codecs_file_of_the_identity_size_is_not_mistaken_for_corrupt(disk: DiskBackend, writer: str):
    # The identity tier's scatter path recognises its files by size; a valid file written with
    # a codec whose header is shorter or longer can have exactly that size. It must still be
    # decoded (general path), not counted as corrupt and deleted.
    identity_size = header_size(LAYOUT.num_layers, "identity") + LAYOUT.chunk_nbytes
    chunk = _chunk_whose_container_has_size(writer, identity_size)
    key = hexkey(f"collide-{writer}")
    await write_chunk(make_tier(disk, writer), key, memoryview(chunk.numpy()))
    assert disk.path_for(key).stat().st_size == identity_size

    tier = make_tier(disk, "identity")
    out = bytearray(LAYOUT.chunk_nbytes)
    assert await read_chunk(tier, key, memoryview(out))
    assert bytes(out) == chunk.numpy().tobytes()
    assert tier.stats.corrupt == 0 and tier.stats.hits == 1
    assert disk.path_for(key).exists()


# -- corruption --------------------------------------------------------------------------------


def _flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as file:
        file.truncate(size)


async def _corrupt(kind: str, disk: DiskBackend, codec: str, key: str) -> None:
    path = disk.path_for(key)
    header = header_size(LAYOUT.num_layers, make_codec(codec).id)
    total = path.stat().st_size
    if kind == "flip_magic":
        _flip(path, 0)
    elif kind == "flip_fingerprint":
        _flip(path, 20)
    elif kind == "flip_key":
        _flip(path, 40)
    elif kind == "flip_segment_table":
        _flip(path, header - 20)
    elif kind == "flip_header_checksum":
        _flip(path, header - 1)
    elif kind == "flip_first_segment":
        _flip(path, header)
    elif kind == "flip_last_byte":
        _flip(path, total - 1)
    elif kind == "truncate_payload":
        _truncate(path, total - 1)
    elif kind == "truncate_half_header":
        _truncate(path, header // 2)
    elif kind == "empty":
        _truncate(path, 0)
    elif kind == "trailing_garbage":
        with open(path, "ab") as file:
            file.write(b"\x00")
    elif kind == "garbage":
        path.write_bytes(os.urandom(total))
    elif kind.startswith("layout_"):
        other = {
            # same number of bytes, other meaning: only the fingerprint tells them apart
            "layout_same_size": KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=16),
            "layout_float16": KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=16, dtype=torch.float16),
            "layout_other_size": KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, chunk_tokens=16),
        }[kind]
        # a foreign writer replacing the file (the backend replaces; a tier would skip a key it has)
        disk.write(key, encode_chunk(other, key, chunk_view(make_chunk(5, other)), make_codec(codec)))
    elif kind == "other_key":
        other_key = hexkey("someone else")
        await write_chunk(make_tier(disk, codec), other_key, chunk_view(make_chunk(6)))
        os.replace(disk.path_for(other_key), path)
    else:  # pragma: no cover
        raise AssertionError(kind)


CORRUPTIONS = [
    "flip_magic",
    "flip_fingerprint",
    "flip_key",
    "flip_segment_table",
    "flip_header_checksum",
    "flip_first_segment",
    "flip_last_byte",
    "truncate_payload",
    "truncate_half_header",
    "empty",
    "trailing_garbage",
    "garbage",
    "other_key",
]
FOREIGN_LAYOUTS = ["layout_same_size", "layout_float16", "layout_other_size"]


@pytest.mark.parametrize("codec", ["identity", "zstd", "bytesplit"])
@pytest.mark.parametrize("kind", CORRUPTIONS)
async def test_a_damaged_or_foreign_chunk_is_a_counted_miss_and_removed(disk: DiskBackend, codec: str, kind: str):
    tier = make_tier(disk, codec)
    key, chunk = hexkey("victim"), make_chunk(3)
    await write_chunk(tier, key, chunk_view(chunk))
    await _corrupt(kind, disk, codec, key)
    assert disk.path_for(key).exists()

    out = bytearray(LAYOUT.chunk_nbytes)
    assert await read_chunk(tier, key, memoryview(out)) is False
    assert tier.stats.corrupt == 1
    assert tier.stats.hits == 0
    assert tier.stats.errors == 0
    assert not disk.path_for(key).exists(), "a corrupt chunk must be removed"
    assert not await disk.exists(key)

    # the next read is a plain miss, and a rewrite makes the key usable again
    assert await read_chunk(tier, key, memoryview(out)) is False
    assert tier.stats.misses == 1
    assert tier.stats.corrupt == 1
    await write_chunk(tier, key, chunk_view(chunk))
    assert await read_chunk(tier, key, memoryview(out)) is True
    assert bytes(out) == chunk_view(chunk).tobytes()


@pytest.mark.parametrize("codec", ["identity", "bytesplit"])
@pytest.mark.parametrize("kind", FOREIGN_LAYOUTS)
async def test_a_chunk_written_for_another_layout_is_a_foreign_miss_left_for_its_owner(
    disk: DiskBackend, codec: str, kind: str
):
    """A sound chunk of another model sharing the directory is not damage: counted foreign, kept, its bytes intact."""
    tier = make_tier(disk, codec)
    key = hexkey("victim")
    await write_chunk(tier, key, chunk_view(make_chunk(3)))
    await _corrupt(kind, disk, codec, key)
    owned = disk.path_for(key).read_bytes()

    out = bytearray(LAYOUT.chunk_nbytes)
    assert await read_chunk(tier, key, memoryview(out)) is False
    readers = await tier.open_layers_many([key])  # a layer stream opening it: the same verdict
    assert readers == [None]
    assert tier.stats.foreign == 2
    assert tier.stats.corrupt == 0 and tier.stats.hits == 0 and tier.stats.errors == 0
    assert disk.path_for(key).read_bytes() == owned, "another layout's chunk is left for its owner"


@pytest.mark.parametrize("writer", ["int4", "int8+zstd", "hadamard+int4", "fp8"])
@pytest.mark.parametrize("reader", ["identity", "bytesplit"])
async def test_a_lossy_chunk_decodes_with_the_codec_its_header_names_whatever_the_reader_is_configured_with(
    disk: DiskBackend, writer: str, reader: str
):
    """The container records the codec chain: a reader configured with another codec gives the
    writer codec's numbers, never the stored bytes read as if they were its own."""
    chunk = make_chunk(5)
    key = hexkey(f"lossy-{writer}")
    await write_chunk(make_tier(disk, writer), key, chunk_view(chunk))
    codec, spec = make_codec(writer), SegmentSpec(LAYOUT.dtype, LAYOUT.layer_shape)
    expected = torch.empty_like(chunk)
    for layer in range(LAYOUT.num_layers):  # what the writer's codec gives back, layer by layer
        encoded = codec.encode(tensor_bytes(chunk[layer].contiguous()), spec)
        codec.decode_into(encoded, spec, tensor_bytes(expected[layer]))
    tier = make_tier(disk, reader)
    out = torch.empty_like(chunk)
    assert await read_chunk(tier, key, tensor_bytes(out))
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(out.view(torch.int16), chunk.view(torch.int16)), "lossy: bit-exact means not applied"
    assert tier.stats.hits == 1 and tier.stats.corrupt == 0 and tier.stats.foreign == 0


class _PluginXor(BytesBytesCodec):
    """A plugin's compressor that the reading process does not have."""

    name = "test-xor"

    def encode(self, data: memoryview, spec: SegmentSpec) -> bytes:
        return (np.frombuffer(data, dtype=np.uint8) ^ 0xFF).tobytes()

    def decode(self, data: memoryview, spec: SegmentSpec) -> bytes:
        return self.encode(data, spec)


async def test_a_chunk_written_with_a_codec_this_process_lacks_is_a_foreign_miss_left_in_place(
    disk: DiskBackend, monkeypatch: pytest.MonkeyPatch
):
    with_plugin = CodecRegistry()
    with_plugin.register(_PluginXor)
    monkeypatch.setattr(codec_registry, "default_registry", with_plugin)
    key = hexkey("plugin")
    await write_chunk(make_tier(disk, "int4+test-xor"), key, chunk_view(make_chunk(6)))
    monkeypatch.setattr(codec_registry, "default_registry", CodecRegistry())  # a process without the plugin
    container._codec_named.cache_clear()
    stored = disk.path_for(key).read_bytes()
    tier = make_tier(disk, "int4")
    out = bytearray(LAYOUT.chunk_nbytes)
    assert await read_chunk(tier, key, memoryview(out)) is False
    assert tier.stats.foreign == 1 and tier.stats.corrupt == 0 and tier.stats.hits == 0
    assert disk.path_for(key).read_bytes() == stored, "a chunk another process can decode is left for it"
    container._codec_named.cache_clear()


@pytest.mark.parametrize("codec", CODECS)
async def test_a_missing_chunk_is_a_miss(disk: DiskBackend, codec: str):
    tier = make_tier(disk, codec)
    out = bytearray(LAYOUT.chunk_nbytes)
    assert await read_chunk(tier, hexkey("absent"), memoryview(out)) is False
    assert tier.stats.misses == 1
    assert tier.stats.hits == 0 and tier.stats.corrupt == 0 and tier.stats.errors == 0
    assert not disk.holds(hexkey("absent"))


@pytest.mark.parametrize("codec", CODECS)
async def test_an_io_error_is_a_counted_miss_not_an_exception(disk: DiskBackend, codec: str):
    tier = make_tier(disk, codec)
    key = hexkey("dir")
    disk.path_for(key).mkdir(parents=True)  # reading a directory fails with EISDIR
    assert await read_chunk(tier, key, memoryview(bytearray(LAYOUT.chunk_nbytes))) is False
    assert tier.stats.errors == 1
    assert tier.stats.hits == 0 and tier.stats.corrupt == 0


async def test_a_failed_write_is_counted_and_raised(tmp_path: Path):
    backend = await open_backend(tmp_path / "disk", capacity=100)  # smaller than one container
    tier = make_tier(backend, "identity")
    with pytest.raises(OSError):
        await write_chunk(tier, hexkey("a"), chunk_view(make_chunk(1)))
    assert tier.stats.errors == 1
    assert tier.stats.writes == 0
    assert not backend.holds(hexkey("a"))
    assert not backend.path_for(hexkey("a")).exists()
    assert temporaries_under(backend.root) == []


async def test_tier_prefix_count(disk: DiskBackend):
    tier = make_tier(disk, "zstd")
    keys = [hexkey(i) for i in range(4)]
    for i, key in enumerate(keys[:3]):
        await write_chunk(tier, key, chunk_view(make_chunk(i)))
    assert await tier.prefix_count(keys) == 3
    assert await tier.prefix_count([keys[3], *keys[:3]]) == 0


# == the Backend base class's defaults =========================================================


async def test_base_get_into_gets_and_prefix_count():
    backend = MemoryBackend()
    await backend.set("k1", [b"abc", b"defgh"])
    await backend.set("k2", [b"z"])
    first, second = bytearray(3), bytearray(10)
    assert await backend.get_into("k1", [memoryview(first), memoryview(second)]) == 8
    assert bytes(first) == b"abc"
    assert bytes(second[:5]) == b"defgh" and bytes(second[5:]) == bytes(5)
    assert await backend.get_into("nope", [memoryview(bytearray(1))]) is None
    assert await asyncio.gather(*(backend.get(k) for k in ["k2", "nope", "k1"])) == [b"z", None, b"abcdefgh"]
    assert await backend.prefix_count(["k1", "k2", "nope", "k1"]) == 2
    assert await backend.prefix_count([]) == 0
    assert backend.stats() == {}


@pytest.mark.parametrize("codec", CODECS)
async def test_tier_over_a_backend_without_scatter_reads(codec: str):
    backend = MemoryBackend()
    tier = make_tier(backend, codec)
    key, chunk = hexkey("mem"), make_chunk(9)
    await write_chunk(tier, key, chunk_view(chunk))
    out = bytearray(LAYOUT.chunk_nbytes)
    assert await read_chunk(tier, key, memoryview(out))
    assert bytes(out) == chunk_view(chunk).tobytes()
    backend.objects[key] = backend.objects[key][:-1]
    assert not await read_chunk(tier, key, memoryview(out))
    assert tier.stats.corrupt == 1
    assert key not in backend.objects

"""Local disk (NVMe) tier: one file per chunk, atomic, private, bounded, and restart-proof.

- Files live at ``root/<namespace>/ab/cd/<key>.kvc`` (:mod:`kvstore.backends.disk_paths`): the
  namespace directory lets ``kvstore gc`` and ``ls`` work per model, and two levels of 256
  directories keep listings small.
- The byte budget covers this store's namespace only: another model's files in the same
  directory are its own store's to keep or evict (or ``kvstore gc``'s), never this one's. They
  are counted at start and named in the log, left alone.
- A write goes to a private temporary name, then ``os.replace`` puts it in place: a reader,
  in this process or another one sharing the directory, sees a whole file or none.
- Files are created 0600 and directories 0700: KV caches reveal prompts.
- A byte budget is kept with an index that evicts by the ``disk.eviction`` policy
  (:mod:`kvstore.eviction`; LRU by default), rebuilt by scanning at start, ordered by mtime;
  a hit refreshes the file's mtime so the order survives restarts. A write reserves its bytes
  before it writes (evicting the policy's victims first), so concurrent writers never
  take the directory past the budget; a write that meets a full file system (ENOSPC) evicts
  its size in old files and tries once more.
- Another process's files are found on the file system even when this index lacks them;
  files it deletes become misses here. The filesystem is the truth, the index a cache of it.

The tier in modules: here, :class:`DiskBackend` (its reads, writes, batch hooks and the scan at
start that rebuilds the index); the byte budget and its index (:mod:`kvstore.backends.disk_budget`);
file naming (:mod:`kvstore.backends.disk_paths`); plain file I/O (:mod:`kvstore.backends.files`);
temporary names (:mod:`kvstore.backends.temporaries`); and the operator's side, listing every
namespace and removing what is unchanged (:mod:`kvstore.backends.disk_maintenance`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import TypeVar

from kvstore.backends.base import (
    CHUNK_HEAD_BYTES,
    Backend,
    ByteRange,
    ObjectFile,
    ObjectRead,
    ObjectWrite,
    Outcomes,
    byte_length,
    each_caught,
)
from kvstore.backends.disk_budget import FileBudget
from kvstore.backends.disk_maintenance import DiskMaintenance
from kvstore.backends.disk_paths import chunk_key_of, relative_path
from kvstore.backends.files import (
    FileReader,
    make_private_dirs,
    read_head,
    unlink_quietly,
    walk_files,
    write_fully,
    write_stream,
)
from kvstore.backends.temporaries import temporary_name, temporary_state
from kvstore.errors import ConfigError
from kvstore.eviction import DEFAULT_EVICTION, EvictionName
from kvstore.keys import DEFAULT_NAMESPACE, is_namespace_dir
from kvstore.util.buffers import Buffer, as_bytes_view
from kvstore.util.threads import in_thread, in_thread_or_discard

log = logging.getLogger("kvstore.disk")
T = TypeVar("T")

MTIME_REFRESH_SECONDS = 10.0


class DiskBackend(DiskMaintenance, Backend):
    """Chunk files under one root directory (see the module docstring).

    Its batch hooks run a whole batch in one thread call: a chunk's encode, checksums and one
    gather write, or its read and check, 1 MiB at a time so each piece is checked while still
    in cache (the callers' work, handed in as callables). The blocking methods (``read``,
    ``read_into``, ``open_reader``, ``write``, ``contains``, ``keep``) are for worker threads.
    """

    name = "disk"
    is_local = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: bool = False,
        executor: Executor | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        eviction: EvictionName | str = DEFAULT_EVICTION,
    ):
        if not is_namespace_dir(namespace):
            raise ValueError(f"{namespace!r} is not a namespace directory name (see kvstore.keys.namespace_dir)")
        self.root = Path(root).expanduser()
        self.namespace = namespace
        self._root_text = str(self.root)
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self._executor = executor
        self._budget = FileBudget(self._root_text, self.capacity_bytes, eviction)  # this namespace's files
        self._budget.on_evicted = self._evicted

    def _evicted(self, relative: str) -> None:
        """Tell ``on_evicted`` of a file the budget evicts, with its head where asked (before its removal)."""
        key = chunk_key_of(relative.rpartition("/")[2])
        if key is None:
            return
        head = read_head(f"{self._root_text}/{relative}", CHUNK_HEAD_BYTES) if self.evicted_heads else None
        self.on_evicted([key], [head])

    # -- paths -------------------------------------------------------------------------------

    def path_for(self, key: str) -> Path:
        """Where ``key``'s file is (or would be), for tools and tests that reach under the backend."""
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        """The file name as a string: pathlib objects cost microseconds on every read."""
        return f"{self._root_text}/{self._relative(key)}"

    def _relative(self, key: str, namespace: str | None = None) -> str:
        """The file's path below the root: its name in the eviction index."""
        return relative_path(key, namespace or self.namespace)

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        await in_thread(self._executor, self._scan)

    def _check_root(self) -> None:
        """Create the root (0700) if missing, and check that files can be made in it: else a ConfigError.

        A file in the way, a read-only file system, ``/proc`` or ``/sys``, a directory without write
        permission: each is one line naming disk.path and the fix, not an OSError at open (or, for a
        directory that exists, a failed write per chunk later). The check's file has no name (O_TMPFILE
        where supported, else a temporary removed at once), so nothing is left behind.
        """
        try:
            make_private_dirs(self.root)
        except (FileExistsError, NotADirectoryError) as exc:
            raise ConfigError(
                f"disk.path {self.root} cannot be a directory: {exc.filename} is a file; "
                "set disk.path to a directory (kvstore creates it, 0700, if missing)"
            ) from None
        except OSError as exc:  # a read-only file system, /proc, /sys, no permission
            where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(self.root) else ""
            raise ConfigError(self._unusable(f"cannot be created: {exc.strerror or exc}{where}")) from None
        try:
            with tempfile.TemporaryFile(dir=self.root):
                pass
        except OSError as exc:
            raise ConfigError(self._unusable(f"cannot hold files: {exc.strerror or exc}")) from None

    def _unusable(self, problem: str) -> str:
        """The one-line error for a root that cannot be made or written to."""
        return (
            f"disk.path {self.root} {problem}; set disk.path to a directory on a writable local file system "
            "(kvstore creates it, 0700, if missing)"
        )

    def _scan(self) -> None:
        """Rebuild the eviction index from this namespace's files, oldest first; sweep stale temporaries.

        Other namespaces' chunk files are counted for the log and left alone: they are outside
        this store's budget (their own stores evict them; ``kvstore gc`` manages them all).
        """
        self._check_root()
        found: list[tuple[float, str, int]] = []
        others, others_bytes = 0, 0
        now = time.time()
        for namespace, path, stat in walk_files(self.root):
            name = path.name
            temporary = temporary_state(name, stat.st_mtime, now)
            if temporary is not None:
                if temporary != "fresh":  # stale, or its writer was killed
                    unlink_quietly(path)
                continue
            key = chunk_key_of(name)
            if key is None:
                continue
            if namespace != self.namespace:
                others, others_bytes = others + 1, others_bytes + stat.st_size
                continue
            found.append((stat.st_mtime, self._relative(key, namespace), stat.st_size))
        found.sort()
        self._budget.load((relative, size) for _, relative, size in found)
        log.info(
            "disk tier %s, namespace %s: %d chunk files, %.1f MiB, budget %.1f MiB",
            self.root,
            self.namespace,
            len(found),
            self._budget.used / 2**20,
            self.capacity_bytes / 2**20,
        )
        if others:
            log.info(
                "disk tier %s: %d chunk files (%.1f MiB) of other namespaces, outside this store's budget: left alone",
                self.root,
                others,
                others_bytes / 2**20,
            )
        evictions = self._budget.evictions
        freed = self._budget.evict_to_capacity(kept=None)
        if freed:
            log.info(
                "disk tier %s: removed the %d oldest files of namespace %s (%.1f MiB) to meet disk.capacity",
                self.root,
                self._budget.evictions - evictions,
                self.namespace,
                freed / 2**20,
            )

    # -- reads -------------------------------------------------------------------------------

    async def fetch(self, key: str, byte_range: ByteRange | None) -> bytes | None:
        return await in_thread(self._executor, self.read, key, byte_range)

    def read(self, key: str, byte_range: ByteRange | None = None) -> bytes | None:
        """The file's bytes or a range of them (clipped at its end), None if absent; a hit for eviction."""
        try:
            with open(self._file(key), "rb", buffering=0) as file:
                if byte_range is None:
                    data = file.read()
                else:
                    start, end = byte_range
                    file.seek(start)
                    data = file.read(max(0, end - start))
        except FileNotFoundError:
            self._forget(key)
            return None
        self._touch(key, len(data) if byte_range is None else None, None)
        return data

    async def get_into(self, key: str, buffers: Sequence[memoryview]) -> int | None:
        """One scatter read (``preadv``) straight into ``buffers``."""
        return await in_thread(self._executor, self.read_into, key, buffers)

    def read_into(self, key: str, buffers: Sequence[memoryview]) -> int | None:
        """Scatter-read the file's leading bytes straight into ``buffers``; the file's size."""
        reader = self.open_reader(key)
        if reader is None:
            return None
        with reader:
            reader.readinto([as_bytes_view(b) for b in buffers], 0)
        return reader.size

    def open_reader(self, key: str, hit: bool = True) -> FileReader | None:
        """The file opened for positioned reads (the caller closes it), or None if absent; a hit for eviction
        (``hit=False``: told later, with its batch, by :meth:`used_in_order`)."""
        try:
            fd = os.open(self._file(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(key)
            return None
        try:
            stat = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self._touch(key, stat.st_size, stat.st_mtime, hit)
        return FileReader(fd, stat.st_size)

    async def exists(self, key: str) -> bool:
        """True at once if this process knows the file, else one stat in a thread."""
        if self._budget.holds(self._relative(key)):
            return True
        return await in_thread(self._executor, self.contains, key)

    def contains(self, key: str) -> bool:
        """Whether the file exists now (one stat), whatever this process's index believes."""
        try:
            size = os.stat(self._file(key)).st_size
        except FileNotFoundError:
            self._forget(key)
            return False
        self._remember(key, size)
        self._budget.evict_to_capacity(kept=self._relative(key))  # it may be another process's file, new to us
        return True

    def keep(self, key: str) -> bool:
        """Refresh the file's mtime if it exists: one atomic call that is both the check and the use."""
        try:
            os.utime(self._file(key))
        except FileNotFoundError:
            self._forget(key)
            return False
        self._budget.mark_used(self._relative(key))
        return True

    async def prefix_count(self, keys: Sequence[str]) -> int:
        """One thread call of stats (the files themselves, not the index, which may be stale)."""
        return await in_thread(self._executor, self._prefix_count, keys)

    def _prefix_count(self, keys: Sequence[str]) -> int:
        for count, key in enumerate(keys):
            # The index may be stale (another process evicted the file): check the file itself.
            if not self.contains(key):
                return count
        return len(keys)

    def holds(self, key: str) -> bool:
        """Whether this process has seen the file (no I/O, so a hint: another process may have removed it)."""
        return self._budget.holds(self._relative(key))

    # -- writes ------------------------------------------------------------------------------

    async def set(self, key: str, parts: Sequence[Buffer]) -> None:
        """:meth:`write` in a thread."""
        await in_thread(self._executor, self.write, key, parts)

    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        """Write the concatenation of ``parts`` atomically, within the budget.

        Its bytes are reserved first (see :meth:`_reserve`) and released if it fails. A private
        temporary file (0600) is filled, fsynced if configured, then renamed into place, so
        readers in any process see the whole file or none; on failure it is removed. A full file
        system (ENOSPC: other files, other namespaces, a budget above the free space) evicts this
        write's size in least recently used files, and the write is tried once more.
        """
        views = [as_bytes_view(part) for part in parts]
        self._store(key, sum(len(view) for view in views), lambda fd: write_fully(fd, views))

    def _store(self, key: str, size: int, fill: Callable[[int], None]) -> None:
        """:meth:`write`'s work for an object of ``size`` bytes that ``fill(fd)`` writes into an empty file."""
        if size > self.capacity_bytes:
            raise OSError(errno.EFBIG, f"a {size}-byte chunk exceeds disk.capacity ({self.capacity_bytes} bytes)")
        final, relative = self._file(key), self._relative(key)
        self._budget.reserve(size)
        try:
            try:
                self._write_file(final, fill)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                files, freed = self._budget.free_for_full_disk(size, kept=relative)  # never its own current copy
                log.warning(
                    "disk tier %s: the file system is full (ENOSPC); evicted %d files (%.1f MiB), trying once more",
                    self.root,
                    files,
                    freed / 2**20,
                )
                self._write_file(final, fill)
        except BaseException:
            self._budget.release(size)
            raise
        self._budget.commit(relative, size)

    def _write_file(self, final: str, fill: Callable[[int], None]) -> None:
        """Fill a private temporary file and rename it to ``final``; the temporary is removed on failure."""
        temporary = temporary_name(final)
        fd = self._create(temporary)
        try:
            try:
                fill(fd)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, final)
        except BaseException:
            unlink_quietly(temporary)
            raise

    def _create(self, temporary: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return os.open(temporary, flags, 0o600)
        except FileNotFoundError:  # first write in this shard, or the directory was removed under us
            make_private_dirs(Path(temporary).parent)  # each level it creates 0700
            return os.open(temporary, flags, 0o600)

    async def delete(self, key: str) -> None:
        await in_thread(self._executor, self._delete, key)

    def _delete(self, key: str) -> None:
        unlink_quietly(self._file(key))
        self._forget(key)

    # -- batch hooks: one thread call per batch -------------------------------------------------

    async def write_many(self, writes: Sequence[ObjectWrite], executor: Executor | None) -> Outcomes[int]:
        """The whole batch in one thread call, each object encoded right before its gather write."""
        return await in_thread(executor, each_caught, self._write_new, writes)

    def _write_new(self, item: ObjectWrite) -> int | None:
        """Encode and write one object; None when its file is here already (marked used instead).

        An object that comes as a stream (a chunk stored as it is) is written a run of about 1 MiB
        at a time, each run right after its checksums, so the write copies it from the CPU's cache
        rather than from memory; the header goes in last. Any other in one gather write: on ext4
        every write call updates the inode's times, so many small writes cost more than one.
        """
        if self.holds(item.key) and self.keep(item.key):
            return None
        if item.stream is not None:  # each run written while still in cache from its checksum
            make = item.stream  # called again for the retry after a full file system
            length = make().length
            self._store(item.key, length, lambda fd: write_stream(fd, make()))
            return length
        parts = item.encode()
        self.write(item.key, parts)
        return byte_length(parts)

    async def read_many(self, reads: Sequence[ObjectRead[T]], executor: Executor | None) -> Outcomes[T]:
        """The whole batch in one thread call: each file opened, handed to ``from_file``, closed.

        The hits are told to the budget's eviction policy afterwards, by the tier (:meth:`used_in_order`).
        """
        return await in_thread(executor, each_caught, partial(self._on_file, keep_open=False), reads)

    async def open_many(self, reads: Sequence[ObjectRead[T]], executor: Executor | None) -> Outcomes[T]:
        """The whole batch in one thread call: each file opened and handed, still open, to ``from_file``.

        If the caller is cancelled meanwhile, the files the thread opened are closed when it ends.
        """
        opened: list[ObjectFile] = []

        def close_opened(_: object) -> None:
            for file in opened:
                file.close()

        on_file = partial(self._on_file, keep_open=True, opened=opened)
        return await in_thread_or_discard(executor, close_opened, partial(each_caught, on_file, reads))

    def _on_file(self, read: ObjectRead[T], keep_open: bool, opened: list[ObjectFile] | None = None) -> T | None:
        """``read.from_file`` on the object's file, None if absent; the file is closed after, or on failure.

        A file kept open is noted in ``opened`` (for the caller to close if the result is never used).
        """
        file = self.open_reader(read.key, hit=False)  # the batch's hits are told in order (used_in_order)
        if file is None:
            return None
        try:
            result = read.from_file(file)
        except BaseException:
            file.close()
            raise
        if not keep_open:
            file.close()
        elif opened is not None:
            opened.append(file)
        return result

    # -- index and budget (kept by FileBudget) --------------------------------------------------

    def _remember(self, key: str, size: int) -> None:
        self._budget.remember(self._relative(key), size)

    def _forget(self, key: str) -> None:
        self._budget.forget(self._relative(key))

    def _touch(self, key: str, size: int | None, mtime: float | None, hit: bool = True) -> None:
        """Mark a hit: most recent in the index (unless ``hit`` is False: see :meth:`used_in_order`) and, for
        the next start, in the file's mtime.

        The mtime is refreshed at most every MTIME_REFRESH_SECONDS: each refresh dirties the
        inode, and a hot chunk would otherwise cost a journal write per read.
        """
        relative = self._relative(key)
        if self._budget.mark_used(relative, size, hit):  # another process's file, new to our budget
            self._budget.evict_to_capacity(kept=relative)
        if mtime is not None and time.time() - mtime < MTIME_REFRESH_SECONDS:
            return
        try:
            os.utime(f"{self._root_text}/{relative}")
        except OSError:
            pass

    def used_in_order(self, keys: Sequence[str]) -> None:
        """A batch read's hits, a prefix's chunks in order: the budget's policy hears of them tail first.

        At once if the budget's lock is free, else in an I/O thread (a writer holds it across an eviction's
        unlink): the caller, on the event loop, never waits for it.
        """
        relatives = [self._relative(key) for key in keys]
        if relatives and not self._budget.mark_used_in_order(relatives, blocking=False):
            with contextlib.suppress(RuntimeError):  # the executor is shutting down: the order is best effort
                asyncio.get_running_loop().run_in_executor(self._executor, self._budget.mark_used_in_order, relatives)

    def stats(self) -> dict[str, int | float | str]:
        return self._budget.stats()

    @property
    def evictions(self) -> int:
        return self._budget.evictions

"""The disk tier's operator side: listing every namespace's chunk files, and removing only what is unchanged.

What ``kvstore ls``, ``stats``, ``gc`` and ``verify`` ask of a disk tier (the interface is
:class:`~kvstore.backends.maintenance.Maintenance`); the data path is :mod:`kvstore.backends.disk`.
Contract:

- Listing walks every namespace directory of the root (files named as in
  :mod:`kvstore.backends.disk_paths`; temporaries and foreign files are skipped). An object's
  age is its file's mtime, which the data path refreshes on a hit; its version is the file's
  inode and mtime together.
- A removal renames each file aside first, atomically, then checks it: exact even against a
  writer racing to replace it. Failures are reported per file, never raised.
- Blocking file work runs in the host's executor (``_executor``), one thread call per page.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path

from kvstore.backends.disk_paths import chunk_key_of, relative_path
from kvstore.backends.files import read_head, walk_files
from kvstore.backends.maintenance import LIST_PAGE, Maintenance, RemoveReport, StoredObject, pages
from kvstore.backends.temporaries import TMP_MARK, temporary_name
from kvstore.util.threads import in_thread


class DiskMaintenance(Maintenance):
    """Listing and removal over every namespace under ``root`` (see the module docstring).

    A mixin: its host (:class:`~kvstore.backends.disk.DiskBackend`) sets ``root``, its text
    ``_root_text``, and ``_executor``.
    """

    age_basis = "last access"  # a hit refreshes the file's mtime (at most every MTIME_REFRESH_SECONDS)

    root: Path
    _root_text: str
    _executor: Executor | None

    def _path_of(self, item: StoredObject) -> str:
        """The listed object's file."""
        return f"{self._root_text}/{relative_path(item.key, item.namespace)}"

    async def scan(self, namespaces: Callable[[str], bool] | None = None) -> AsyncIterator[list[StoredObject]]:
        found = await in_thread(self._executor, walk_files, self.root, namespaces)
        page: list[StoredObject] = []
        for namespace, path, stat in found:
            key = None if TMP_MARK in path.name else chunk_key_of(path.name)
            if key is None:
                continue
            version = (stat.st_ino, stat.st_mtime_ns)
            page.append(StoredObject(namespace, key, stat.st_size, stat.st_mtime, version))
            if len(page) == LIST_PAGE:
                yield page
                page = []
        if page:
            yield page

    async def read_object(self, item: StoredObject) -> bytes | None:
        def read() -> bytes | None:
            try:
                with open(self._path_of(item), "rb", buffering=0) as file:
                    return file.read()
            except FileNotFoundError:
                return None

        return await in_thread(self._executor, read)

    async def read_head(self, item: StoredObject, size: int) -> bytes | None:
        def read() -> bytes | None:
            try:
                with open(self._path_of(item), "rb", buffering=0) as file:
                    return file.read(size)
            except FileNotFoundError:
                return None

        return await in_thread(self._executor, read)

    async def remove_unchanged_batches(
        self, items: Sequence[StoredObject], head_bytes: int = 0
    ) -> AsyncIterator[RemoveReport]:
        for batch in pages(items):
            yield await in_thread(self._executor, self._remove_batch, batch, head_bytes)

    def _remove_batch(self, items: Sequence[StoredObject], head_bytes: int = 0) -> RemoveReport:
        """Each file is first renamed aside, atomically, then checked: exact even against a racing writer.

        A check before a plain unlink would leave a window in which a fresh file could be renamed
        into place and then deleted. A file that turns out changed is linked back, unless an even
        newer one has arrived meanwhile (a key's bytes never change, so either will do). The head
        (``head_bytes``) is read from the file set aside, so it is the one deleted.
        """
        report = RemoveReport()
        for item in items:
            path = self._path_of(item)
            aside = temporary_name(path, "gc-")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                report.gone += 1
                continue
            except OSError as exc:
                report.errors.append(f"{path}: {exc.strerror}")
                continue
            try:
                stat = os.stat(aside)
                if (stat.st_ino, stat.st_mtime_ns) == item.version:
                    head = read_head(aside, head_bytes) if head_bytes else None
                    os.unlink(aside)
                    report.count_removed(item, stat.st_size, head)
                    continue
                report.changed += 1
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass
                os.unlink(aside)
            except OSError as exc:
                report.errors.append(f"{path}: {exc.strerror}")
        return report

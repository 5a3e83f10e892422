"""Plain file I/O for the disk backend: vectored reads and writes that finish what they start, an
object written a run at a time, an open file for positioned reads, and the walk over the
``namespace/ab/cd/file`` shard layout.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.backends.base import StreamedObject
from kvstore.keys import is_namespace_dir
from kvstore.util.buffers import as_bytes_view

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class FileReader:
    """Positioned reads of one open chunk file (an :class:`~kvstore.backends.base.ObjectFile`)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def readinto(self, buffers: Sequence[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from ``offset``, stopping at the end of the file; bytes read."""
        return read_fully(self.fd, list(buffers), offset, self.size)

    def close(self) -> None:
        """Close the file (once)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def walk_files(root: Path, namespaces: Callable[[str], bool] | None = None) -> list[tuple[str, Path, os.stat_result]]:
    """Every file in the shard layout (``ns/ab/cd/file``) with its namespace and stat.

    ``namespaces`` picks the namespace directories to enter (default: all).
    """
    found: list[tuple[str, Path, os.stat_result]] = []
    for space in _scandir_quietly(root):
        if not space.is_dir(follow_symlinks=False) or not is_namespace_dir(space.name):
            continue
        if namespaces is not None and not namespaces(space.name):
            continue
        for top in _scandir_quietly(Path(space.path)):
            if not top.is_dir(follow_symlinks=False):
                continue
            for middle in _scandir_quietly(Path(top.path)):
                if not middle.is_dir(follow_symlinks=False):
                    continue
                for entry in _scandir_quietly(Path(middle.path)):
                    try:
                        if entry.is_file(follow_symlinks=False):
                            found.append((space.name, Path(entry.path), entry.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue  # removed by another process while we looked
    return found


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each 0700 (KV caches reveal prompts).

    Only the directories created here get that mode; existing ones are left as they are.
    (``Path.mkdir(parents=True)`` would give the parents the default mode, 0755 under the usual
    umask.) A file in the way raises FileExistsError or NotADirectoryError.
    """
    missing = []
    for directory in (path, *path.parents):
        if directory.is_dir():
            break
        missing.append(directory)
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)


def _scandir_quietly(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_head(path: str | Path, size: int) -> bytes | None:
    """The file's first ``size`` bytes; None if it cannot be read."""
    try:
        with open(path, "rb", buffering=0) as file:
            return file.read(size)
    except OSError:
        return None


def unlink_quietly(path: str | Path) -> None:
    """Remove the file if it is there (another process may have removed it first)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _advance(pending: list[memoryview], done: int) -> None:
    """Drop ``done`` bytes from the front of a list of buffers (after a short readv/writev)."""
    while done and pending:
        if done >= len(pending[0]):
            done -= len(pending.pop(0))
        else:
            pending[0] = pending[0][done:]
            done = 0


def write_fully(fd: int, views: list[memoryview]) -> None:
    """Write every byte of ``views``, in order, with as few ``writev`` calls as the kernel allows."""
    pending = [v for v in views if len(v)]
    while pending:
        _advance(pending, os.writev(fd, pending[:_IOV_MAX]))


def pwrite_fully(fd: int, data: memoryview, offset: int) -> None:
    """Write every byte of ``data`` at ``offset``, leaving the file position where it was."""
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def write_stream(fd: int, stream: StreamedObject) -> None:
    """Write ``stream`` into the empty file ``fd``: its body's runs in order, each as soon as it is made, after
    room for its head; then its head at the start."""
    os.lseek(fd, stream.head_length, os.SEEK_SET)
    for run in stream.body:
        write_fully(fd, [as_bytes_view(part) for part in run])
    pwrite_fully(fd, as_bytes_view(stream.head()), 0)


def read_fully(fd: int, views: list[memoryview], offset: int, size: int) -> int:
    """Fill ``views`` in order from ``offset``, stopping at ``size`` (the file's end); bytes read."""
    pending, wanted = [], 0
    for view in views:
        take = min(len(view), size - offset - wanted)
        if take <= 0:
            break
        pending.append(view[:take])
        wanted += take
    position = offset
    while pending:
        got = os.preadv(fd, pending[:_IOV_MAX], position)
        if got == 0:
            raise OSError(errno.EIO, "file shrank while being read")
        position += got
        _advance(pending, got)
    return wanted

"""Secondary-tier backends: the interface (:mod:`~kvstore.backends.base`, :mod:`~kvstore.backends.maintenance`),
the local disk, Redis and S3, the registry of backends by name (:mod:`~kvstore.backends.registry`: built-in,
registered in code, or from other packages through the ``kvstore.backends`` entry-point group), and
:func:`make_backend`, which builds one from its config section.

The Redis and S3 modules are imported only when a backend of theirs is made, so a process that
uses neither never loads their client libraries.
"""

from __future__ import annotations

from concurrent.futures import Executor

from kvstore.backends.base import Backend, ByteRange, ObjectFile, ObjectRead, ObjectWrite
from kvstore.backends.builtin import BUILTIN_SPECS
from kvstore.backends.maintenance import LIST_PAGE, Maintenance, Progress, RemoveReport, StoredObject
from kvstore.backends.registry import BackendSpec, lookup_backend, register_backend, spec_for_section
from kvstore.config import TimeoutConfig
from kvstore.keys import DEFAULT_NAMESPACE

for _builtin in BUILTIN_SPECS:
    register_backend(_builtin)


def make_backend(
    section: object,
    timeouts: TimeoutConfig,
    namespace: str = DEFAULT_NAMESPACE,
    *,
    executor: Executor | None = None,
) -> Backend:
    """The backend a config section describes, not opened yet, storing under ``namespace`` (a directory name).

    ``section`` is a registered backend's section (``config.disk``, ``config.backend_section("gcs")``);
    its spec's ``make`` builds the backend. ``timeouts`` bounds the remote backends' own requests
    (S3's read timeout, Redis' socket timeout); ``executor`` runs the disk backend's blocking calls
    (default: the loop's). Whether the section is enabled is the caller's business.
    """
    return spec_for_section(section).make(section, timeouts, namespace, executor)


__all__ = [
    "LIST_PAGE",
    "Backend",
    "BackendSpec",
    "ByteRange",
    "Maintenance",
    "ObjectFile",
    "ObjectRead",
    "ObjectWrite",
    "Progress",
    "RemoveReport",
    "StoredObject",
    "lookup_backend",
    "make_backend",
    "register_backend",
]

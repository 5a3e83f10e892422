"""The S3 tier's operator side: listing every namespace's chunks, removal of what is unchanged, expiration rules.

What ``kvstore ls``, ``stats``, ``gc`` and ``verify`` ask of an S3 tier (the interface is
:class:`~kvstore.backends.maintenance.Maintenance`), over the tier's connection
(:class:`~kvstore.backends.s3_connection.S3Connection`); the data path is :mod:`kvstore.backends.s3`.
Contract:

- Listing is ListObjectsV2, a thousand objects a page; namespaces are the common prefixes under
  the tier's prefix. An object's age is its LastModified (its last write: reading leaves it alone),
  its version the ETag and LastModified together.
- A removal lists each namespace again and deletes (DeleteObjects, at most 1000 keys a request)
  only what is still as first listed; per-key failures are reported as errors, never raised.
- :meth:`S3Maintenance.install_expiration` adds a bucket lifecycle rule (kept beside the bucket's
  other rules) that expires the tier's objects some days after their last write.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from kvstore.backends.maintenance import Maintenance, RemoveReport, StoredObject
from kvstore.backends.s3_connection import CHUNK_KEY, MISSING_CODES, S3Connection, error_code
from kvstore.keys import is_namespace_dir


class S3Maintenance(S3Connection, Maintenance):
    """Listing, removal and expiration over every namespace under the prefix (see the module docstring)."""

    async def _list_pages(self, prefix: str, delimiter: str | None = None) -> AsyncIterator[list[dict[str, Any]]]:
        """ListObjectsV2 page by page (1000 entries each); with a delimiter, the common prefixes instead."""
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            params["Delimiter"] = delimiter
        while True:
            page = await self._call("list_objects_v2", **params)
            yield page.get("CommonPrefixes", []) if delimiter else page.get("Contents", [])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            params["ContinuationToken"] = token

    async def _namespaces(self, accept: Callable[[str], bool] | None) -> list[str]:
        found = []
        async for page in self._list_pages(self._base, delimiter="/"):
            for entry in page:
                name = entry["Prefix"][len(self._base) :].rstrip("/")
                if is_namespace_dir(name) and (accept is None or accept(name)):
                    found.append(name)
        return found

    async def scan(self, namespaces: Callable[[str], bool] | None = None) -> AsyncIterator[list[StoredObject]]:
        for namespace in await self._namespaces(namespaces):
            async for page in self._scan_namespace(namespace):
                yield page

    async def _scan_namespace(self, namespace: str) -> AsyncIterator[list[StoredObject]]:
        start = len(self._base) + len(namespace) + 1
        async for entries in self._list_pages(f"{self._base}{namespace}/"):
            page = []
            for entry in entries:
                key = entry["Key"][start:]
                if CHUNK_KEY.fullmatch(key):
                    modified = entry["LastModified"]
                    version = (entry.get("ETag", ""), modified.timestamp())
                    page.append(StoredObject(namespace, key, int(entry["Size"]), modified.timestamp(), version))
            yield page

    async def read_object(self, item: StoredObject) -> bytes | None:
        try:
            response = await self._call(
                "get_object", Bucket=self.bucket, Key=f"{self._base}{item.namespace}/{item.key}"
            )
        except ClientError as exc:
            if error_code(exc) in MISSING_CODES:
                return None
            raise
        async with response["Body"] as body:
            data: bytes = await body.read()
        self.bytes_downloaded += len(data)
        return data

    async def read_head(self, item: StoredObject, size: int) -> bytes | None:
        """A ranged GetObject (S3 clips the range at the object's end); reading leaves LastModified alone."""
        params = {
            "Bucket": self.bucket,
            "Key": f"{self._base}{item.namespace}/{item.key}",
            "Range": f"bytes=0-{size - 1}",
        }
        try:
            response = await self._call("get_object", **params)
        except ClientError as exc:
            if error_code(exc) in MISSING_CODES:
                return None
            if error_code(exc) == "InvalidRange":  # an empty object
                return b""
            raise
        async with response["Body"] as body:
            data: bytes = await body.read()
        self.bytes_downloaded += len(data)
        return data

    async def remove_unchanged_batches(
        self, items: Sequence[StoredObject], head_bytes: int = 0
    ) -> AsyncIterator[RemoveReport]:
        """List each namespace again, then DeleteObjects (1000 a request) what is still as first listed.

        S3 has no delete conditional on the modification time for general-purpose buckets (an
        ETag condition would not do: a rewritten chunk has the same bytes, so the same ETag), so
        the check is a fresh listing, page by page, each page's deletes sent right after it: a
        write is missed only if it lands in the milliseconds between a page and its delete.
        A batch is a listing page; the objects no listing shows any more come last, as gone.
        The heads (``head_bytes``, gc with KV events on) are ranged reads, 16 in flight, between a
        page and its delete: that window then grows to the reads' time (about a second for a page
        of 1000 objects); a chunk rewritten within it is deleted, and is a miss, never wrong KV.
        """
        wanted: dict[str, dict[str, StoredObject]] = {}
        for item in items:
            wanted.setdefault(item.namespace, {})[item.key] = item
        for namespace, victims in wanted.items():
            async for page in self._scan_namespace(namespace):
                report, doomed = RemoveReport(), []
                for now in page:
                    listed = victims.pop(now.key, None)
                    if listed is None:
                        continue
                    if now.version == listed.version:
                        doomed.append(listed)
                    else:
                        report.changed += 1
                if doomed:
                    heads = await self._read_heads(doomed, head_bytes) if head_bytes else [None] * len(doomed)
                    report.add(await self._delete_batch(doomed, heads))
                if report.handled:
                    yield report
                if not victims:
                    break
            if victims:  # not listed again: gone already
                yield RemoveReport(gone=len(victims))

    async def _read_heads(self, items: list[StoredObject], size: int) -> list[bytes | None]:
        """Each object's first ``size`` bytes, 16 reads in flight; None for one that cannot be read."""
        slots = asyncio.Semaphore(16)

        async def one(item: StoredObject) -> bytes | None:
            async with slots:
                try:
                    return await self.read_head(item, size)
                except Exception:  # a timeout too: the object is named by its key instead
                    return None

        return list(await asyncio.gather(*(one(item) for item in items)))

    async def _delete_batch(self, doomed: list[StoredObject], heads: list[bytes | None]) -> RemoveReport:
        """One DeleteObjects (at most 1000 keys, one listing page); per-key failures are reported."""
        report = RemoveReport()
        names = {
            f"{self._base}{item.namespace}/{item.key}": (item, head) for item, head in zip(doomed, heads, strict=True)
        }
        try:
            response = await self._call(
                "delete_objects",
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": name} for name in names], "Quiet": True},
            )
        except (ClientError, BotoCoreError, OSError) as exc:
            report.errors.extend(f"{name}: {type(exc).__name__}: {exc}" for name in names)
            return report
        failed = {error["Key"]: error for error in response.get("Errors", [])}
        for name, (item, head) in names.items():
            if name in failed:
                report.errors.append(f"{name}: {failed[name].get('Code')}: {failed[name].get('Message')}")
            else:
                report.count_removed(item, item.size, head)
        return report

    async def install_expiration(self, days: int, namespace: str | None = None) -> dict[str, Any]:
        """Add (or replace) a lifecycle rule expiring kvstore's objects ``days`` after their last write.

        Other rules on the bucket are kept. The rule's ID names the prefix, so installing again
        updates it rather than adding a second one. Returns the rule.
        """
        if days < 1:
            raise ValueError("S3 lifecycle expiration counts whole days: use a max age of at least 1 day")
        prefix = self._base if namespace is None else f"{self._base}{namespace}/"
        rule = {
            "ID": f"kvstore-expire:{prefix or '(bucket)'}",
            "Filter": {"Prefix": prefix},
            "Status": "Enabled",
            "Expiration": {"Days": days},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
        }
        try:
            current = await self._call("get_bucket_lifecycle_configuration", Bucket=self.bucket)
            rules = [r for r in current.get("Rules", []) if r.get("ID") != rule["ID"]]
        except ClientError as exc:
            if error_code(exc) != "NoSuchLifecycleConfiguration":
                raise
            rules = []
        await self._call(
            "put_bucket_lifecycle_configuration", Bucket=self.bucket, LifecycleConfiguration={"Rules": [*rules, rule]}
        )
        return rule

"""S3 multipart upload of one object: its parts sent concurrently, the upload aborted if any fails.

The S3 tier's data path (:mod:`kvstore.backends.s3`) writes objects of ``multipart_threshold``
bytes or more this way. Contract of :func:`upload_in_parts`: the object is published whole or
not at all (S3 publishes it only at CompleteMultipartUpload, so readers never see part of one);
parts are ``part_size`` bytes (more if the object would need over MAX_PARTS, S3's limit), each
built only once it holds the connection's request slot, so memory stays bounded; on any failure
or cancellation the other parts are cancelled and the upload aborted (best effort: a bucket
lifecycle rule sweeps what is left), then the error is raised. The upload is counted in the
connection's ``multipart_uploads``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvstore.backends.s3_connection import S3Connection

log = logging.getLogger("kvstore.s3")

MAX_PARTS = 10_000  # S3's most parts per upload


async def upload_in_parts(
    connection: S3Connection, name: str, views: list[memoryview], size: int, part_size: int
) -> None:
    """Parts go up concurrently (each built only once it holds the semaphore); abort on failure."""
    step = max(part_size, -(-size // MAX_PARTS))
    upload = await connection._call("create_multipart_upload", Bucket=connection.bucket, Key=name)
    upload_id = upload["UploadId"]
    connection.multipart_uploads += 1

    async def send(number: int, start: int) -> dict[str, Any]:
        async with connection._limit:
            body = b"".join(slices(views, start, min(start + step, size)))
            response = await connection._send(
                "upload_part", Bucket=connection.bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=body
            )
        return {"PartNumber": number, "ETag": response["ETag"]}

    tasks = [asyncio.ensure_future(send(i + 1, start)) for i, start in enumerate(range(0, size, step))]
    try:
        done = await asyncio.gather(*tasks)
        await connection._call(
            "complete_multipart_upload",
            Bucket=connection.bucket,
            Key=name,
            UploadId=upload_id,
            MultipartUpload={"Parts": list(done)},
        )
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.shield(_abort(connection, name, upload_id))
        raise


async def _abort(connection: S3Connection, name: str, upload_id: str) -> None:
    try:
        await connection._call("abort_multipart_upload", Bucket=connection.bucket, Key=name, UploadId=upload_id)
    except Exception as exc:  # best effort: a bucket lifecycle rule should sweep what is left
        log.warning("s3 tier: could not abort the multipart upload of %s: %r", name, exc)


def slices(views: list[memoryview], start: int, end: int) -> list[memoryview]:
    """The pieces of the concatenation of ``views`` between ``start`` and ``end``, without copying."""
    pieces, offset = [], 0
    for view in views:
        low, high = max(start - offset, 0), min(end - offset, len(view))
        if low < high:
            pieces.append(view[low:high])
        offset += len(view)
        if offset >= end:
            break
    return pieces

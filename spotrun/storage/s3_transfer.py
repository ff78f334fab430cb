"""S3's parallel multipart uploads that stream from a byte source.

Parts run on a thread pool (:func:`spotrun.storage.transfer.run_parts`), each retried on its
own under one shared deadline, with at most ``max_concurrency`` reused buffers. An upload that
fails in any way is aborted before the error propagates, so no partial object becomes visible
and none is left open to be billed (field case C07). Errors leave as botocore raised them.
Details: ``docs/design/internals.md`` (Storage).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import ClientError

from spotrun.storage.base import ByteSource, ChunkCallback
from spotrun.storage.retry import CallWithRetry
from spotrun.storage.s3_errors import error_code, http_status
from spotrun.storage.transfer import MemorySource, PartBuffers, fill_buffer, part_ranges, run_parts

__all__ = ["MemorySource", "part_ranges", "put_from_source", "upload_stream"]

log = logging.getLogger(__name__)


def upload_stream(
    client: Any,
    call: CallWithRetry,
    *,
    bucket: str,
    key: str,
    source: ByteSource,
    chunk_bytes: int,
    on_chunk: ChunkCallback | None,
    part_size_bytes: int,
    max_concurrency: int,
) -> None:
    """Store ``source``'s bytes under ``key`` with a parallel multipart upload.

    Args:
        client: a boto3 S3 client.
        call: runs one request with retries, ``call(fn, what)``.
        bucket, key: where the object goes (``key`` is the full S3 key).
        source: the object's bytes; read once per part, from that part's thread.
        chunk_bytes: ``on_chunk`` sees chunks of this size (the last may be shorter).
        on_chunk: ``on_chunk(offset, view)`` for every chunk, once, from the thread of the
            chunk's part, before that part is uploaded (a retried part is not re-read).
            ``view`` is a read-only view of a part buffer that is reused: valid only until
            ``on_chunk`` returns.
        part_size_bytes: bytes per part, a multiple of ``chunk_bytes`` within S3's limits
            (:func:`spotrun.storage.part_sizes.upload_part_size`).
        max_concurrency: parts read and uploaded at the same time; so also the most part
            buffers held at once.

    The completion is unconditional on purpose: a conditional ``CompleteMultipartUpload``
    (``If-None-Match: *``) is not enforced by every store (Ceph RGW overwrites), so the
    no-overwrite commit never goes through here (see ``S3Storage.put_if_absent``).

    Raises:
        botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: a request
            failed for good; the upload was aborted first.
        Whatever ``source.readinto`` or ``on_chunk`` raised; the upload was aborted first.
    """
    what = f"s3://{bucket}/{key}"
    ranges = part_ranges(source.size_bytes, part_size_bytes)
    buffers = PartBuffers(part_size_bytes)
    upload_id = call(
        lambda: client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"],
        f"create multipart upload {what}",
    )

    def upload_part(number: int, start: int, stop: int) -> dict[str, Any]:
        buffer = buffers.take(stop - start)
        try:
            fill_buffer(source, buffer, start, chunk_bytes, on_chunk)

            def attempt() -> dict[str, Any]:
                response = client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=buffer
                )
                return {"PartNumber": number, "ETag": response["ETag"]}

            return call(attempt, f"upload part {number} of {what}")
        finally:
            buffers.give(buffer)

    tasks = [
        (lambda n=number, a=start, b=stop: upload_part(n, a, b)) for number, (start, stop) in enumerate(ranges, start=1)
    ]
    try:
        with ThreadPoolExecutor(
            max_workers=max(1, min(max_concurrency, len(tasks))),
            thread_name_prefix="spotrun-s3-put",
        ) as executor:
            parts = run_parts(executor, tasks)
        call(
            lambda: client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            ),
            f"complete multipart upload {what}",
        )
    except BaseException:
        _abort(client, call, bucket=bucket, key=key, upload_id=upload_id)
        raise


def put_from_source(
    client: Any,
    call: CallWithRetry,
    *,
    bucket: str,
    key: str,
    source: ByteSource,
    chunk_bytes: int,
    on_chunk: ChunkCallback | None,
) -> None:
    """Store ``source``'s bytes under ``key`` with one ``PutObject`` (a small object): the
    source is read, chunk by chunk, into one buffer that is the request's body.

    Raises:
        botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: the request
            failed for good.
        Whatever ``source.readinto`` or ``on_chunk`` raised; nothing was sent.
    """
    buffer = bytearray(source.size_bytes)
    fill_buffer(source, buffer, 0, chunk_bytes, on_chunk)
    call(lambda: client.put_object(Bucket=bucket, Key=key, Body=buffer), f"put s3://{bucket}/{key}")


def _abort(client: Any, call: CallWithRetry, *, bucket: str, key: str, upload_id: str) -> None:
    """Abort a multipart upload; a failure here is logged, never raised over the cause."""
    what = f"abort multipart upload {upload_id} of s3://{bucket}/{key}"
    try:
        call(
            lambda: client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id),
            what,
        )
    except ClientError as exc:
        if error_code(exc) == "NoSuchUpload":  # already gone: completed or aborted
            return
        log.error(
            "%s failed (%s); the upload stays open until a lifecycle rule removes it",
            what,
            error_code(exc) or http_status(exc),
        )
    except Exception as exc:  # noqa: BLE001 - the original error must win
        log.error("%s failed (%s); the upload stays open until a lifecycle rule removes it", what, type(exc).__name__)
    else:
        log.info("aborted multipart upload of s3://%s/%s", bucket, key)

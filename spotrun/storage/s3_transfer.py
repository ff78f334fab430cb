"""Parallel transfers of large objects: multipart upload and ranged download.

Both run their parts on a :class:`~concurrent.futures.ThreadPoolExecutor` (a boto3
client is thread-safe) and retry each part on its own, under one shared deadline.

A multipart upload that fails in any way -- a part, the completion, or an exception
such as ``KeyboardInterrupt`` in the caller -- is aborted (``AbortMultipartUpload``)
before the error propagates, after the parts still in flight have finished, so no
partial object becomes visible and no upload is left open to be billed (field case
C07). A ranged download pins the object's ETag with ``IfMatch`` so that an object
replaced in the middle of the read is reported instead of being returned half old,
half new.

Errors leave this module as botocore raised them; :mod:`spotrun.storage.s3` translates.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from botocore.exceptions import ClientError, IncompleteReadError

from spotrun.errors import StorageError
from spotrun.storage.s3_errors import error_code, http_status, is_precondition_failed

log = logging.getLogger(__name__)

#: Runs one retried request: ``call(fn, what)`` -> what ``fn`` returned.
CallWithRetry = Callable[[Callable[[], Any], str], Any]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def part_ranges(size_bytes: int, part_size_bytes: int) -> list[tuple[int, int]]:
    """Split ``[0, size_bytes)`` into ``(start, stop)`` byte ranges of ``part_size_bytes``.

    The last range holds the remainder; an empty object gives no ranges.
    """
    return [
        (start, min(start + part_size_bytes, size_bytes))
        for start in range(0, size_bytes, part_size_bytes)
    ]


class _Skipped(Exception):
    """A part not started because another part had already failed."""


def _run_parts(executor: ThreadPoolExecutor, tasks: list[Callable[[], Any]]) -> list[Any]:
    """Run ``tasks`` on ``executor``; on the first failure start no more and re-raise it.

    Parts already running are waited for before the exception leaves, so that nothing
    is still writing when the caller cleans up.
    """
    failed = threading.Event()

    def guarded(task: Callable[[], Any]) -> Any:
        if failed.is_set():
            raise _Skipped
        try:
            return task()
        except BaseException:
            failed.set()
            raise

    futures: list[Future] = [executor.submit(guarded, task) for task in tasks]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        if failed.is_set():
            for future in futures:
                future.cancel()
            wait(futures)
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
            raise next(e for e in errors if not isinstance(e, _Skipped))
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        wait(futures)
        raise


def upload_multipart(
    client: Any,
    call: CallWithRetry,
    *,
    bucket: str,
    key: str,
    data: memoryview,
    part_size_bytes: int,
    max_concurrency: int,
) -> None:
    """Store ``data`` under ``key`` with a parallel multipart upload.

    Args:
        client: a boto3 S3 client.
        call: runs one request with retries, ``call(fn, what)``.
        bucket, key: where the object goes (``key`` is the full S3 key).
        data: the object's bytes; part ``i`` is ``data[i*part_size_bytes:...]``.
        part_size_bytes: bytes per part (S3 wants >= 5 MiB except the last).
        max_concurrency: parts uploaded at the same time.

    The completion is unconditional on purpose: a conditional ``CompleteMultipartUpload``
    (``If-None-Match: *``) is not enforced by every store (Ceph RGW overwrites), so the
    no-overwrite commit never goes through here (see ``S3Storage.put_if_absent``).

    Raises:
        botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: a request
            failed for good; the upload was aborted first.
    """
    what = f"s3://{bucket}/{key}"
    upload_id = call(
        lambda: client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"],
        f"create multipart upload {what}",
    )

    def upload_part(number: int, start: int, stop: int) -> dict[str, Any]:
        def attempt() -> dict[str, Any]:
            response = client.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=bytes(data[start:stop]),
            )
            return {"PartNumber": number, "ETag": response["ETag"]}

        return call(attempt, f"upload part {number} of {what}")

    ranges = part_ranges(len(data), part_size_bytes)
    tasks = [
        (lambda n=number, a=start, b=stop: upload_part(n, a, b))
        for number, (start, stop) in enumerate(ranges, start=1)
    ]
    try:
        with ThreadPoolExecutor(
            max_workers=max(1, min(max_concurrency, len(tasks))),
            thread_name_prefix="spotrun-s3-put",
        ) as executor:
            parts = _run_parts(executor, tasks)
        call(
            lambda: client.complete_multipart_upload(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            ),
            f"complete multipart upload {what}",
        )
    except BaseException:
        _abort(client, call, bucket=bucket, key=key, upload_id=upload_id)
        raise


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
        log.error("%s failed (%s); the upload stays open until a lifecycle rule removes it",
                  what, error_code(exc) or http_status(exc))
    except Exception as exc:  # noqa: BLE001 - the original error must win
        log.error("%s failed (%s); the upload stays open until a lifecycle rule removes it",
                  what, type(exc).__name__)
    else:
        log.info("aborted multipart upload of s3://%s/%s", bucket, key)


def _read_range(
    client: Any, *, bucket: str, key: str, start: int, stop: int, etag: str
) -> bytes:
    """One attempt at bytes ``[start, stop)`` of an object whose ETag must be ``etag``."""
    response = client.get_object(
        Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", IfMatch=etag
    )
    body = response["Body"].read()
    if len(body) != stop - start:
        raise IncompleteReadError(actual_bytes=len(body), expected_bytes=stop - start)
    return body


def download(
    client: Any,
    call: CallWithRetry,
    *,
    bucket: str,
    key: str,
    part_size_bytes: int,
    max_concurrency: int,
) -> bytes:
    """Return the whole object, fetching it in parallel ranges when it spans several parts.

    The first request asks for the first part; its ``Content-Range`` gives the total
    size, so an object of at most one part costs a single request.

    Raises:
        botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: a request
            failed for good.
        StorageError: the object was replaced while its parts were being read.
    """
    what = f"s3://{bucket}/{key}"

    def first_attempt() -> tuple[bytes, int, str]:
        try:
            response = client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes=0-{part_size_bytes - 1}"
            )
        except ClientError as exc:
            if error_code(exc) != "InvalidRange":
                raise
            # An empty object has no byte 0, so any range is unsatisfiable.
            response = client.get_object(Bucket=bucket, Key=key)
        body = response["Body"].read()
        match = _CONTENT_RANGE.fullmatch(response.get("ContentRange") or "")
        total = int(match.group(3)) if match else len(body)
        return body, total, response["ETag"]

    head, total_bytes, etag = call(first_attempt, f"get {what}")
    if total_bytes <= len(head):
        return head

    buffer = bytearray(total_bytes)
    buffer[: len(head)] = head
    ranges = part_ranges(total_bytes, part_size_bytes)[1:]

    def fetch(start: int, stop: int) -> None:
        buffer[start:stop] = call(
            lambda: _read_range(client, bucket=bucket, key=key, start=start, stop=stop, etag=etag),
            f"get bytes {start}-{stop - 1} of {what}",
        )

    tasks = [(lambda a=start, b=stop: fetch(a, b)) for start, stop in ranges]
    try:
        with ThreadPoolExecutor(
            max_workers=max(1, min(max_concurrency, len(tasks))),
            thread_name_prefix="spotrun-s3-get",
        ) as executor:
            _run_parts(executor, tasks)
    except ClientError as exc:
        if is_precondition_failed(exc):
            raise StorageError(
                errno.EAGAIN, f"get {what}: the object was replaced while it was being read"
            ) from exc
        raise
    return bytes(buffer)

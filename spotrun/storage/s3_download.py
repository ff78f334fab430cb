"""Ranged, parallel reads of S3 objects: into the caller's memory, or whole.

A range is fetched as ranged ``GET`` requests of at most ``part_size_bytes`` each (the
backend passes ``max_part_size_bytes`` for :func:`read_into`, whose callers size their reads:
:mod:`spotrun.storage.part_sizes`), run in parallel (at most ``max_concurrency`` at once) and
each retried on its own under one deadline. The first request is sent alone; as soon as its answer's headers arrive (its
body not read yet) the others start, pinned to its ``ETag`` with ``IfMatch``, so that an
object replaced in the middle of the read is reported instead of being returned half old,
half new.

:func:`read_into` reads each body straight into the caller's views (botocore's
``readinto``), with no whole-object buffer; :func:`download` returns the object as one
``bytes``, joined once from the parts' bodies.

Errors leave this module as botocore raised them, except the ones it names;
:mod:`spotrun.storage.s3` translates.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import ClientError, IncompleteReadError

from spotrun.errors import ObjectTooShortError, StorageError
from spotrun.storage.retry import CallWithRetry
from spotrun.storage.s3_errors import error_code, is_precondition_failed
from spotrun.storage.transfer import part_ranges, run_parts, slice_views

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
#: Largest slice handed to one ``readinto`` of a response body (bounds its temporary copy).
READ_SLICE_BYTES = 1024 * 1024

#: ``consume(index, body)``: reads range number ``index``'s whole body (a StreamingBody).
Consume = Callable[[int, Any], None]


def _object_size(response: dict[str, Any]) -> int | None:
    """The whole object's size from a ranged answer's ``Content-Range``, if it has one."""
    match = _CONTENT_RANGE.fullmatch(response.get("ContentRange") or "")
    return int(match.group(3)) if match else None


def _past_end(what: str, start: int, stop: int, size_bytes: int | None) -> StorageError:
    size = "?" if size_bytes is None else str(size_bytes)
    return ObjectTooShortError(errno.EIO, f"read of {what}: bytes {start}-{stop} are past its end ({size} bytes)")


def _open_range(client: Any, *, bucket: str, key: str, start: int, stop: int, etag: str | None) -> dict[str, Any]:
    """One ``GET`` of bytes ``[start, stop)``; the answer with its body still unread.

    Raises:
        StorageError: the object ends before ``stop`` (not retried).
        botocore.exceptions.ClientError: 412 when ``etag`` no longer matches; others.
    """
    what = f"s3://{bucket}/{key}"
    extra = {"IfMatch": etag} if etag is not None else {}
    try:
        response = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", **extra)
    except ClientError as exc:
        if error_code(exc) == "InvalidRange":
            raise _past_end(what, start, stop, None) from exc
        raise
    if int(response["ContentLength"]) != stop - start:
        response["Body"].close()
        raise _past_end(what, start, stop, _object_size(response))
    return response


def read_body_into(body: Any, views: Sequence[memoryview]) -> None:
    """Fill ``views`` in order from a response body (a botocore ``StreamingBody``).

    Raises:
        botocore.exceptions.IncompleteReadError: the body ended first (retryable).
    """
    expected = sum(len(v) for v in views)
    done = 0
    for view in views:
        position = 0
        while position < len(view):
            count = body.readinto(view[position : position + READ_SLICE_BYTES])
            if count == 0:
                raise IncompleteReadError(actual_bytes=done, expected_bytes=expected)
            position += count
            done += count


def _fetch_all(
    client: Any,
    call: CallWithRetry,
    *,
    bucket: str,
    key: str,
    ranges: list[tuple[int, int]],
    first: dict[str, Any],
    consume: Consume,
    max_concurrency: int,
) -> None:
    """Consume the already opened ``first`` answer (range 0) and fetch ranges 1..n in
    parallel, all pinned to ``first``'s ETag; a failed body read is retried with a new
    request.

    Raises:
        StorageError: the object was replaced while it was being read.
        botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: a request
            failed for good.
    """
    what = f"s3://{bucket}/{key}"
    etag = first["ETag"]

    def fetch(index: int, start: int, stop: int, opened: dict[str, Any] | None) -> None:
        pending = [opened] if opened is not None else []

        def attempt() -> None:
            response = (
                pending.pop()
                if pending
                else _open_range(client, bucket=bucket, key=key, start=start, stop=stop, etag=etag)
            )
            try:
                consume(index, response["Body"])
            except BaseException:
                response["Body"].close()  # never hand a half-read connection back
                raise

        call(attempt, f"get bytes {start}-{stop - 1} of {what}")

    tasks = [
        (lambda i=index, a=start, b=stop: fetch(i, a, b, first if i == 0 else None))
        for index, (start, stop) in enumerate(ranges)
    ]
    try:
        if len(tasks) == 1:
            tasks[0]()
            return
        with ThreadPoolExecutor(
            max_workers=max(1, min(max_concurrency, len(tasks))),
            thread_name_prefix="spotrun-s3-get",
        ) as executor:
            run_parts(executor, tasks)
    except ClientError as exc:
        if is_precondition_failed(exc):
            raise StorageError(errno.EAGAIN, f"get {what}: the object was replaced while it was being read") from exc
        raise
    finally:
        first["Body"].close()  # no-op once read; frees the connection if never read


def read_into(
    client: Any,
    call: CallWithRetry,
    *,
    bucket: str,
    key: str,
    offset: int,
    views: Sequence[memoryview],
    part_size_bytes: int,
    max_concurrency: int,
) -> None:
    """Read bytes ``[offset, offset + total)`` of the object into ``views`` in order
    (``total`` = the sum of their lengths, > 0), in parallel ranged GETs of at most
    ``part_size_bytes``; a range of one part is one GET.

    Raises:
        StorageError: the object ends before the range does, or was replaced while being
            read.
        botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: a request
            failed for good (``NoSuchKey`` for a missing object).
    """
    total = sum(len(v) for v in views)
    ranges = [(offset + a, offset + b) for a, b in part_ranges(total, part_size_bytes)]
    start, stop = ranges[0]
    first = call(
        lambda: _open_range(client, bucket=bucket, key=key, start=start, stop=stop, etag=None),
        f"get bytes {start}-{stop - 1} of s3://{bucket}/{key}",
    )
    size = _object_size(first)
    if size is not None and offset + total > size:
        first["Body"].close()
        raise _past_end(f"s3://{bucket}/{key}", offset, offset + total, size)

    def consume(index: int, body: Any) -> None:
        a, b = ranges[index]
        read_body_into(body, slice_views(views, a - offset, b - offset))

    _fetch_all(
        client,
        call,
        bucket=bucket,
        key=key,
        ranges=ranges,
        first=first,
        consume=consume,
        max_concurrency=max_concurrency,
    )


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
    size, so an object of at most one part costs a single request. The parts' bodies are
    joined once into the result.

    Raises:
        botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: a request
            failed for good.
        StorageError: the object was replaced while its parts were being read.
    """
    what = f"s3://{bucket}/{key}"

    def first_attempt() -> dict[str, Any]:
        try:
            return client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{part_size_bytes - 1}")
        except ClientError as exc:
            if error_code(exc) != "InvalidRange":
                raise
            # An empty object has no byte 0, so any range is unsatisfiable.
            return client.get_object(Bucket=bucket, Key=key)

    first = call(first_attempt, f"get {what}")
    length = int(first["ContentLength"])
    if length == 0:
        first["Body"].close()
        return b""
    # No Content-Range: the server sent the whole object (it ignored the range).
    size = _object_size(first) or length
    ranges = part_ranges(size, max(part_size_bytes, length))
    bodies: list[bytes] = [b""] * len(ranges)

    def consume(index: int, body: Any) -> None:
        data = body.read()
        a, b = ranges[index]
        if len(data) != b - a:
            raise IncompleteReadError(actual_bytes=len(data), expected_bytes=b - a)
        bodies[index] = data

    _fetch_all(
        client,
        call,
        bucket=bucket,
        key=key,
        ranges=ranges,
        first=first,
        consume=consume,
        max_concurrency=max_concurrency,
    )
    return b"".join(bodies)

"""Azure's parallel transfers: blocks staged from a byte source then one Put Block List, and
ranged reads whose later ranges are pinned (``If-Match``) to the first answer's ETag.

Parts run on :func:`spotrun.storage.transfer.run_parts`, each retried on its own under one
deadline; a failed upload's blocks are discarded before its error propagates. Errors leave as the
SDK raised them, except those named here; :mod:`spotrun.storage.azure` translates.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError

from spotrun.errors import ObjectTooShortError, StorageError
from spotrun.storage.azure_blocks import block_id, new_upload
from spotrun.storage.azure_errors import http_status, is_precondition_failed
from spotrun.storage.base import ByteSource, ChunkCallback
from spotrun.storage.retry import CallWithRetry
from spotrun.storage.transfer import PartBuffers, ViewWriter, fill_buffer, part_ranges, run_parts, slice_views

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(-?\d+)/(\d+)")

#: ``discard(started_unix_s, tag)``: removes what a failed upload staged (logs, never raises).
Discard = Callable[[int, str], None]


def upload_stream(
    blob: Any,
    call: CallWithRetry,
    *,
    what: str,
    source: ByteSource,
    chunk_bytes: int,
    on_chunk: ChunkCallback | None,
    part_size_bytes: int,
    max_concurrency: int,
    discard: Discard,
) -> None:
    """Store ``source``'s bytes in ``blob`` (a ``BlobClient``): blocks staged in parallel, then
    one unconditional Put Block List.

    Args:
        call: runs one request with retries, ``call(fn, what)``.
        what: ``az://container/key``, for messages.
        source: the object's bytes; read once per block, from that block's thread.
        chunk_bytes: ``on_chunk`` sees chunks of this size (the last may be shorter).
        on_chunk: ``on_chunk(offset, view)`` for every chunk, once, before its block is staged;
            ``view`` is a read-only view of a reused buffer, valid until ``on_chunk`` returns.
        part_size_bytes: bytes per block, a multiple of ``chunk_bytes`` within Azure's limits
            (:func:`spotrun.storage.part_sizes.upload_part_size`).
        max_concurrency: blocks read and staged at the same time; so also the most buffers held.
        discard: called when the upload fails, before the error propagates.

    Raises:
        azure.core.exceptions.AzureError: a request failed for good; the blocks were discarded.
        Whatever ``source.readinto`` or ``on_chunk`` raised; the blocks were discarded.
    """
    block_bytes = part_size_bytes
    ranges = part_ranges(source.size_bytes, block_bytes)
    started, tag = new_upload()
    ids = [block_id(started, tag, index) for index in range(len(ranges))]
    buffers = PartBuffers(block_bytes)

    def stage(index: int, start: int, stop: int) -> None:
        buffer = buffers.take(stop - start)
        try:
            fill_buffer(source, buffer, start, chunk_bytes, on_chunk)
            call(lambda: blob.stage_block(ids[index], buffer, length=len(buffer)), f"stage block {index} of {what}")
        finally:
            buffers.give(buffer)

    tasks = [(lambda i=index, a=start, b=stop: stage(i, a, b)) for index, (start, stop) in enumerate(ranges)]
    try:
        with ThreadPoolExecutor(
            max_workers=max(1, min(max_concurrency, len(tasks))), thread_name_prefix="spotrun-az-put"
        ) as executor:
            run_parts(executor, tasks)
        call(lambda: blob.commit_block_list(ids), f"commit block list of {what}")
    except BaseException:
        discard(started, tag)
        raise


def put_from_source(
    blob: Any, call: CallWithRetry, *, what: str, source: ByteSource, chunk_bytes: int, on_chunk: ChunkCallback | None
) -> None:
    """Store ``source``'s bytes with one Put Blob (a small object), read chunk by chunk first.

    Raises:
        azure.core.exceptions.AzureError: the request failed for good.
        Whatever ``source.readinto`` or ``on_chunk`` raised; nothing was sent.
    """
    buffer = bytearray(source.size_bytes)
    fill_buffer(source, buffer, 0, chunk_bytes, on_chunk)
    body = bytes(buffer)  # the SDK sends only bytes in one Put Blob
    del buffer
    call(lambda: blob.upload_blob(body, overwrite=True), f"put {what}")


# --- reads ---------------------------------------------------------------------------


def _blob_size(downloader: Any) -> int | None:
    """The whole blob's size from a ranged answer (the SDK's ``bytes a-b/size``)."""
    match = _CONTENT_RANGE.fullmatch(downloader.properties.content_range or "")
    return int(match.group(3)) if match else None


def _past_end(what: str, start: int, stop: int, size_bytes: int | None) -> StorageError:
    size = "?" if size_bytes is None else str(size_bytes)
    return ObjectTooShortError(errno.EIO, f"read of {what}: bytes {start}-{stop} are past its end ({size} bytes)")


def _open_range(blob: Any, *, what: str, start: int, stop: int, etag: str | None) -> Any:
    """One GET of bytes ``[start, stop)``, its body read (the SDK reads it whole).

    Raises:
        ObjectTooShortError: the blob ends before ``stop`` (not retried).
        azure.core.exceptions.HttpResponseError: 412 when ``etag`` no longer matches; others.
    """
    pinned = {"etag": etag, "match_condition": MatchConditions.IfNotModified} if etag is not None else {}
    try:
        downloader = blob.download_blob(offset=start, length=stop - start, **pinned)
    except HttpResponseError as exc:
        if http_status(exc) == 416:  # InvalidRange: it starts at or after the end
            raise _past_end(what, start, stop, None) from exc
        raise
    if downloader.size != stop - start:
        raise _past_end(what, start, stop, _blob_size(downloader))
    return downloader


def _run_pinned(tasks: list[Callable[[], Any]], *, what: str, max_concurrency: int) -> list[Any]:
    """Run the later ranges' tasks in parallel; a replaced object is an EAGAIN StorageError."""
    try:
        with ThreadPoolExecutor(
            max_workers=max(1, min(max_concurrency, len(tasks))), thread_name_prefix="spotrun-az-get"
        ) as executor:
            return run_parts(executor, tasks)
    except HttpResponseError as exc:
        if is_precondition_failed(exc):
            raise StorageError(errno.EAGAIN, f"get {what}: the object was replaced while it was being read") from exc
        raise


def read_into(
    blob: Any,
    call: CallWithRetry,
    *,
    what: str,
    offset: int,
    views: Sequence[memoryview],
    part_size_bytes: int,
    max_concurrency: int,
) -> None:
    """Read bytes ``[offset, offset + total)`` into ``views`` in order (``total`` > 0), in
    parallel ranged GETs of at most ``part_size_bytes``; a range of one part is one GET.

    Raises:
        ObjectTooShortError: the blob ends before the range does.
        StorageError: the blob was replaced while it was being read (EAGAIN).
        azure.core.exceptions.AzureError: a request failed for good (404 for a missing blob).
    """
    total = sum(len(v) for v in views)
    ranges = [(offset + a, offset + b) for a, b in part_ranges(total, part_size_bytes)]
    start, stop = ranges[0]
    first = call(
        lambda: _open_range(blob, what=what, start=start, stop=stop, etag=None),
        f"get bytes {start}-{stop - 1} of {what}",
    )
    size = _blob_size(first)
    if size is not None and offset + total > size:
        raise _past_end(what, offset, offset + total, size)
    etag = first.properties.etag
    first.readinto(ViewWriter(slice_views(views, 0, stop - offset)))

    def fetch(a: int, b: int) -> None:
        def attempt() -> None:
            downloader = _open_range(blob, what=what, start=a, stop=b, etag=etag)
            downloader.readinto(ViewWriter(slice_views(views, a - offset, b - offset)))

        call(attempt, f"get bytes {a}-{b - 1} of {what}")

    if len(ranges) > 1:
        tasks = [(lambda a=a, b=b: fetch(a, b)) for a, b in ranges[1:]]
        _run_pinned(tasks, what=what, max_concurrency=max_concurrency)


def download(blob: Any, call: CallWithRetry, *, what: str, part_size_bytes: int, max_concurrency: int) -> bytes:
    """The whole blob, in parallel ranges when it spans several parts; a blob of at most one
    part costs one request (the first answer gives the size).

    Raises:
        StorageError: the blob was replaced while its parts were being read (EAGAIN).
        azure.core.exceptions.AzureError: a request failed for good.
    """

    def first_attempt() -> Any:
        try:
            return blob.download_blob(offset=0, length=part_size_bytes)
        except HttpResponseError as exc:
            if http_status(exc) != 416:
                raise
            return blob.download_blob()  # an empty blob has no byte 0 to ask for

    first = call(first_attempt, f"get {what}")
    size = _blob_size(first)
    head = first.readall()
    if size is None or size <= len(head):
        return head
    etag = first.properties.etag
    ranges = part_ranges(size, part_size_bytes)[1:]

    def fetch(a: int, b: int) -> bytes:
        return call(
            lambda: _open_range(blob, what=what, start=a, stop=b, etag=etag).readall(),
            f"get bytes {a}-{b - 1} of {what}",
        )

    bodies = _run_pinned(
        [(lambda a=a, b=b: fetch(a, b)) for a, b in ranges], what=what, max_concurrency=max_concurrency
    )
    return b"".join([head, *bodies])

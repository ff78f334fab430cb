"""GCS's parallel transfers: a large object uploaded as parts composed into it, and ranged reads
into the caller's buffers.

A composite upload writes parts ``<key>.spotrun-upload-<id>/<n>`` in parallel (bounded part
buffers, each part retried on its own), composes them (at most 32 per compose request, so two
levels for up to 1,024 parts) into the object in one last request, and deletes the parts. The
last compose is the write: the object appears whole or not at all. A writer killed before it
leaves parts, which :func:`unfinished_parts` finds for ``spotrun gc``. Errors leave as Google's
library raised them; :mod:`spotrun.storage.gcs` translates.
"""

from __future__ import annotations

import io
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from google.api_core import exceptions as api_exceptions

from spotrun.storage.base import ByteSource, ChunkCallback
from spotrun.storage.gcs_config import MAX_COMPOSE_SOURCES
from spotrun.storage.retry import CallWithRetry
from spotrun.storage.transfer import PartBuffers, ViewWriter, fill_buffer, part_ranges, run_parts

log = logging.getLogger(__name__)

#: Between an object's key and the id of one composite upload of it, in its parts' names.
UPLOAD_MARK = ".spotrun-upload-"
#: A part (``00001``) or an intermediate compose (``c00001``) of a composite upload.
PART_NAME = re.compile(r"^(?P<key>.+)" + re.escape(UPLOAD_MARK) + r"(?P<upload_id>[0-9a-f]{12})/c?\d{5}$")

#: ``blob_of(name)``: a fresh ``google.cloud.storage.Blob`` for a full object name.
BlobOf = Callable[[str], Any]


def read_range(
    blob: Any, views: Sequence[memoryview], *, start: int, stop: int, generation: int | None, timeout: Any
) -> int:
    """One ranged GET of bytes ``[start, stop)`` into ``views``; returns the bytes received (fewer
    when the object ends first). ``generation`` pins the read to that generation (412 otherwise)."""
    writer = ViewWriter([v for v in views if len(v)])
    blob.download_to_file(
        writer,
        start=start,
        end=stop - 1,
        raw_download=True,
        checksum=None,  # a range has no checksum to check; spotrun's block digests check the bytes
        retry=None,
        timeout=timeout,
        if_generation_match=generation,
    )
    return writer.written


def upload_composite(
    blob_of: BlobOf,
    call: CallWithRetry,
    *,
    name: str,
    what: str,
    source: ByteSource,
    chunk_bytes: int,
    on_chunk: ChunkCallback | None,
    part_size_bytes: int,
    max_concurrency: int,
    timeout: Any,
    if_generation_match: int | None = None,
) -> None:
    """Store ``source``'s bytes as object ``name`` (a full object name): parts uploaded in
    parallel, composed into it, then deleted (also when the upload fails).

    Args:
        blob_of: makes a fresh Blob for a full object name.
        call: runs one request with retries, ``call(fn, what)``.
        on_chunk: as :meth:`spotrun.storage.base.Storage.put_stream`'s, from the part's thread.
        part_size_bytes: bytes per part, a multiple of ``chunk_bytes``, at most 1,024 parts
            (:func:`spotrun.storage.part_sizes.upload_part_size`).
        if_generation_match: ``0`` makes the last compose create-only (the commit primitive).

    Raises:
        google.api_core.exceptions.GoogleAPIError, requests.exceptions.RequestException: a
            request failed for good; whatever ``source.readinto`` or ``on_chunk`` raised.
    """
    ranges = part_ranges(source.size_bytes, part_size_bytes)
    base = f"{name}{UPLOAD_MARK}{uuid.uuid4().hex[:12]}/"
    buffers = PartBuffers(part_size_bytes)
    written: list[str] = []

    def upload_part(number: int, start: int, stop: int) -> str:
        part = f"{base}{number:05d}"
        buffer = buffers.take(stop - start)
        try:
            fill_buffer(source, buffer, start, chunk_bytes, on_chunk)
            written.append(part)
            call(lambda: upload_bytes(blob_of(part), buffer, timeout=timeout), f"upload part {number} of {what}")
            return part
        finally:
            buffers.give(buffer)

    tasks = [(lambda n=n, a=a, b=b: upload_part(n, a, b)) for n, (a, b) in enumerate(ranges, start=1)]
    try:
        with ThreadPoolExecutor(
            max_workers=max(1, min(max_concurrency, len(tasks))), thread_name_prefix="spotrun-gcs-put"
        ) as executor:
            parts = run_parts(executor, tasks)
            parts = _compose_down(
                blob_of, call, executor, parts, base=base, what=what, timeout=timeout, written=written
            )
        destination = blob_of(name)
        call(
            lambda: destination.compose(
                [blob_of(p) for p in parts], retry=None, timeout=timeout, if_generation_match=if_generation_match
            ),
            f"compose {what}",
        )
    finally:
        delete_parts(blob_of, call, written, what=what, max_concurrency=max_concurrency)


def _compose_down(
    blob_of: BlobOf,
    call: CallWithRetry,
    executor: ThreadPoolExecutor,
    parts: list[str],
    *,
    base: str,
    what: str,
    timeout: Any,
    written: list[str],
) -> list[str]:
    """Compose groups of 32 parts into intermediate objects until one compose can take them all."""
    if len(parts) <= MAX_COMPOSE_SOURCES:
        return parts
    groups = [parts[i : i + MAX_COMPOSE_SOURCES] for i in range(0, len(parts), MAX_COMPOSE_SOURCES)]

    def compose_group(number: int, group: list[str]) -> str:
        intermediate = f"{base}c{number:05d}"
        written.append(intermediate)
        target = blob_of(intermediate)
        call(
            lambda: target.compose([blob_of(p) for p in group], retry=None, timeout=timeout),
            f"compose parts of {what}",
        )
        return intermediate

    return run_parts(executor, [(lambda n=n, g=g: compose_group(n, g)) for n, g in enumerate(groups, start=1)])


def upload_bytes(
    blob: Any, data: bytes | bytearray | memoryview, *, timeout: Any, if_generation_match: int | None = None
):
    """One upload of ``data`` (one request up to 8 MiB, a resumable upload above: Google's client
    decides); ``if_generation_match=0`` makes it create-only."""
    blob.upload_from_file(
        io.BytesIO(data),
        size=len(data),
        checksum=None,  # spotrun's own digests check the bytes on load
        retry=None,
        timeout=timeout,
        if_generation_match=if_generation_match,
    )


def delete_parts(
    blob_of: BlobOf, call: CallWithRetry, parts: Sequence[str], *, what: str, max_concurrency: int = 8, strict=False
) -> None:
    """Delete an upload's parts in parallel. One that cannot be deleted is logged and left for
    ``spotrun gc`` (the upload's own outcome must win), or, with ``strict`` (gc itself), raised."""

    def delete(part: str) -> None:
        try:
            call(lambda: delete_quietly(blob_of(part)), f"delete part of {what}")
        except Exception as exc:
            if strict:
                raise
            log.warning("could not delete %s (%s); spotrun gc removes it later", part, type(exc).__name__)

    if not parts:
        return
    with ThreadPoolExecutor(
        max_workers=max(1, min(max_concurrency, len(parts))), thread_name_prefix="spotrun-gcs-delete"
    ) as executor:
        list(executor.map(delete, parts))


def delete_quietly(blob: Any) -> None:
    """Delete one object; a missing one is not an error."""
    try:
        blob.delete(retry=None)
    except api_exceptions.NotFound:
        pass

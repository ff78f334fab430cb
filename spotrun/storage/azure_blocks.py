"""Uncommitted blocks on Azure (its counterpart of an open S3 multipart upload): the ids spotrun
gives them, and finding and discarding those a failed or killed writer left.

A block id, ``spotrun-<start, unix s>-<upload tag>-<index>``, is fixed-width (a blob's ids must
all be as long) and says which upload staged it and when. Blocks on a name with no committed blob
make an "uncommitted blob": it is deleted. Blocks on a committed blob are discarded by committing
it again with its own bytes, conditional on its ETag (its content stays; its ETag and Last-Modified
change). A newer upload's blocks are never touched: it may still be running.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError

from spotrun.storage.azure_errors import error_code, is_precondition_failed
from spotrun.storage.base import UnfinishedUpload
from spotrun.storage.retry import CallWithRetry
from spotrun.storage.transfer import part_ranges

log = logging.getLogger(__name__)

_BLOCK_ID = re.compile(r"spotrun-(\d{10})-([0-9a-f]{16})-(\d{6})")
#: ``upload_id`` of blocks whose ids spotrun did not make (another client's), on a name with no
#: committed blob; their time is the listing's.
FOREIGN_BLOCKS = "blocks-of-another-client"


def new_upload() -> tuple[int, str]:
    """``(start, tag)`` of a new upload: the wall clock in whole seconds and a random tag."""
    return int(time.time()), secrets.token_hex(8)


def block_id(started_unix_s: int, tag: str, index: int) -> str:
    """The id of block ``index`` of the upload ``(started_unix_s, tag)`` (the SDK base64s it)."""
    return f"spotrun-{started_unix_s:010d}-{tag}-{index:06d}"


def uploads_of(block_ids: Iterable[str]) -> dict[str, int]:
    """The uploads that staged ``block_ids``: tag -> start (unix s); another client's blocks
    count as one upload, :data:`FOREIGN_BLOCKS`, started at 0."""
    uploads: dict[str, int] = {}
    for name in block_ids:
        match = _BLOCK_ID.fullmatch(name)
        if match is None:
            uploads[FOREIGN_BLOCKS] = 0
        else:
            uploads[match.group(2)] = int(match.group(1))
    return uploads


def _is_missing_blob(exc: HttpResponseError) -> bool:
    # A missing container is an error the caller reports; only the blob may be gone.
    return error_code(exc) == "BlobNotFound" or (exc.status_code == 404 and error_code(exc) != "ContainerNotFound")


def find_unfinished(
    container: Any,
    caller: Callable[[str], CallWithRetry],
    *,
    listed: dict[str, Any],
    committed: set[str],
    root: str,
    max_concurrency: int,
) -> list[UnfinishedUpload]:
    """The uploads that left uncommitted blocks on the listed blobs, one per blob and upload.

    Args:
        container: the ``ContainerClient``.
        caller: ``caller(what)`` -> a ``call`` retrying under a deadline of its own (one per blob).
        listed: blob name -> its listing entry, uncommitted blobs included.
        committed: the names among them that have a committed blob.
        root: the root's prefix with its trailing ``/`` (``""`` for a container-wide root).
        max_concurrency: block lists asked for at the same time.

    An upload's ``time_unix_s`` is its start on its writer's clock (in its block ids). Another
    client's blocks on a committed blob are not reported: nothing says how old they are.
    """

    def scan(name: str) -> list[UnfinishedUpload]:
        what = f"get block list of {container.container_name}/{name}"
        blob = container.get_blob_client(name)
        try:
            _, uncommitted = caller(what)(lambda: blob.get_block_list("uncommitted"), what)
        except HttpResponseError as exc:
            if _is_missing_blob(exc):  # deleted or committed-and-deleted since the listing
                return []
            raise
        found = []
        for tag, started in uploads_of(block.id for block in uncommitted).items():
            if tag == FOREIGN_BLOCKS:
                if name in committed:
                    continue
                started = int(listed[name].last_modified.timestamp())
            found.append(UnfinishedUpload(key=name[len(root) :], time_unix_s=float(started), upload_id=tag))
        return found

    names = [
        name for name, entry in listed.items() if getattr(entry.blob_type, "value", entry.blob_type) == "BlockBlob"
    ]
    if not names:
        return []
    with ThreadPoolExecutor(
        max_workers=max(1, min(max_concurrency, len(names))), thread_name_prefix="spotrun-az-ls"
    ) as pool:
        return [upload for found in pool.map(scan, names) for upload in found]


def discard(
    container: Any,
    call: CallWithRetry,
    *,
    name: str,
    tag: str,
    started_unix_s: float,
    part_size_bytes: int,
) -> str:
    """Discard the uncommitted blocks of the upload ``tag`` on blob ``name`` (and those of older
    uploads there), leaving any committed blob as it was; returns what was done, in words.

    Raises:
        azure.core.exceptions.AzureError: a request failed for good.
    """
    what = f"{container.container_name}/{name}"
    blob = container.get_blob_client(name)
    try:
        props = call(blob.get_blob_properties, f"get properties of {what}")
    except HttpResponseError as exc:
        if not _is_missing_blob(exc):
            raise
        props = None  # no committed blob: an uncommitted one, or nothing
    try:
        committed, uncommitted = call(lambda: blob.get_block_list("all"), f"get block list of {what}")
    except HttpResponseError as exc:
        if _is_missing_blob(exc):
            return "already gone"
        raise
    uploads = uploads_of(block.id for block in uncommitted)
    if tag not in uploads:
        return "already gone"
    newer = sorted(t for t, s in uploads.items() if t not in (tag, FOREIGN_BLOCKS) and s >= started_unix_s)
    if newer:
        log.warning(
            "%s: uncommitted blocks of a newer upload (%s) are there too; left for its commit to discard",
            what,
            ", ".join(newer),
        )
        return "left beside a newer upload"
    if props is None:
        if committed:  # committed since the first look: that commit discarded the blocks
            return "already gone"
        try:
            call(blob.delete_blob, f"delete uncommitted blob {what}")
        except HttpResponseError as exc:
            if not _is_missing_blob(exc):
                raise
        return "deleted the uncommitted blob"
    return _commit_again(
        blob, call, what=what, props=props, committed=[b.id for b in committed], part_bytes=part_size_bytes
    )


def _commit_again(
    blob: Any, call: CallWithRetry, *, what: str, props: Any, committed: list[str], part_bytes: int
) -> str:
    """Commit the committed blob ``props`` again with its own bytes, which discards every
    uncommitted block; only while its ETag is unchanged."""
    same = {"etag": props.etag, "match_condition": MatchConditions.IfNotModified}
    ids = committed
    if not ids and props.size > 0:  # written by one Put Blob: its bytes become blocks first
        started, tag = new_upload()
        ids = []
        for index, (start, stop) in enumerate(part_ranges(props.size, part_bytes)):
            ids.append(block_id(started, tag, index))
            try:
                data = call(
                    lambda a=start, b=stop: blob.download_blob(offset=a, length=b - a, **same).readall(),
                    f"get bytes {start}-{stop - 1} of {what}",
                )
            except HttpResponseError as exc:
                if is_precondition_failed(exc):
                    return "already gone (the blob was replaced)"
                raise
            call(lambda i=ids[-1], d=data: blob.stage_block(i, d, length=len(d)), f"stage block {index} of {what}")
    try:
        call(
            lambda: blob.commit_block_list(
                ids, content_settings=props.content_settings, metadata=props.metadata, **same
            ),
            f"commit {what} again",
        )
    except HttpResponseError as exc:
        if is_precondition_failed(exc):  # replaced meanwhile; in Azure that discarded the blocks
            return "already gone (the blob was replaced)"
        raise
    return "committed the blob again with its own content"

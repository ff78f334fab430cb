"""Azure Blob Storage backend (``az://container[/prefix]``; Azure itself, Azurite).

Account and credentials come from the environment (:mod:`spotrun.storage.azure_config`). Small
objects are one Put Blob; large ones are blocks staged in parallel and one Put Block List
(:mod:`spotrun.storage.azure_transfer`); the commit is one Put Blob with ``If-None-Match: *``.
What a killed writer leaves (uncommitted blocks) is found and discarded by
:mod:`spotrun.storage.azure_blocks`; errors are translated by :mod:`spotrun.storage.azure_errors`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError

from spotrun.errors import ConfigError, ObjectExistsError, ObjectTooShortError, StorageError
from spotrun.storage import azure_blocks, azure_transfer
from spotrun.storage.azure_config import MAX_SINGLE_PUT_BYTES, AzureOptions, make_service
from spotrun.storage.azure_errors import AZURE_ERRORS, error_code, is_already_exists, is_retryable, translate
from spotrun.storage.azure_location import parse_az_uri
from spotrun.storage.base import ByteSource, ChunkCallback, ObjectInfo, UnfinishedUpload
from spotrun.storage.part_sizes import AZURE_LIMITS, ranged_read_size, upload_part_size
from spotrun.storage.retry import CallWithRetry, RetryingStorage
from spotrun.storage.transfer import MemorySource
from spotrun.tools import private_random

__all__ = ["AzureOptions", "AzureStorage", "parse_az_uri"]

# azure-core jitters each token refresh of DefaultAzureCredential with the global random generator:
# the training's, which a resume restores (spotrun.tools.private_random).
private_random.isolate("azure.core.pipeline.policies._authentication")

log = logging.getLogger(__name__)


class AzureStorage(RetryingStorage):
    """Blobs under ``az://container/prefix``.

    Args:
        container: container name; the container must exist.
        prefix: name prefix without leading/trailing ``/``; may be empty. Object ``k`` is
            stored as blob ``prefix/k``.
        options: transfer, retry and connection options (defaults if ``None``).
        service: a ready ``BlobServiceClient`` to use instead of building one from the
            environment (tests pass one with request hooks).

    Raises:
        ConfigError: bad container, prefix or options; a malformed connection string.
        StoragePermissionError: the environment names no account and no connection string.
    """

    commit_requirement = "conditional writes (Put Blob with If-None-Match: *)"
    commit_advice = "use Azure Blob Storage itself or an emulator that enforces them (Azurite does)"
    unfinished_upload_kind = "uncommitted blocks of"

    #: Blobs asked for per listing page (Azure's most; tests lower it on an instance).
    list_page_size = 5000

    def __init__(
        self, container: str, prefix: str = "", options: AzureOptions | None = None, *, service: Any = None
    ) -> None:
        if not container or "/" in container:
            raise ConfigError(f"bad Azure container name {container!r}")
        self._container_name, self._prefix = parse_az_uri(f"az://{container}/{prefix}")
        self._options = options or AzureOptions()
        super().__init__(self._options, is_retryable)
        self._service = service if service is not None else make_service(self._options, what=self.uri)
        self._container = self._service.get_container_client(self._container_name)

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> AzureStorage:
        """``AzureStorage`` for ``az://container[/prefix]``; ``options`` are :class:`AzureOptions` fields.

        Raises:
            ConfigError: a malformed URI or an unknown/out-of-range option.
            StoragePermissionError: no account and no connection string in the environment.
        """
        container, prefix = parse_az_uri(uri)
        return cls(container, prefix, AzureOptions.from_kwargs(**options))

    @property
    def uri(self) -> str:
        base = f"az://{self._container_name}"
        return f"{base}/{self._prefix}" if self._prefix else base

    @property
    def commit_primitive(self) -> str:
        return "conditional Put Blob (If-None-Match: *)"

    @property
    def container(self) -> Any:
        """The SDK's ``ContainerClient`` in use."""
        return self._container

    # --- plumbing ---------------------------------------------------------------

    def _target(self, key: str) -> str:
        return f"az://{self._container_name}/{self._name(key)}"

    def _what(self, operation: str, key: str) -> str:
        return f"{operation} {self._target(key)}"

    def _blob(self, key: str) -> Any:
        return self._container.get_blob_client(self._name(key))

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except AZURE_ERRORS as exc:
            # The client's URL carries a SAS token where one is used: never into a message.
            endpoint = urllib.parse.urlsplit(self._service.url)._replace(query="").geturl()
            raise translate(exc, what=what, container=self._container_name, endpoint=endpoint) from exc

    def _pool_caller(self) -> Callable[[str], CallWithRetry]:
        """``caller(what)`` for requests run on pool threads: each gets a deadline of its own,
        none later than the deadline block around this (the calling) thread."""
        contextual = getattr(self._local, "deadline_at", None)

        def caller(what: str) -> CallWithRetry:
            if contextual is None:
                return self._caller(what)
            with self.deadline(contextual - self._retry.clock()):
                return self._caller(what)

        return caller

    def _transfer_kwargs(self) -> dict[str, Any]:
        return {"part_size_bytes": self._options.part_size_bytes, "max_concurrency": self._options.max_concurrency}

    # --- hooks ------------------------------------------------------------------

    def _put(self, key: str, data: memoryview) -> None:
        if len(data) >= self._options.multipart_threshold_bytes:
            self._put_stream(key, MemorySource(data), self._options.part_size_bytes, None)
            return
        what = self._what("put", key)
        call = self._caller(what)
        body, blob = bytes(data), self._blob(key)
        with self._translated(what):
            call(lambda: blob.upload_blob(body, overwrite=True), what)

    def _put_stream(self, key: str, source: ByteSource, chunk_bytes: int, on_chunk: ChunkCallback | None) -> None:
        what = self._what("put", key)
        call = self._caller(what)
        blob, target = self._blob(key), self._target(key)
        with self._translated(what):
            if source.size_bytes < self._options.multipart_threshold_bytes:
                azure_transfer.put_from_source(
                    blob, call, what=target, source=source, chunk_bytes=chunk_bytes, on_chunk=on_chunk
                )
                return
            azure_transfer.upload_stream(
                blob,
                call,
                what=target,
                source=source,
                chunk_bytes=chunk_bytes,
                on_chunk=on_chunk,
                discard=lambda started, tag: self._discard_quietly(key, started, tag, call),
                part_size_bytes=upload_part_size(
                    source.size_bytes, self._options, AZURE_LIMITS, chunk_bytes=chunk_bytes
                ),
                max_concurrency=self._options.max_concurrency,
            )

    def _discard_quietly(self, key: str, started_unix_s: int, tag: str, call: CallWithRetry) -> None:
        """Discard a failed upload's blocks under the upload's own deadline (each request is tried
        at least once); a failure here is logged, never raised over the cause."""
        what = self._what("discard the uncommitted blocks of", key)
        try:
            done = azure_blocks.discard(
                self._container,
                call,
                name=self._name(key),
                tag=tag,
                started_unix_s=started_unix_s,
                part_size_bytes=self._options.part_size_bytes,
            )
        except Exception as exc:  # noqa: BLE001 - the original error must win
            log.error("%s failed (%s); Azure drops them a week after they were staged", what, type(exc).__name__)
        else:
            log.info("%s: %s", what, done)

    def _put_if_absent(self, key: str, data: memoryview) -> None:
        what = self._what("put_if_absent", key)
        if len(data) > MAX_SINGLE_PUT_BYTES:
            raise StorageError(
                errno.EFBIG,
                f"{what}: {len(data)} bytes is more than one conditional Put Blob may carry "
                f"({MAX_SINGLE_PUT_BYTES} bytes, Azure's single-put limit); a block list commit cannot "
                "commit it without staging blocks another writer's commit would discard",
            )
        call = self._caller(what)
        attempts = 0
        body, blob = bytes(data), self._blob(key)

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            blob.upload_blob(body, overwrite=False, match_condition=MatchConditions.IfMissing)

        try:
            with self._translated(what):
                call(attempt, what)
        except StorageError as exc:
            if not is_already_exists(exc.__cause__):
                raise
            if attempts > 1 and self._own_earlier_attempt_landed(key, body):
                return
            raise ObjectExistsError(errno.EEXIST, f"{what}: the object already exists") from exc.__cause__

    def _get(self, key: str) -> bytes:
        what = self._what("get", key)
        call = self._caller(what)
        with self._translated(what):
            return azure_transfer.download(self._blob(key), call, what=self._target(key), **self._transfer_kwargs())

    def _read_into(self, key: str, offset: int, views: list[memoryview]) -> None:
        what = self._what("read", key)
        total = sum(len(v) for v in views)
        if offset < 0:
            raise StorageError(errno.EINVAL, f"{what}: negative offset {offset}")
        if total == 0:  # nothing to fetch; the blob must still exist and reach offset
            size = self._stat(key).size_bytes
            if offset > size:
                raise ObjectTooShortError(errno.EIO, f"{what}: offset {offset} is past its end ({size} bytes)")
            return
        call = self._caller(what)
        with self._translated(what):
            azure_transfer.read_into(
                self._blob(key),
                call,
                what=self._target(key),
                offset=offset,
                views=views,
                part_size_bytes=ranged_read_size(self._options),
                max_concurrency=self._options.max_concurrency,
            )

    def _stat(self, key: str) -> ObjectInfo:
        what = self._what("stat", key)
        call = self._caller(what)
        blob = self._blob(key)
        with self._translated(what):
            props = call(blob.get_blob_properties, what)
        return ObjectInfo(key=key, size_bytes=int(props.size), mtime_s=props.last_modified.timestamp())

    def _list_blobs(self, call: CallWithRetry, what: str, prefix: str, include: list[str]) -> list[Any]:
        """Every blob whose name starts with ``prefix``, page by page, each page retried on its own."""
        blobs: list[Any] = []
        token: str | None = None
        while True:

            def page(marker: str | None = token) -> tuple[list[Any], str | None]:
                pages = self._container.list_blobs(
                    name_starts_with=prefix, include=include or None, results_per_page=self.list_page_size
                ).by_page(continuation_token=marker)
                return list(next(pages)), pages.continuation_token

            items, token = call(page, what)
            blobs += items
            if not token:
                return blobs

    def _list(self, prefix: str) -> list[ObjectInfo]:
        root = self._root()
        what = f"list az://{self._container_name}/{root}{prefix}"
        call = self._caller(what)
        infos: list[ObjectInfo] = []
        with self._translated(what):
            for blob in self._list_blobs(call, what, root + prefix, ["metadata"]):
                key = blob.name[len(root) :]
                # Skip "directory" markers: a trailing "/" (consoles) or hdi_isfolder (hierarchical namespace).
                if not key or key.endswith("/") or (blob.metadata or {}).get("hdi_isfolder") == "true":
                    continue
                infos.append(ObjectInfo(key=key, size_bytes=int(blob.size), mtime_s=blob.last_modified.timestamp()))
        return infos

    def _delete(self, key: str) -> None:
        what = self._what("delete", key)
        call = self._caller(what)
        blob = self._blob(key)
        try:
            with self._translated(what):
                call(blob.delete_blob, what)
        except StorageError as exc:
            if not (isinstance(exc.__cause__, HttpResponseError) and error_code(exc.__cause__) == "BlobNotFound"):
                raise

    def _unfinished_uploads(self, prefix: str) -> list[UnfinishedUpload]:
        """Uploads under the prefix that left uncommitted blocks: on names with no committed blob
        (listed with ``uncommittedblobs``) and on committed blobs (a block list asked of each)."""
        root = self._root()
        what = f"list uncommitted blocks az://{self._container_name}/{root}{prefix}"
        call = self._caller(what)
        with self._translated(what):
            listed = {blob.name: blob for blob in self._list_blobs(call, what, root + prefix, ["uncommittedblobs"])}
            committed = {blob.name for blob in self._list_blobs(call, what, root + prefix, [])}
            return azure_blocks.find_unfinished(
                self._container,
                self._pool_caller(),
                listed=listed,
                committed=committed,
                root=root,
                max_concurrency=self._options.max_concurrency,
            )

    def _abort_upload(self, upload: UnfinishedUpload) -> None:
        what = self._what("discard the uncommitted blocks of", upload.key)
        if upload.upload_id is None:
            raise StorageError(errno.EINVAL, f"{what}: no upload id")
        call = self._caller(what)
        with self._translated(what):
            done = azure_blocks.discard(
                self._container,
                call,
                name=self._name(upload.key),
                tag=upload.upload_id,
                started_unix_s=upload.time_unix_s,
                part_size_bytes=self._options.part_size_bytes,
            )
        log.info("%s: %s", what, done)

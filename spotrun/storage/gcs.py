"""Google Cloud Storage backend, on Google's own client library (``spotrun[gcs]``).

Credentials and endpoint the Google way (:mod:`spotrun.storage.gcs_config`). The commit is a
create-only upload (``ifGenerationMatch=0``); objects of at least ``multipart_threshold_bytes``
go up as parallel parts composed into the object (:mod:`spotrun.storage.gcs_transfer`); reads
are ranged GETs into the caller's buffers, pinned to one generation. The client library's own
retries are off: :class:`~spotrun.storage.retry.RetryPolicy` with GCS's classification
(:func:`~spotrun.storage.gcs_errors.is_retryable`) is the only one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spotrun.errors import ObjectExistsError, ObjectNotFoundError, ObjectTooShortError, StorageError
from spotrun.storage import gcs_transfer
from spotrun.storage.base import ByteSource, ChunkCallback, ObjectInfo, UnfinishedUpload
from spotrun.storage.gcs_config import GCSOptions, make_client
from spotrun.storage.gcs_errors import GCS_ERRORS, is_precondition_failed, is_retryable, translate
from spotrun.storage.gcs_location import parse_gs_uri
from spotrun.storage.part_sizes import GCS_LIMITS, ranged_read_size, upload_part_size
from spotrun.storage.retry import RetryingStorage
from spotrun.storage.transfer import MemorySource, fill_buffer, part_ranges, run_parts, slice_views

__all__ = ["GCSOptions", "GCSStorage"]

log = logging.getLogger(__name__)


class GCSStorage(RetryingStorage):
    """Objects under ``gs://bucket/prefix``.

    Args:
        bucket: bucket name; the bucket must exist.
        prefix: object name prefix without leading/trailing ``/``; may be empty.
        options: transfer, retry and connection options (defaults if ``None``).
        client: a ready ``google.cloud.storage.Client`` to use instead of building one.

    Raises:
        ConfigError: bad bucket, prefix or options.
        StoragePermissionError: no credentials were found.
    """

    unfinished_upload_kind = "composite upload"
    commit_requirement = "create-only writes (uploads with ifGenerationMatch=0)"
    commit_advice = "use Cloud Storage itself, or an emulator that enforces ifGenerationMatch"

    def __init__(self, bucket: str, prefix: str = "", options: GCSOptions | None = None, *, client: Any = None) -> None:
        self._bucket_name, self._prefix = parse_gs_uri(f"gs://{bucket}/{prefix}")
        self._options = options or GCSOptions()
        super().__init__(self._options, is_retryable)
        self._client = client if client is not None else make_client(self._options, what=f"open {self.uri}")
        self._bucket = self._client.bucket(self._bucket_name)

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> GCSStorage:
        """``GCSStorage`` for ``gs://bucket[/prefix]``; ``options`` are :class:`GCSOptions` fields."""
        bucket, prefix = parse_gs_uri(uri)
        return cls(bucket, prefix, GCSOptions.from_kwargs(**options))

    @property
    def uri(self) -> str:
        return f"gs://{self._bucket_name}/{self._prefix}" if self._prefix else f"gs://{self._bucket_name}"

    @property
    def commit_primitive(self) -> str:
        return "create-only upload (ifGenerationMatch=0)"

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return self._bucket_name

    @property
    def client(self) -> Any:
        """The ``google.cloud.storage.Client`` in use."""
        return self._client

    # --- plumbing ---------------------------------------------------------------

    def _blob(self, name: str) -> Any:
        """A fresh Blob for a full object name (no cached metadata: every URL is built here)."""
        return self._bucket.blob(name)

    def _what(self, operation: str, key: str) -> str:
        return f"{operation} gs://{self._bucket_name}/{self._name(key)}"

    @contextlib.contextmanager
    def _translated(self, what: str, *, missing_means_bucket: bool = False) -> Iterator[None]:
        try:
            yield
        except GCS_ERRORS as exc:
            raise translate(
                exc, what=what, bucket=self._bucket_name, missing_means_bucket=missing_means_bucket
            ) from exc

    # --- hooks ------------------------------------------------------------------

    def _put(self, key: str, data: memoryview) -> None:
        if len(data) >= self._options.multipart_threshold_bytes:
            self._put_stream(key, MemorySource(data), self._options.part_size_bytes, None)
            return
        what = self._what("put", key)
        call = self._caller(what)
        blob = self._blob(self._name(key))
        with self._translated(what, missing_means_bucket=True):
            call(lambda: gcs_transfer.upload_bytes(blob, data, timeout=self._options.timeout), what)

    def _put_stream(self, key: str, source: ByteSource, chunk_bytes: int, on_chunk: ChunkCallback | None) -> None:
        what = self._what("put", key)
        call = self._caller(what)
        with self._translated(what, missing_means_bucket=True):
            if source.size_bytes < self._options.multipart_threshold_bytes:
                buffer = bytearray(source.size_bytes)
                fill_buffer(source, buffer, 0, chunk_bytes, on_chunk)
                blob = self._blob(self._name(key))
                call(lambda: gcs_transfer.upload_bytes(blob, buffer, timeout=self._options.timeout), what)
                return
            gcs_transfer.upload_composite(
                self._blob,
                call,
                name=self._name(key),
                what=what,
                source=source,
                chunk_bytes=chunk_bytes,
                on_chunk=on_chunk,
                part_size_bytes=upload_part_size(source.size_bytes, self._options, GCS_LIMITS, chunk_bytes=chunk_bytes),
                max_concurrency=self._options.max_concurrency,
                timeout=self._options.timeout,
            )

    def _put_if_absent(self, key: str, data: memoryview) -> None:
        what = self._what("put_if_absent", key)
        call = self._caller(what)
        blob = self._blob(self._name(key))
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            gcs_transfer.upload_bytes(blob, data, timeout=self._options.timeout, if_generation_match=0)

        try:
            with self._translated(what, missing_means_bucket=True):
                call(attempt, what)
        except StorageError as exc:
            if not is_precondition_failed(exc.__cause__):
                raise
            if attempts > 1 and self._own_earlier_attempt_landed(key, data):
                return
            raise ObjectExistsError(errno.EEXIST, f"{what}: the object already exists") from exc.__cause__

    def _get(self, key: str) -> bytes:
        what = self._what("get", key)
        call = self._caller(what)
        blob = self._blob(self._name(key))
        with self._translated(what):
            return call(
                lambda: blob.download_as_bytes(
                    raw_download=True, checksum=None, retry=None, timeout=self._options.timeout
                ),
                what,
            )

    def _read_into(self, key: str, offset: int, views: list[memoryview]) -> None:
        what = self._what("read", key)
        total = sum(len(v) for v in views)
        if offset < 0:
            raise StorageError(errno.EINVAL, f"{what}: negative offset {offset}")
        ranges = [(offset + a, offset + b) for a, b in part_ranges(total, ranged_read_size(self._options))]
        generation = None
        if len(ranges) != 1:  # an empty range, or several parts: pin them all to one generation
            info = self._stat_blob(key)
            if offset + total > info.size:
                raise ObjectTooShortError(
                    errno.EIO, f"{what}: bytes {offset}-{offset + total} are past its end ({info.size} bytes)"
                )
            generation = info.generation
        call = self._caller(what)

        def fetch(start: int, stop: int) -> None:
            blob = self._blob(self._name(key))
            part = slice_views(views, start - offset, stop - offset)
            received = call(
                lambda: gcs_transfer.read_range(
                    blob, part, start=start, stop=stop, generation=generation, timeout=self._options.timeout
                ),
                f"get bytes {start}-{stop - 1} of {what}",
            )
            if received != stop - start:
                raise ObjectTooShortError(errno.EIO, f"{what}: bytes {start}-{stop} are past its end")

        tasks = [(lambda a=a, b=b: fetch(a, b)) for a, b in ranges]
        try:
            with self._translated(what):
                if len(tasks) == 1:
                    tasks[0]()
                elif tasks:
                    with ThreadPoolExecutor(
                        max_workers=min(self._options.max_concurrency, len(tasks)), thread_name_prefix="spotrun-gcs-get"
                    ) as executor:
                        run_parts(executor, tasks)
        except StorageError as exc:
            if generation is not None and is_precondition_failed(exc.__cause__):
                raise StorageError(errno.EAGAIN, f"{what}: the object was replaced while it was being read") from exc
            raise

    def _stat_blob(self, key: str) -> Any:
        what = self._what("stat", key)
        call = self._caller(what)
        with self._translated(what):
            blob = call(lambda: self._bucket.get_blob(self._name(key), retry=None, timeout=self._options.timeout), what)
        if blob is None:
            raise ObjectNotFoundError(errno.ENOENT, f"{what}: no such object (404)")
        return blob

    def _stat(self, key: str) -> ObjectInfo:
        blob = self._stat_blob(key)
        return ObjectInfo(key=key, size_bytes=int(blob.size), mtime_s=blob.updated.timestamp())

    def _list_raw(self, prefix: str, what: str) -> list[Any]:
        """Every object under the root whose key starts with ``prefix``, upload parts included."""
        call = self._caller(what)
        with self._translated(what, missing_means_bucket=True):
            return call(
                lambda: list(
                    self._client.list_blobs(
                        self._bucket_name, prefix=self._root() + prefix, retry=None, timeout=self._options.timeout
                    )
                ),
                what,
            )

    def _list(self, prefix: str) -> list[ObjectInfo]:
        root = self._root()
        infos = []
        for blob in self._list_raw(prefix, f"list gs://{self._bucket_name}/{root}{prefix}"):
            key = blob.name[len(root) :]
            if not key or key.endswith("/") or gcs_transfer.PART_NAME.match(key):  # folders, upload parts
                continue
            infos.append(ObjectInfo(key=key, size_bytes=int(blob.size), mtime_s=blob.updated.timestamp()))
        return infos

    def _delete(self, key: str) -> None:
        what = self._what("delete", key)
        call = self._caller(what)
        blob = self._blob(self._name(key))
        with self._translated(what):
            call(lambda: gcs_transfer.delete_quietly(blob), what)

    def _unfinished_uploads(self, prefix: str) -> list[UnfinishedUpload]:
        """Composite uploads whose parts are still there (a writer killed before it composed
        and deleted them), one entry per upload, timed by its oldest part."""
        root = self._root()
        uploads: dict[tuple[str, str], float] = {}
        for blob in self._list_raw(prefix, f"list upload parts gs://{self._bucket_name}/{root}{prefix}"):
            match = gcs_transfer.PART_NAME.match(blob.name[len(root) :])
            if match:
                found = (match["key"], match["upload_id"])
                uploads[found] = min(uploads.get(found, float("inf")), blob.updated.timestamp())
        return [UnfinishedUpload(key=k, time_unix_s=t, upload_id=u) for (k, u), t in uploads.items()]

    def _abort_upload(self, upload: UnfinishedUpload) -> None:
        if upload.upload_id is None or len(upload.upload_id) != 12:
            raise StorageError(errno.EINVAL, f"not a composite upload of gs://{self._bucket_name}: {upload}")
        base = f"{upload.key}{gcs_transfer.UPLOAD_MARK}{upload.upload_id}/"
        root = self._root()
        parts = [b.name for b in self._list_raw(base, f"list parts of gs://{self._bucket_name}/{root}{base}")]
        what = self._what("abort upload", upload.key)
        with self._translated(what):
            gcs_transfer.delete_parts(self._blob, self._caller(what), parts, what=what, strict=True)

"""S3-compatible storage backend (AWS S3, MinIO, Cloudflare R2, moto...).

Endpoint, credentials, profile and region come from the standard AWS settings, resolved by
boto3 itself (an explicit ``endpoint_url`` or ``region_name`` option wins). Uploads, ranged
downloads, retries and error translation live in the ``s3_*`` modules; the commit is one
conditional ``PutObject`` (``IfNoneMatch="*"``). How each part of the
:class:`~spotrun.storage.base.Storage` contract is met: ``docs/design/internals.md`` (Storage).
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from typing import Any

import urllib3.exceptions
from botocore.exceptions import BotoCoreError, ClientError

from spotrun.errors import (
    CommitUnsupportedError,
    ConfigError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooShortError,
    StorageError,
)
from spotrun.storage import s3_download, s3_transfer
from spotrun.storage.base import ByteSource, ChunkCallback, ObjectInfo, UnfinishedUpload
from spotrun.storage.part_sizes import S3_LIMITS, ranged_read_size, upload_part_size
from spotrun.storage.retry import RetryingStorage
from spotrun.storage.s3_config import S3Options, make_client
from spotrun.storage.s3_errors import (
    is_conditional_conflict,
    is_not_implemented,
    is_precondition_failed,
    is_retryable,
    translate,
)
from spotrun.storage.s3_location import parse_s3_uri

__all__ = ["S3Options", "S3Storage", "make_client", "parse_s3_uri"]

log = logging.getLogger(__name__)

_BOTO_ERRORS = (ClientError, BotoCoreError, urllib3.exceptions.HTTPError)

#: Largest object one ``PutObject`` may carry (S3's limit), so the most ``put_if_absent`` stores.
MAX_SINGLE_PUT_BYTES = 5 * 1024**3


class S3Storage(RetryingStorage):
    """Objects under ``s3://bucket/prefix``.

    Args:
        bucket: bucket name; the bucket must exist.
        prefix: key prefix without leading/trailing ``/``; may be empty. Object ``k`` is
            stored as ``prefix/k``.
        options: transfer, retry and connection options (defaults if ``None``).
        client: a ready boto3 S3 client to use instead of building one from ``options``
            (tests wrap a client to inject faults).

    Raises:
        ConfigError: bad bucket, prefix or options.
    """

    unfinished_upload_kind = "multipart upload"
    commit_requirement = "conditional writes (PutObject with If-None-Match: *)"
    commit_advice = "use a store that enforces them (AWS S3, MinIO, Ceph RGW), or upgrade this store or its gateway"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        options: S3Options | None = None,
        *,
        client: Any = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"bad S3 bucket name {bucket!r}")
        bucket_, prefix_ = parse_s3_uri(f"s3://{bucket}/{prefix}")
        self._bucket = bucket_
        self._prefix = prefix_
        self._options = options or S3Options()
        super().__init__(self._options, is_retryable)
        self._client = client if client is not None else make_client(self._options)

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> S3Storage:
        """``S3Storage`` for ``s3://bucket[/prefix]``; ``options`` are :class:`S3Options` fields.

        Raises:
            ConfigError: a malformed URI or an unknown/out-of-range option.
        """
        bucket, prefix = parse_s3_uri(uri)
        return cls(bucket, prefix, S3Options.from_kwargs(**options))

    @property
    def uri(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"

    @property
    def commit_primitive(self) -> str:
        return "conditional PutObject (If-None-Match: *)"

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return self._bucket

    @property
    def client(self) -> Any:
        """The boto3 S3 client in use."""
        return self._client

    # --- plumbing ---------------------------------------------------------------

    def _what(self, operation: str, key: str) -> str:
        return f"{operation} s3://{self._bucket}/{self._name(key)}"

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except _BOTO_ERRORS as exc:
            raise translate(exc, what=what, bucket=self._bucket) from exc

    def _transfer_kwargs(self) -> dict[str, Any]:
        return {
            "part_size_bytes": self._options.part_size_bytes,
            "max_concurrency": self._options.max_concurrency,
        }

    # --- hooks ------------------------------------------------------------------

    def _put(self, key: str, data: memoryview) -> None:
        if len(data) >= self._options.multipart_threshold_bytes:
            self._put_stream(key, s3_transfer.MemorySource(data), self._options.part_size_bytes, None)
            return
        what = self._what("put", key)
        call = self._caller(what)
        body = bytes(data)
        with self._translated(what):
            call(
                lambda: self._client.put_object(Bucket=self._bucket, Key=self._name(key), Body=body),
                what,
            )

    def _put_stream(self, key: str, source: ByteSource, chunk_bytes: int, on_chunk: ChunkCallback | None) -> None:
        what = self._what("put", key)
        call = self._caller(what)
        with self._translated(what):
            if source.size_bytes >= self._options.multipart_threshold_bytes:
                s3_transfer.upload_stream(
                    self._client,
                    call,
                    bucket=self._bucket,
                    key=self._name(key),
                    source=source,
                    chunk_bytes=chunk_bytes,
                    on_chunk=on_chunk,
                    part_size_bytes=upload_part_size(
                        source.size_bytes, self._options, S3_LIMITS, chunk_bytes=chunk_bytes
                    ),
                    max_concurrency=self._options.max_concurrency,
                )
            else:
                s3_transfer.put_from_source(
                    self._client,
                    call,
                    bucket=self._bucket,
                    key=self._name(key),
                    source=source,
                    chunk_bytes=chunk_bytes,
                    on_chunk=on_chunk,
                )

    def _put_if_absent(self, key: str, data: memoryview) -> None:
        what = self._what("put_if_absent", key)
        if len(data) > MAX_SINGLE_PUT_BYTES:
            raise StorageError(
                errno.EFBIG,
                f"{what}: {len(data)} bytes is more than one conditional PutObject may carry "
                f"({MAX_SINGLE_PUT_BYTES} bytes, S3's single-PUT limit); a multipart upload "
                "cannot commit without risking an overwrite on every store",
            )
        call = self._caller(what)
        attempts = 0
        body = bytes(data)

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            self._client.put_object(Bucket=self._bucket, Key=self._name(key), Body=body, IfNoneMatch="*")

        try:
            with self._translated(what):
                call(attempt, what)
        except StorageError as exc:
            cause = exc.__cause__
            if is_not_implemented(cause):
                raise CommitUnsupportedError(
                    errno.EOPNOTSUPP,
                    f"{what}: the store does not support conditional writes: it answered "
                    "501 NotImplemented to a PutObject with If-None-Match: *, which spotrun "
                    "needs to commit a step without overwriting another writer's. Upgrade the "
                    "store (or its gateway) to a version that supports conditional writes "
                    "(AWS S3, MinIO and recent Ceph RGW do), or use a local or other S3 store",
                ) from cause
            if not (is_precondition_failed(cause) or is_conditional_conflict(cause)):
                raise
            if attempts > 1 and self._own_earlier_attempt_landed(key, body):
                return
            raise ObjectExistsError(errno.EEXIST, f"{what}: the object already exists") from cause

    def _get(self, key: str) -> bytes:
        what = self._what("get", key)
        call = self._caller(what)
        with self._translated(what):
            return s3_download.download(
                self._client,
                call,
                bucket=self._bucket,
                key=self._name(key),
                **self._transfer_kwargs(),
            )

    def _read_into(self, key: str, offset: int, views: list[memoryview]) -> None:
        what = self._what("read", key)
        total = sum(len(v) for v in views)
        if offset < 0:
            raise StorageError(errno.EINVAL, f"{what}: negative offset {offset}")
        if total == 0:  # nothing to fetch; the object must still exist and reach offset
            size = self._stat(key).size_bytes
            if offset > size:
                raise ObjectTooShortError(errno.EIO, f"{what}: offset {offset} is past its end ({size} bytes)")
            return
        call = self._caller(what)
        with self._translated(what):
            s3_download.read_into(
                self._client,
                call,
                bucket=self._bucket,
                key=self._name(key),
                offset=offset,
                views=views,
                part_size_bytes=ranged_read_size(self._options),
                max_concurrency=self._options.max_concurrency,
            )

    def _stat(self, key: str) -> ObjectInfo:
        what = self._what("stat", key)
        call = self._caller(what)
        with self._translated(what):
            head = call(lambda: self._client.head_object(Bucket=self._bucket, Key=self._name(key)), what)
        return ObjectInfo(key=key, size_bytes=int(head["ContentLength"]), mtime_s=head["LastModified"].timestamp())

    def _list(self, prefix: str) -> list[ObjectInfo]:
        root = self._root()
        what = f"list s3://{self._bucket}/{root}{prefix}"
        call = self._caller(what)
        request: dict[str, Any] = {"Bucket": self._bucket, "Prefix": root + prefix}
        infos: list[ObjectInfo] = []
        with self._translated(what):
            while True:
                page = call(lambda kwargs=dict(request): self._client.list_objects_v2(**kwargs), what)
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(root) :]
                    if not key or key.endswith("/"):  # "directory" markers made by consoles
                        continue
                    infos.append(
                        ObjectInfo(
                            key=key,
                            size_bytes=int(obj["Size"]),
                            mtime_s=obj["LastModified"].timestamp(),
                        )
                    )
                if not page.get("IsTruncated"):
                    return infos
                request["ContinuationToken"] = page["NextContinuationToken"]

    def _delete(self, key: str) -> None:
        what = self._what("delete", key)
        call = self._caller(what)
        with self._translated(what):
            call(lambda: self._client.delete_object(Bucket=self._bucket, Key=self._name(key)), what)

    def _unfinished_uploads(self, prefix: str) -> list[UnfinishedUpload]:
        """Multipart uploads under the prefix never completed or aborted
        (``ListMultipartUploads``, every page)."""
        root = self._root()
        what = f"list multipart uploads s3://{self._bucket}/{root}{prefix}"
        call = self._caller(what)
        request: dict[str, Any] = {"Bucket": self._bucket, "Prefix": root + prefix}
        uploads: list[UnfinishedUpload] = []
        with self._translated(what):
            while True:
                page = call(lambda kwargs=dict(request): self._client.list_multipart_uploads(**kwargs), what)
                for upload in page.get("Uploads", []):
                    uploads.append(
                        UnfinishedUpload(
                            key=upload["Key"][len(root) :],
                            time_unix_s=upload["Initiated"].timestamp(),
                            upload_id=upload["UploadId"],
                        )
                    )
                if not page.get("IsTruncated"):
                    return uploads
                request["KeyMarker"] = page["NextKeyMarker"]
                request["UploadIdMarker"] = page["NextUploadIdMarker"]

    def _abort_upload(self, upload: UnfinishedUpload) -> None:
        what = self._what("abort multipart upload", upload.key)
        if upload.upload_id is None:
            raise StorageError(errno.EINVAL, f"{what}: no upload id")
        call = self._caller(what)
        try:
            with self._translated(what):
                call(
                    lambda: self._client.abort_multipart_upload(
                        Bucket=self._bucket, Key=self._name(upload.key), UploadId=upload.upload_id
                    ),
                    what,
                )
        except ObjectNotFoundError:  # NoSuchUpload: completed or aborted meanwhile
            pass

"""How big the parts of an upload and the units of a ranged read are on the object stores: one rule
for S3, GCS and Azure, each store's limits respected, and the requests that follow from it.

Pure functions of the sizes and the options, so a scale model can count a save's and a restore's
requests without a store. The rule and its derivation (the request bound, the parallelism, the
memory it costs): ``docs/design/storage.md`` (Requests that scale).
"""

from __future__ import annotations

from dataclasses import dataclass

from spotrun.errors import ConfigError
from spotrun.storage.options import MIB, ObjectStoreOptions

GIB = 1024 * MIB


@dataclass(frozen=True)
class PartLimits:
    """What one store allows of the parts of one object.

    Attributes:
        store: ``"s3"``, ``"gcs"`` or ``"azure"`` (which requests an upload makes there).
        min_part_bytes: smallest part but the last.
        max_part_bytes: largest part.
        max_parts: most parts of one object.
    """

    store: str
    min_part_bytes: int
    max_part_bytes: int
    max_parts: int


#: S3: parts of 5 MiB to 5 GiB (the last may be smaller), at most 10,000 of them.
S3_LIMITS = PartLimits("s3", 5 * MIB, 5 * GIB, 10_000)
#: GCS: at most 32 sources per compose request, so 1,024 parts in two levels; a part is an
#: object (up to 5 TiB).
GCS_COMPOSE_SOURCES = 32
GCS_LIMITS = PartLimits("gcs", 1, 5 * 1024 * GIB, GCS_COMPOSE_SOURCES * GCS_COMPOSE_SOURCES)
#: Azure: staged blocks of up to 4,000 MiB, at most 50,000 committed blocks per blob.
AZURE_LIMITS = PartLimits("azure", 1, 4000 * MIB, 50_000)

_DEFAULTS = ObjectStoreOptions()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def upload_part_size(
    size_bytes: int,
    options: ObjectStoreOptions | None = None,
    limits: PartLimits = S3_LIMITS,
    *,
    chunk_bytes: int = 1,
) -> int:
    """Bytes per part of a parallel upload of ``size_bytes``.

    ``ceil(size / max_concurrency)`` (every stream busy once), at least ``part_size_bytes`` and
    at most ``max_part_size_bytes``; then grown where the store needs it (its smallest part, its
    part count) and rounded up to a multiple of ``chunk_bytes``.

    Raises:
        ConfigError: the object cannot be stored in parts this store allows.
    """
    options = options or _DEFAULTS
    cap = max(options.max_part_size_bytes, options.part_size_bytes)
    wanted = min(max(_ceil_div(size_bytes, options.max_concurrency), options.part_size_bytes), cap)
    needed = max(limits.min_part_bytes, _ceil_div(size_bytes, limits.max_parts), 1)  # the store's
    part = _ceil_div(max(wanted, needed), chunk_bytes) * chunk_bytes
    if part > limits.max_part_bytes:  # rounded past the largest part: the largest whole chunks
        part = limits.max_part_bytes // chunk_bytes * chunk_bytes
    if part < needed:
        raise ConfigError(
            f"an object of {size_bytes} bytes does not fit {limits.store}'s {limits.max_parts} parts of at most "
            f"{limits.max_part_bytes} bytes (in whole chunks of {chunk_bytes} bytes)"
        )
    return part


@dataclass(frozen=True)
class UploadRequests:
    """The requests one upload makes, by kind (retries not counted).

    Attributes:
        part_size_bytes: bytes per part (0: one request below the multipart threshold).
        puts: single-request uploads (S3 ``PutObject``, GCS upload, Azure ``Put Blob``).
        creates: S3 ``CreateMultipartUpload``.
        parts: S3 ``UploadPart``, GCS part uploads, Azure ``Put Block``.
        composes: GCS compose requests (of 32 parts at most each).
        completes: S3 ``CompleteMultipartUpload``, Azure ``Put Block List``.
        deletes: GCS deletions of the parts and the intermediate composes.
    """

    part_size_bytes: int = 0
    puts: int = 0
    creates: int = 0
    parts: int = 0
    composes: int = 0
    completes: int = 0
    deletes: int = 0

    @property
    def total(self) -> int:
        """Every request of the upload."""
        return self.puts + self.creates + self.parts + self.composes + self.completes + self.deletes


def upload_requests(
    size_bytes: int,
    options: ObjectStoreOptions | None = None,
    limits: PartLimits = S3_LIMITS,
    *,
    chunk_bytes: int = 1,
) -> UploadRequests:
    """The requests :meth:`~spotrun.storage.base.Storage.put_stream` makes for an object of
    ``size_bytes`` on the store of ``limits`` (one request below ``multipart_threshold_bytes``).

    Raises:
        ConfigError: as :func:`upload_part_size`.
    """
    options = options or _DEFAULTS
    if size_bytes < options.multipart_threshold_bytes:
        return UploadRequests(puts=1)
    part = upload_part_size(size_bytes, options, limits, chunk_bytes=chunk_bytes)
    parts = max(1, _ceil_div(size_bytes, part))
    if limits.store == "gcs":  # parts, composed 32 at a time into intermediates, then deleted
        intermediates = _ceil_div(parts, GCS_COMPOSE_SOURCES) if parts > GCS_COMPOSE_SOURCES else 0
        return UploadRequests(
            part_size_bytes=part, parts=parts, composes=intermediates + 1, deletes=parts + intermediates
        )
    if limits.store == "azure":
        return UploadRequests(part_size_bytes=part, parts=parts, completes=1)
    return UploadRequests(part_size_bytes=part, creates=1, parts=parts, completes=1)


def read_unit_size(total_bytes: int, options: ObjectStoreOptions | None = None, *, floor_bytes: int) -> int:
    """Bytes per unit of a reader that reads ``total_bytes`` in parallel ranged reads of its own
    (``max_concurrency`` at once), one request each: ``ceil(total / max_concurrency)``, at least
    ``floor_bytes`` and at most ``max_part_size_bytes`` (never below ``floor_bytes``), rounded up
    to a multiple of ``floor_bytes``."""
    options = options or _DEFAULTS
    cap = max(options.max_part_size_bytes, floor_bytes)
    wanted = min(max(_ceil_div(total_bytes, options.max_concurrency), floor_bytes), cap)
    return min(_ceil_div(wanted, floor_bytes) * floor_bytes, cap // floor_bytes * floor_bytes)


def read_requests(total_bytes: int, options: ObjectStoreOptions | None = None, *, floor_bytes: int) -> int:
    """The ranged GETs of reading ``total_bytes`` of one object in units of
    :func:`read_unit_size` (a reader over several objects cuts each object's bytes apart)."""
    if total_bytes <= 0:
        return 0
    return _ceil_div(total_bytes, read_unit_size(total_bytes, options, floor_bytes=floor_bytes))


def ranged_read_size(options: ObjectStoreOptions | None = None) -> int:
    """Most bytes one GET of :meth:`~spotrun.storage.base.Storage.read_into` asks for: a range up
    to ``max_part_size_bytes`` is one request (a reader sizes its units so), a longer one is cut
    into ranges of that size, fetched in parallel."""
    options = options or _DEFAULTS
    return max(options.max_part_size_bytes, options.part_size_bytes)

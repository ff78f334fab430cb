"""The scale model's one place that asks the storage how many requests a transfer takes and under
which key an object lies. Each answer comes from the functions the backend itself uses, so a change
to them changes every figure at once.

- :meth:`Store.upload_requests`: an object of N bytes written by ``put_stream`` (shard files, in
  checksum chunks) or ``put`` (index files): :func:`spotrun.storage.part_sizes.upload_requests`
  with S3's limits, as ``S3Storage._put_stream`` sizes its parts (``upload_part_size``).
- :meth:`Store.commit_requests`: the manifest's conditional ``PutObject`` (``put_if_absent``).
- :meth:`Store.read_unit_bytes`: the unit a restore's ``ChunkReader`` reads in
  (``Storage.read_unit_bytes``: :func:`~spotrun.storage.part_sizes.read_unit_size` on S3, the
  checksum chunk on files); :meth:`Store.ranged_get_requests`: GETs of one ranged read
  (``s3_download.read_into``: ``part_ranges(N, ranged_read_size())``);
  :meth:`Store.whole_get_requests`: a whole object (``s3_download.download``: parts of
  ``part_size_bytes``).
- :attr:`Store.key_layout` and :meth:`Store.key`: where rank r's file f of step s lies
  (``spreads_rank_keys(world_size)``, as rank 0 decides in ``save._agree``;
  :func:`spotrun.checkpoint.layout.data_file_key`); :meth:`Store.prefix`: the part of a key that
  S3's request rates are per (its first component: ``step-N/``, or a spread prefix ``NN/``).
"""

from __future__ import annotations

from collections import Counter

from spotrun.checkpoint.key_layout import SpreadLayout
from spotrun.checkpoint.layout import SPREAD_DIGITS, data_file_key, manifest_key
from spotrun.checkpoint.stream import CHECKSUM_CHUNK_BYTES
from spotrun.storage.part_sizes import S3_LIMITS, ranged_read_size, read_unit_size, upload_requests
from spotrun.storage.s3_config import S3Options
from spotrun.storage.transfer import part_ranges

#: Kinds of save requests, in the order they are printed.
SAVE_REQUEST_KINDS = ("single_puts", "multipart_creates", "parts", "completes", "conditional_puts")


class Store:
    """Requests and keys of one kind of storage for a job of ``world_size`` ranks: ``"s3"`` (the
    S3 backend with its default options) or ``"files"`` (a directory or the fast tier: one write
    per file, reads in checksum chunks, one key prefix)."""

    def __init__(self, kind: str, world_size: int) -> None:
        if kind not in ("s3", "files"):
            raise ValueError(f"unknown store {kind!r}")
        self.kind = kind
        self.options = S3Options() if kind == "s3" else None
        spread = self.options is not None and self.options.spreads_rank_keys(world_size)
        self.key_layout: SpreadLayout | None = SpreadLayout(SPREAD_DIGITS) if spread else None

    def upload_requests(self, size_bytes: int, *, streamed: bool) -> Counter:
        """Requests that write one object of ``size_bytes`` (``streamed``: by ``put_stream`` in
        checksum chunks, as shard files are; else by ``put``, which streams a large object in
        chunks of ``part_size_bytes``)."""
        if self.options is None:
            return Counter(single_puts=1)
        chunk_bytes = CHECKSUM_CHUNK_BYTES if streamed else self.options.part_size_bytes
        asked = upload_requests(size_bytes, self.options, S3_LIMITS, chunk_bytes=chunk_bytes)
        return +Counter(
            single_puts=asked.puts, multipart_creates=asked.creates, parts=asked.parts, completes=asked.completes
        )

    def commit_requests(self, size_bytes: int) -> Counter:
        """Requests of the manifest's commit (one conditional ``PutObject``; ``put_if_absent``)."""
        return Counter(conditional_puts=1)

    def read_unit_bytes(self, total_bytes: int, floor_bytes: int) -> int:
        """The read unit of a reader that reads ``total_bytes`` (``Storage.read_unit_bytes``)."""
        if self.options is None:
            return floor_bytes
        return read_unit_size(total_bytes, self.options, floor_bytes=floor_bytes)

    def ranged_get_requests(self, size_bytes: int) -> int:
        """GETs of one ranged read of ``size_bytes``."""
        if self.options is None:
            return 1
        return max(1, len(part_ranges(size_bytes, ranged_read_size(self.options))))

    def whole_get_requests(self, size_bytes: int) -> int:
        """GETs of a whole object of ``size_bytes``."""
        if self.options is None:
            return 1
        return max(1, len(part_ranges(size_bytes, self.options.part_size_bytes)))

    def key(self, step: int, rank: int, path: str) -> str:
        """The key (under the root) of data file or index ``path`` that ``rank`` wrote for ``step``."""
        return data_file_key(step, rank, path, self.key_layout)

    def manifest_key(self, step: int, incarnation: int) -> str:
        """The key of the manifest (always in the step directory)."""
        return manifest_key(step, incarnation)

    def prefix(self, key: str) -> str:
        """The prefix of ``key`` that shares a request-rate partition with its neighbours: its
        first component (S3 partitions a bucket by key ranges; the spread layout's point is that
        the first characters after the root differ between ranks)."""
        return key.partition("/")[0] + "/"

"""The scale model's one place that asks the storage how many requests a transfer takes and under
which key an object lies. Each answer comes from the functions the backend itself uses, so pointing
these at new ones (part sizes that grow, a spread key layout) changes every figure at once.

- :meth:`Store.upload_requests`: an object of N bytes written by ``put_stream`` (shard files) or
  ``put`` (index files): one ``PutObject`` under the multipart threshold, else a multipart upload
  of :func:`spotrun.storage.s3_transfer.stream_part_size` parts (``S3Storage._put_stream``).
- :meth:`Store.commit_requests`: the manifest's conditional ``PutObject`` (``put_if_absent``).
- :meth:`Store.ranged_get_requests`: ranged GETs of one read of N bytes (``s3_download.read_into``:
  ``part_ranges(N, part_size_bytes)``); :meth:`Store.whole_get_requests`: a whole object
  (``s3_download.download``: one GET per part, one for an empty object).
- :meth:`Store.key`: the key of rank r's file f of step s (:func:`spotrun.checkpoint.layout.file_key`);
  :meth:`Store.prefix`: the key prefix whose request rate the store limits (today every key of a
  step shares ``step-N/``).
"""

from __future__ import annotations

from collections import Counter

from spotrun.checkpoint.layout import file_key
from spotrun.checkpoint.stream import CHECKSUM_CHUNK_BYTES
from spotrun.storage.s3_config import S3Options
from spotrun.storage.s3_transfer import stream_part_size
from spotrun.storage.transfer import part_ranges

#: Kinds of save requests, in the order they are printed.
SAVE_REQUEST_KINDS = ("single_puts", "multipart_creates", "parts", "completes", "conditional_puts")


class Store:
    """Requests and keys of one kind of storage: ``"s3"`` (the S3 backend with its default
    options) or ``"files"`` (a directory or the fast tier: one write per file, one read per read)."""

    def __init__(self, kind: str) -> None:
        if kind not in ("s3", "files"):
            raise ValueError(f"unknown store {kind!r}")
        self.kind = kind
        self.options = S3Options() if kind == "s3" else None

    def upload_requests(self, size_bytes: int, *, streamed: bool) -> Counter:
        """Requests that write one object of ``size_bytes`` (``streamed``: by ``put_stream`` in
        checksum chunks, as shard files are; else by ``put``)."""
        if self.options is None or size_bytes < self.options.multipart_threshold_bytes:
            return Counter(single_puts=1)
        chunk_bytes = CHECKSUM_CHUNK_BYTES if streamed else self.options.part_size_bytes
        part_bytes = stream_part_size(size_bytes, self.options.part_size_bytes, chunk_bytes)
        return Counter(multipart_creates=1, parts=len(part_ranges(size_bytes, part_bytes)), completes=1)

    def commit_requests(self, size_bytes: int) -> Counter:
        """Requests of the manifest's commit (one conditional ``PutObject``; ``put_if_absent``)."""
        return Counter(conditional_puts=1)

    def ranged_get_requests(self, size_bytes: int) -> int:
        """GETs of one ranged read of ``size_bytes``."""
        if self.options is None:
            return 1
        return max(1, len(part_ranges(size_bytes, self.options.part_size_bytes)))

    def whole_get_requests(self, size_bytes: int) -> int:
        """GETs of a whole object of ``size_bytes``."""
        return self.ranged_get_requests(size_bytes)

    def key(self, step: int, rank: int, path: str) -> str:
        """The key (under the root) of file ``path`` that ``rank`` wrote for ``step``."""
        return file_key(step, path)

    def prefix(self, key: str) -> str:
        """The prefix of ``key`` that shares a request-rate partition with its neighbours."""
        return key.rpartition("/")[0] + "/"

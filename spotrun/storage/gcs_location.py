"""A Google Cloud Storage checkpoint root, ``gs://bucket[/prefix]``.

Imports no Google library: the backend (:mod:`spotrun.storage.gcs`, the ``spotrun[gcs]`` extra)
is imported when the root is opened; a missing extra is one clear line at parse time.
"""

from __future__ import annotations

import re
from typing import Any

from spotrun.control import env as spotrun_env
from spotrun.errors import ConfigError
from spotrun.storage.base import Storage
from spotrun.storage.location import ObjectStoreLocation, module_installed

#: GCS bucket names: 3-63 characters of lowercase letters, digits, ``-``, ``_`` and ``.``
#: (dotted names up to 222), starting and ending with a letter or digit.
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")

MISSING_EXTRA = "gs:// checkpoint roots need Google's client library: pip install 'spotrun[gcs]'"


def parse_gs_uri(uri: str) -> tuple[str, str]:
    """Split ``gs://bucket/some/prefix/`` into ``("bucket", "some/prefix")``.

    Raises:
        ConfigError: not a ``gs://`` URI, a bad bucket name, or an empty/``.``/``..`` component.
    """
    if not uri.startswith("gs://"):
        raise ConfigError(f"not a gs:// URI: {uri!r}")
    bucket, _, prefix = uri[len("gs://") :].partition("/")
    if not bucket:
        raise ConfigError(f"GCS URI {uri!r} names no bucket")
    if not _BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"GCS URI {uri!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '-', '_' or '.')"
        )
    if prefix.startswith("/"):
        raise ConfigError(f"GCS URI {uri!r} has an empty path component (a '//' after the bucket)")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ConfigError(f"GCS URI {uri!r} has an empty, '.' or '..' path component")
    return bucket, prefix


class GCSLocation(ObjectStoreLocation):
    """``gs://bucket[/prefix]``; credentials and endpoint (``STORAGE_EMULATOR_HOST``) the Google
    way, inherited by the workers with the environment; ``--s3-endpoint-url`` does not apply."""

    scheme = "gs"

    def __init__(self, uri: str, *, endpoint_url: str | None = None) -> None:
        super().__init__(uri, endpoint_url=None)
        self.bucket, self.prefix = parse_gs_uri(uri)
        if not module_installed("google.cloud.storage"):
            raise ConfigError(MISSING_EXTRA)

    def open(self, *, timeout_s: float | None = None, **options: Any) -> Storage:
        from spotrun.storage.gcs import GCSStorage

        given: dict[str, Any] = {}
        if timeout_s is not None:
            given.update(connect_timeout_s=min(3.0, timeout_s), read_timeout_s=timeout_s, retry_deadline_s=timeout_s)
        return GCSStorage.from_uri(self.uri, **{**given, **options})

    def worker_env(self) -> dict[str, str]:
        return {spotrun_env.CHECKPOINT_URI: self.uri}

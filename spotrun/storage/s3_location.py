"""An S3 checkpoint root, ``s3://bucket[/prefix]``, and the endpoint that reaches it.

Imports no boto3: the backend (:mod:`spotrun.storage.s3`) is imported when the root is opened.
"""

from __future__ import annotations

from typing import Any

from spotrun.control import env as spotrun_env
from spotrun.errors import ConfigError
from spotrun.storage.base import Storage
from spotrun.storage.location import ObjectStoreLocation

#: boto3's variable for the S3 endpoint, set for the workers; it wins over ``AWS_ENDPOINT_URL``
#: and touches no other AWS service the training script may use.
S3_ENDPOINT_URL = "AWS_ENDPOINT_URL_S3"
#: Connect timeout of one request when the root is opened with a ``timeout_s`` (a quick check),
#: in seconds; a shorter ``timeout_s`` lowers it.
QUICK_CONNECT_TIMEOUT_S = 3.0


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix/`` into ``("bucket", "some/prefix")``.

    Raises:
        ConfigError: not an ``s3://`` URI, no bucket, or an empty/``..`` prefix component.
    """
    if not uri.startswith("s3://"):
        raise ConfigError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError(f"S3 URI {uri!r} names no bucket")
    if prefix.startswith("/"):
        raise ConfigError(f"S3 URI {uri!r} has an empty path component (a '//' after the bucket)")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ConfigError(f"S3 URI {uri!r} has an empty, '.' or '..' path component")
    return bucket, prefix


class S3Location(ObjectStoreLocation):
    """``s3://bucket[/prefix]``; the endpoint (MinIO, R2, moto) overrides boto3's standard
    settings (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, AWS itself)."""

    scheme = "s3"

    def __init__(self, uri: str, *, endpoint_url: str | None = None) -> None:
        super().__init__(uri, endpoint_url=endpoint_url)
        self.bucket, self.prefix = parse_s3_uri(uri)

    def open(self, *, timeout_s: float | None = None, **options: Any) -> Storage:
        from spotrun.storage.s3 import S3Storage

        given: dict[str, Any] = {"endpoint_url": self.endpoint_url} if self.endpoint_url else {}
        if timeout_s is not None:
            given.update(
                connect_timeout_s=min(QUICK_CONNECT_TIMEOUT_S, timeout_s),
                read_timeout_s=timeout_s,
                retry_deadline_s=timeout_s,
            )
        return S3Storage.from_uri(self.given_uri, **{**given, **options})

    def worker_env(self) -> dict[str, str]:
        # The URI as the user gave it: the workers parse it as the supervisor did.
        env = {spotrun_env.CHECKPOINT_URI: self.given_uri}
        if self.endpoint_url:
            env[S3_ENDPOINT_URL] = self.endpoint_url
        return env

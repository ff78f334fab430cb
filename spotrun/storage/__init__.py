"""Checkpoint storage: one interface, a backend per URI scheme.

``open_storage("./checkpoints")`` or ``open_storage("/abs/dir")`` or ``file:///abs/dir``
gives a :class:`LocalStorage`; ``s3://bucket/prefix`` gives the S3 backend, imported
lazily so that local use never imports boto3.
"""

from __future__ import annotations

from spotrun.errors import ConfigError
from spotrun.storage.base import ObjectInfo, Storage
from spotrun.storage.local import LocalStorage

__all__ = ["ObjectInfo", "Storage", "LocalStorage", "open_storage"]


def open_storage(uri: str, **options) -> Storage:
    """Return the backend for ``uri``.

    Args:
        uri: a local path, ``file://`` URI, or ``s3://bucket[/prefix]``.
        **options: backend-specific keyword arguments.

    Raises:
        ConfigError: empty URI or an unsupported scheme.
    """
    if not uri or not uri.strip():
        raise ConfigError("checkpoint URI is empty")
    uri = uri.strip()
    if uri.startswith("file://"):
        return LocalStorage(uri[len("file://") :], **options)
    if uri.startswith("s3://"):
        from spotrun.storage.s3 import S3Storage

        return S3Storage.from_uri(uri, **options)
    if "://" in uri:
        raise ConfigError(
            f"unsupported checkpoint URI scheme in {uri!r}: use a local path, file:// or s3://"
        )
    return LocalStorage(uri, **options)

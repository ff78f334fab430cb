"""Checkpoint storage: one interface (:mod:`.base`), a backend per URI scheme (local directory,
S3-compatible), chosen by :func:`parse_location` / :func:`open_storage`; the S3 backend is
imported lazily so that local use never imports boto3.

Torch-free. May import tools and control.
"""

from __future__ import annotations

from spotrun.storage.base import ObjectInfo, Storage
from spotrun.storage.local import LocalStorage
from spotrun.storage.location import StorageLocation, parse_location

__all__ = ["ObjectInfo", "Storage", "LocalStorage", "StorageLocation", "open_storage", "parse_location"]


def open_storage(uri: str, **options) -> Storage:
    """Return the backend for ``uri``.

    Args:
        uri: a local path, ``file://`` URI, or ``s3://bucket[/prefix]``.
        **options: backend-specific keyword arguments.

    Raises:
        ConfigError: empty URI or an unsupported scheme.
    """
    return parse_location(uri).open(**options)

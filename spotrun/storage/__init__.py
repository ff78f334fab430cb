"""Checkpoint storage: one interface, a backend per URI scheme.

``open_storage("./checkpoints")`` or ``open_storage("/abs/dir")`` or ``file:///abs/dir``
gives a :class:`LocalStorage`; ``s3://bucket/prefix`` gives the S3 backend, imported
lazily so that local use never imports boto3. :func:`parse_location` gives the
:class:`StorageLocation` of a URI, which answers the questions that depend on the backend
(its registry, :data:`~spotrun.storage.location.BACKENDS`, maps schemes to backends).
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

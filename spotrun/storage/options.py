"""The transfer, retry and connection options every object store shares (S3, GCS, Azure), each
backend's options a subclass that adds its own (an endpoint, a project) and its own limits."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from spotrun.errors import ConfigError

MIB = 1024 * 1024

OptionsT = TypeVar("OptionsT", bound="ObjectStoreOptions")


@dataclass(frozen=True)
class ObjectStoreOptions:
    """Options of an object store backend; each may be passed to ``open_storage(uri, ...)`` as a
    keyword argument.

    Attributes:
        multipart_threshold_bytes: objects of at least this size are uploaded in parallel parts
            (S3 multipart parts, GCS composed parts, Azure staged blocks).
        part_size_bytes: bytes per uploaded part and per ranged read.
        max_concurrency: parts transferred at the same time by one call.
        retry_deadline_s: most seconds one operation spends retrying.
        connect_timeout_s: TCP/TLS connect timeout of one request, seconds.
        read_timeout_s: socket read timeout of one request, seconds.
        sleep: waits between retries (tests inject a fake so they never wait).
        clock: monotonic clock for deadlines, seconds (tests inject a fake).

    Raises:
        ConfigError: an out-of-range value.
    """

    #: The store's name in messages (``"S3"``).
    store: ClassVar[str] = "object store"

    multipart_threshold_bytes: int = 64 * MIB
    part_size_bytes: int = 16 * MIB
    max_concurrency: int = 8
    retry_deadline_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        for name in ("multipart_threshold_bytes", "part_size_bytes", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("retry_deadline_s", "connect_timeout_s", "read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_kwargs(cls: type[OptionsT], **options: Any) -> OptionsT:
        """Build options from keyword arguments; an unknown name is a :class:`ConfigError`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.store} storage option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)

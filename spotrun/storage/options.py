"""The transfer, retry and connection options every object store shares (S3, GCS, Azure), each
backend's options a subclass that adds its own (an endpoint, a project) and its own limits."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from spotrun.control import env as spotrun_env
from spotrun.errors import ConfigError

MIB = 1024 * 1024
#: Key layouts a root may be written with: ``spread`` puts each rank's files under a key prefix of
#: their own (:mod:`spotrun.checkpoint.layout`), ``step`` all of a step's under one; ``auto`` spreads
#: from :data:`SPREAD_FROM_WORLD_SIZE` ranks on.
KEY_LAYOUTS = ("auto", "spread", "step")
#: World size from which ``key_layout="auto"`` spreads the ranks' keys: below it a save's requests
#: fit one S3 partition's 3,500 writes per second even if they all came in the same second
#: (``docs/design/storage.md``, Requests that scale).
SPREAD_FROM_WORLD_SIZE = 256

OptionsT = TypeVar("OptionsT", bound="ObjectStoreOptions")


def key_layout_from_env() -> str:
    """``$SPOTRUN_KEY_LAYOUT`` (``spotrun run --key-layout`` sets it for the workers), else ``"auto"``.

    Raises:
        ConfigError: a value not in :data:`KEY_LAYOUTS`.
    """
    value = os.environ.get(spotrun_env.KEY_LAYOUT, "").strip() or "auto"
    if value not in KEY_LAYOUTS:
        raise ConfigError(f"${spotrun_env.KEY_LAYOUT} must be one of {list(KEY_LAYOUTS)}, got {value!r}")
    return value


@dataclass(frozen=True)
class ObjectStoreOptions:
    """Options of an object store backend; each may be passed to ``open_storage(uri, ...)`` as a
    keyword argument.

    Attributes:
        multipart_threshold_bytes: objects of at least this size are uploaded in parallel parts
            (S3 multipart parts, GCS composed parts, Azure staged blocks).
        part_size_bytes: smallest uploaded part (but the last), and the first ranged read of ``get``.
        max_part_size_bytes: largest uploaded part and largest ranged read (never below
            ``part_size_bytes``): parts grow from ``part_size_bytes`` with the object
            (:mod:`spotrun.storage.part_sizes`); an upload holds up to ``max_concurrency`` of them.
        max_concurrency: parts transferred at the same time by one call.
        key_layout: ``"auto"`` (spread from :data:`SPREAD_FROM_WORLD_SIZE` ranks on), ``"spread"``
            or ``"step"``: where a checkpoint's ranks put their files (see :data:`KEY_LAYOUTS`);
            default :func:`key_layout_from_env`.
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
    max_part_size_bytes: int = 64 * MIB
    max_concurrency: int = 8
    key_layout: str = field(default_factory=key_layout_from_env)
    retry_deadline_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        for name in ("multipart_threshold_bytes", "part_size_bytes", "max_part_size_bytes", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("retry_deadline_s", "connect_timeout_s", "read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.key_layout not in KEY_LAYOUTS:
            raise ConfigError(f"key_layout must be one of {list(KEY_LAYOUTS)}, got {self.key_layout!r}")

    def spreads_rank_keys(self, world_size: int) -> bool:
        """Whether a checkpoint saved by ``world_size`` ranks puts each rank's files under a key
        prefix of their own (``key_layout``)."""
        return spreads_rank_keys(self.key_layout, world_size)

    @classmethod
    def from_kwargs(cls: type[OptionsT], **options: Any) -> OptionsT:
        """Build options from keyword arguments; an unknown name is a :class:`ConfigError`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.store} storage option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


def spreads_rank_keys(key_layout: str, world_size: int) -> bool:
    """Whether ``key_layout`` (one of :data:`KEY_LAYOUTS`) spreads the keys of a save by
    ``world_size`` ranks over prefixes."""
    return key_layout == "spread" or (key_layout == "auto" and world_size >= SPREAD_FROM_WORLD_SIZE)

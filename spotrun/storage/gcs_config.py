"""Options of the GCS backend and construction of Google's client.

Credentials and the endpoint are resolved by Google's libraries themselves: Application Default
Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, a GCE/GKE service account or workload
identity, ``gcloud auth application-default login``), and ``STORAGE_EMULATOR_HOST`` for an
emulator (anonymous credentials then).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import google.auth.exceptions
from google.cloud import storage

from spotrun.errors import ConfigError
from spotrun.storage.gcs_errors import no_credentials_error
from spotrun.tools import private_random

MIB = 1024 * 1024
#: Most source objects one compose request may name (GCS's limit).
MAX_COMPOSE_SOURCES = 32
#: Most parts of one composite upload: two levels of composes.
MAX_PARTS = MAX_COMPOSE_SOURCES * MAX_COMPOSE_SOURCES

# google-cloud-storage draws each multipart upload's boundary from the global random generator
# (2.x: google.resumable_media), google-auth its backoff jitter: the training's generator, which a
# resume restores (spotrun.tools.private_random).
private_random.isolate(
    "google.cloud.storage._media._upload",
    "google.resumable_media._upload",
    "google.resumable_media._helpers",
    "google.cloud.storage._media._helpers",
    "google.auth._exponential_backoff",
)


@dataclass(frozen=True)
class GCSOptions:
    """Options of :class:`~spotrun.storage.gcs.GCSStorage`; each may be passed to
    ``open_storage(uri, ...)`` as a keyword argument.

    Attributes:
        project: the project billed for requests (``None``: ``GOOGLE_CLOUD_PROJECT``, else
            none; reading and writing objects needs no project).
        multipart_threshold_bytes: objects of at least this size are uploaded as parallel parts,
            composed into the object.
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

    project: str | None = None
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
    def from_kwargs(cls, **options: Any) -> GCSOptions:
        """Build options from keyword arguments; an unknown name is a :class:`ConfigError`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown GCS storage option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)

    @property
    def timeout(self) -> tuple[float, float]:
        """``(connect, read)`` timeouts of one request, as Google's client takes them."""
        return (self.connect_timeout_s, self.read_timeout_s)


def make_client(options: GCSOptions, *, what: str) -> Any:
    """A ``google.cloud.storage.Client`` with Application Default Credentials (anonymous ones
    against ``STORAGE_EMULATOR_HOST``).

    Raises:
        StoragePermissionError: no credentials were found (the message says where to put them).
    """
    project = options.project or os.environ.get("GOOGLE_CLOUD_PROJECT") or None
    try:
        return storage.Client(project=project)
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise no_credentials_error(what, exc) from exc

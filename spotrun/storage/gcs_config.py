"""Options of the GCS backend and construction of Google's client.

Credentials and the endpoint are resolved by Google's libraries themselves: Application Default
Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, a GCE/GKE service account or workload
identity, ``gcloud auth application-default login``), and ``STORAGE_EMULATOR_HOST`` for an
emulator (anonymous credentials then).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import google.auth.exceptions
from google.cloud import storage

from spotrun.storage.gcs_errors import no_credentials_error
from spotrun.storage.options import ObjectStoreOptions
from spotrun.storage.part_sizes import GCS_COMPOSE_SOURCES, GCS_LIMITS
from spotrun.tools import private_random

MIB = 1024 * 1024
#: Most source objects one compose request may name (GCS's limit).
MAX_COMPOSE_SOURCES = GCS_COMPOSE_SOURCES
#: Most parts of one composite upload: two levels of composes.
MAX_PARTS = GCS_LIMITS.max_parts

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
class GCSOptions(ObjectStoreOptions):
    """Options of :class:`~spotrun.storage.gcs.GCSStorage`: those of
    :class:`~spotrun.storage.options.ObjectStoreOptions` (parts are composed into the object), and

    Attributes:
        project: the project billed for requests (``None``: ``GOOGLE_CLOUD_PROJECT``, else
            none; reading and writing objects needs no project).
    """

    store: ClassVar[str] = "GCS"

    project: str | None = None

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

"""Where a checkpoint root is: one object per URI that answers every "which backend?" question.

``parse_location("s3://bucket/job", endpoint_url=...)`` picks the backend by the URI's
scheme from :data:`BACKENDS`; the :class:`StorageLocation` it returns opens the store,
names the environment the workers need to open the same root, says whether the store is
remote, and names a scratch root beside it. Code outside :mod:`spotrun.storage` asks it
instead of looking at the URI.

Adding a backend: a module with a :class:`~spotrun.storage.base.Storage` subclass and a
:class:`StorageLocation` subclass that opens it, plus one line in :data:`BACKENDS`.
"""

from __future__ import annotations

import abc
import errno
import importlib
import importlib.util
import re
import urllib.parse
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from spotrun.control import env as spotrun_env
from spotrun.errors import ConfigError, ObjectNotFoundError
from spotrun.storage.base import Storage

#: URI scheme -> ``"module:class"`` of its :class:`StorageLocation`, imported when a URI of that
#: scheme is parsed (so local use never imports boto3). A URI without a scheme is a ``file`` path.
BACKENDS: Mapping[str, str] = MappingProxyType(
    {
        "file": "spotrun.storage.local_location:LocalLocation",
        "s3": "spotrun.storage.s3_location:S3Location",
        "gs": "spotrun.storage.gcs_location:GCSLocation",
        "az": "spotrun.storage.azure_location:AzureLocation",
    }
)


@dataclass(frozen=True)
class ScratchSibling:
    """A new root beside a checkpoint root, for a throwaway run (the drill's reference run).

    Attributes:
        location: the new root (it holds no objects yet).
        temporary_dir: the local directory created for it, to be deleted whole afterwards;
            ``None`` where nothing was created (an object-store prefix).
    """

    location: StorageLocation
    temporary_dir: str | None = None


class StorageLocation(abc.ABC):
    """A checkpoint root named by a URI, with what it takes to reach it (an endpoint).

    Args:
        uri: the root's URI as the user gave it, scheme included (stripped of blanks).
        endpoint_url: the store's endpoint (``http://minio:9000``) for a backend that has one;
            ignored by the others; ``None``: the backend's standard settings.
    """

    #: True for a store reached over the network (an object store); False for a local directory.
    is_remote: ClassVar[bool] = False

    def __init__(self, uri: str, *, endpoint_url: str | None = None) -> None:
        self.given_uri = uri
        self.endpoint_url = endpoint_url or None

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """The root in one spelling (a local directory absolute, an S3 prefix without a trailing
        ``/``), as the opened :attr:`Storage.uri <spotrun.storage.base.Storage.uri>` names it."""

    @abc.abstractmethod
    def open(self, *, timeout_s: float | None = None, **options: Any) -> Storage:
        """The store under this root.

        Args:
            timeout_s: bound every request, retries included, to about this many seconds (a
                quick check such as the preflight); ``None``: the backend's own timeouts.
            **options: backend-specific keyword arguments (those of
                :class:`~spotrun.storage.local.LocalStorage`, or fields of
                :class:`~spotrun.storage.s3_config.S3Options`).

        Raises:
            ConfigError: an unknown or out-of-range option.
        """

    def worker_env(self) -> dict[str, str]:
        """The variables that let the launched workers open the same root
        (``SPOTRUN_CHECKPOINT_URI``, and the endpoint where one was given)."""
        return {spotrun_env.CHECKPOINT_URI: self.uri}

    @abc.abstractmethod
    def scratch_sibling(self, label: str) -> ScratchSibling:
        """A new root beside this one, named after ``label`` (``"drill-reference"``): a new
        temporary directory for a local root; ``<prefix>-<label>/<random>`` beside an object-store
        prefix (``spotrun-<label>/<random>`` in a bucket-wide root)."""

    def open_existing(self, *, check_objects: bool = True) -> Storage:
        """Open a root that must exist (as ``spotrun ls`` wants it): a local root exists when its
        directory does (an empty one too); an object-store prefix when something is stored under
        it, which takes a listing, skipped with ``check_objects=False`` by a caller that lists the
        root anyway (it calls :meth:`check_objects_exist` when its listing found nothing).

        Raises:
            ObjectNotFoundError: no such local directory, or nothing stored under the prefix.
        """
        storage = self.open()
        self._check_exists()
        if check_objects:
            self.check_objects_exist(storage)
        return storage

    def check_objects_exist(self, storage: Storage) -> None:
        """Raise :class:`~spotrun.errors.ObjectNotFoundError` when nothing is stored under a root
        that exists only through its objects (one listing); a no-op for a directory, whose
        existence :meth:`open_existing` checks."""

    def blocked_by_file(self) -> bool:
        """True when a file (not a root) sits where the root would be; never for an object store."""
        return False

    def _check_exists(self) -> None:
        """Raise :class:`~spotrun.errors.ObjectNotFoundError` when a root that exists without
        objects (a directory) is missing; called by :meth:`open_existing`."""

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"{type(self).__name__}({self.uri!r}{endpoint})"


class ObjectStoreLocation(StorageLocation):
    """A root in an object store, ``<scheme>://<bucket>[/<prefix>]``: it exists through its
    objects, and a sibling root is a prefix beside it. A subclass parses the URI into
    ``self.bucket`` and ``self.prefix`` (no leading or trailing ``/``) and names its ``scheme``."""

    is_remote = True
    scheme: ClassVar[str]
    bucket: str
    prefix: str

    @property
    def uri(self) -> str:
        base = f"{self.scheme}://{self.bucket}"
        return f"{base}/{self.prefix}" if self.prefix else base

    def scratch_sibling(self, label: str) -> ScratchSibling:
        random_name = uuid.uuid4().hex[:12]
        if self.prefix:
            sibling = f"{self.uri}-{label}/{random_name}"
        else:  # a bucket-wide root: there is no prefix to put a sibling beside
            sibling = f"{self.uri}/spotrun-{label}/{random_name}"
        return ScratchSibling(location=type(self)(sibling, endpoint_url=self.endpoint_url))

    def check_objects_exist(self, storage: Storage) -> None:
        if not storage.list(""):
            raise ObjectNotFoundError(errno.ENOENT, f"nothing is stored under {storage.uri} (no such prefix)")


def module_installed(name: str) -> bool:
    """Whether module ``name`` (an optional extra's, ``google.cloud.storage``) can be imported;
    asked without importing it, so that a root's scheme is checked at once and cheaply."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package (``google``, ``azure``) is missing too
        return False


def parse_location(uri: str, *, endpoint_url: str | None = None) -> StorageLocation:
    """The :class:`StorageLocation` of ``uri``, its backend chosen by the scheme (:data:`BACKENDS`).

    Args:
        uri: a local path, ``file://`` URI or ``s3://bucket[/prefix]``.
        endpoint_url: the ``--s3-endpoint-url`` option; ``None`` or ``""``: the standard settings.

    Raises:
        ConfigError: the endpoint is not an ``http://`` or ``https://`` URL (checked whatever the
            URI), the URI is empty, its scheme is not one of :data:`BACKENDS`, or its backend
            refuses it (an S3 URI without a bucket).
    """
    check_endpoint_url(endpoint_url)
    if not uri or not uri.strip():
        raise ConfigError("checkpoint URI is empty")
    uri = uri.strip()
    one_slash = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):/(?!/)", uri)
    if one_slash and one_slash.group(1).lower() in BACKENDS:
        # gs:/bucket would otherwise be a relative local directory named "gs:"
        scheme = one_slash.group(1).lower()
        raise ConfigError(f"checkpoint URI {uri!r} has one slash after '{scheme}:': write {scheme}://...")
    scheme, separator, _ = uri.partition("://")
    target = BACKENDS.get(scheme if separator else "file")
    if target is None:
        schemes = [f"{name}://" for name in BACKENDS]
        raise ConfigError(
            f"unsupported checkpoint URI scheme in {uri!r}: use a local path, "
            f"{', '.join(schemes[:-1])} or {schemes[-1]}"
        )
    module_name, _, class_name = target.partition(":")
    location_class = getattr(importlib.import_module(module_name), class_name)
    return location_class(uri, endpoint_url=endpoint_url)


def check_endpoint_url(endpoint_url: str | None) -> None:
    """Refuse an endpoint that is not an ``http://`` or ``https://`` URL (``None`` or ``""``: none given).

    Raises:
        ConfigError: the message names the option, ``--s3-endpoint-url`` (the YAML key
            ``s3_endpoint_url`` is the same option).
    """
    if not endpoint_url:
        return
    parts = urllib.parse.urlsplit(endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--s3-endpoint-url must be an http:// or https:// URL, got {endpoint_url!r}")

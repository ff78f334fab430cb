"""An Azure Blob Storage checkpoint root, ``az://container[/prefix]``.

Imports no Azure library: the backend (:mod:`spotrun.storage.azure`, the ``spotrun[azure]`` extra)
is imported when the root is opened; a missing extra is one clear line at parse time. The account
and credentials come from the environment (:mod:`spotrun.storage.azure_config`), which the workers
inherit.
"""

from __future__ import annotations

import re
from typing import Any

from spotrun.control import env as spotrun_env
from spotrun.errors import ConfigError
from spotrun.storage.base import Storage
from spotrun.storage.location import ObjectStoreLocation, module_installed

#: Azure container names: 3-63 lowercase letters, digits and single hyphens, starting and
#: ending with a letter or digit.
_CONTAINER_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}$")

MISSING_EXTRA = "az:// checkpoint roots need Azure's client library: pip install 'spotrun[azure]'"
#: Connect timeout of one request when the root is opened with a ``timeout_s`` (a quick check),
#: in seconds; a shorter ``timeout_s`` lowers it.
QUICK_CONNECT_TIMEOUT_S = 3.0


def parse_az_uri(uri: str) -> tuple[str, str]:
    """Split ``az://container/some/prefix/`` into ``("container", "some/prefix")``.

    Raises:
        ConfigError: not an ``az://`` URI, a bad container name, or an empty/``.``/``..`` component.
    """
    if not uri.startswith("az://"):
        raise ConfigError(f"not an az:// URI: {uri!r}")
    container, _, prefix = uri[len("az://") :].partition("/")
    if not container:
        raise ConfigError(f"Azure URI {uri!r} names no container")
    if not _CONTAINER_NAME.match(container):
        raise ConfigError(
            f"Azure URI {uri!r}: {container!r} is not a container name "
            "(3-63 lowercase letters, digits and single hyphens)"
        )
    if prefix.startswith("/"):
        raise ConfigError(f"Azure URI {uri!r} has an empty path component (a '//' after the container)")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ConfigError(f"Azure URI {uri!r} has an empty, '.' or '..' path component")
    return container, prefix


class AzureLocation(ObjectStoreLocation):
    """``az://container[/prefix]`` in the account the environment names; ``--s3-endpoint-url``
    does not apply (``AZURE_STORAGE_CONNECTION_STRING`` names an emulator's endpoint)."""

    scheme = "az"

    def __init__(self, uri: str, *, endpoint_url: str | None = None) -> None:
        super().__init__(uri, endpoint_url=None)
        self.bucket, self.prefix = parse_az_uri(uri)
        if not module_installed("azure.storage.blob"):
            raise ConfigError(MISSING_EXTRA)

    @property
    def container(self) -> str:
        """The container name."""
        return self.bucket

    def open(self, *, timeout_s: float | None = None, **options: Any) -> Storage:
        from spotrun.storage.azure import AzureStorage

        given: dict[str, Any] = {}
        if timeout_s is not None:
            given.update(
                connect_timeout_s=min(QUICK_CONNECT_TIMEOUT_S, timeout_s),
                read_timeout_s=timeout_s,
                retry_deadline_s=timeout_s,
            )
        return AzureStorage.from_uri(self.uri, **{**given, **options})

    def worker_env(self) -> dict[str, str]:
        # Credentials reach the workers through the environment they inherit.
        return {spotrun_env.CHECKPOINT_URI: self.uri}

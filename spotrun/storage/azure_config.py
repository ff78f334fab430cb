"""Options of the Azure backend and construction of Azure's client.

Credentials the Azure way: ``AZURE_STORAGE_CONNECTION_STRING`` when set (an account key, a SAS
or an emulator such as Azurite); otherwise the account named by ``AZURE_STORAGE_ACCOUNT`` with
``DefaultAzureCredential`` (managed identity, ``AZURE_CLIENT_ID``/``AZURE_TENANT_ID``/
``AZURE_CLIENT_SECRET``, workload identity, ``az login``) against
``https://<account>.blob.core.windows.net``, or against ``AZURE_STORAGE_BLOB_ENDPOINT`` where
that is set (a sovereign cloud, a private endpoint). The SDK's own retries are off: the
backend's :class:`~spotrun.storage.retry.RetryPolicy` is the only one.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from spotrun.errors import ConfigError, StoragePermissionError
from spotrun.storage.azure_location import MISSING_EXTRA

MIB = 1024 * 1024
#: Most bytes one Put Blob may carry (service versions since 2019-12-12), so the most
#: ``put_if_absent`` stores.
MAX_SINGLE_PUT_BYTES = 5000 * MIB
#: Most bytes one staged block may hold.
MAX_BLOCK_BYTES = 4000 * MIB
#: Most committed blocks one blob may have.
MAX_BLOCKS = 50_000

CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT"
ENDPOINT_ENV = "AZURE_STORAGE_BLOB_ENDPOINT"

#: The SDK logs every request and answer, headers included, at INFO: it gets this logger, quiet
#: unless its level is lowered (``logging.getLogger("spotrun.storage.azure.http").setLevel("INFO")``).
HTTP_LOG = logging.getLogger("spotrun.storage.azure.http")
HTTP_LOG.setLevel(logging.WARNING)

_ACCOUNT_NAME = re.compile(r"^[a-z0-9]{3,24}$")

NO_CREDENTIALS = (
    f"no Azure storage account or credentials: set {CONNECTION_STRING_ENV}, or set {ACCOUNT_ENV} to the "
    "account's name and give DefaultAzureCredential an identity (managed identity, AZURE_CLIENT_ID/"
    "AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or `az login`) with a Storage Blob Data role"
)
NO_IDENTITY = (
    "DefaultAzureCredential got no token: give it an identity (managed identity, AZURE_CLIENT_ID/AZURE_TENANT_ID/"
    f"AZURE_CLIENT_SECRET, or `az login`) with a Storage Blob Data role, or set {CONNECTION_STRING_ENV}"
)


@dataclass(frozen=True)
class AzureOptions:
    """Options of :class:`~spotrun.storage.azure.AzureStorage`; each may be passed to
    ``open_storage(uri, ...)`` as a keyword argument.

    Attributes:
        multipart_threshold_bytes: objects of at least this size are uploaded as blocks staged
            in parallel and committed with one block list.
        part_size_bytes: bytes per staged block and per ranged read (no minimum on Azure).
        max_concurrency: blocks or ranges transferred at the same time by one call.
        retry_deadline_s: most seconds one operation spends retrying.
        connect_timeout_s: TCP/TLS connect timeout of one request, seconds.
        read_timeout_s: socket read timeout of one request, seconds.
        sleep: waits between retries (tests inject a fake so they never wait).
        clock: monotonic clock for deadlines, seconds (tests inject a fake).

    Raises:
        ConfigError: an out-of-range value.
    """

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
        if self.part_size_bytes > MAX_BLOCK_BYTES:
            raise ConfigError(
                f"part_size_bytes must be <= {MAX_BLOCK_BYTES} (Azure's largest block), got {self.part_size_bytes}"
            )
        for name in ("retry_deadline_s", "connect_timeout_s", "read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_kwargs(cls, **options: Any) -> AzureOptions:
        """Build options from keyword arguments; an unknown name is a :class:`ConfigError`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown Azure storage option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


def account_url() -> str | None:
    """The blob endpoint for ``DefaultAzureCredential``: ``AZURE_STORAGE_BLOB_ENDPOINT``, else
    ``https://<AZURE_STORAGE_ACCOUNT>.blob.core.windows.net``; ``None`` when neither is set.

    Raises:
        ConfigError: ``AZURE_STORAGE_ACCOUNT`` is not an account name.
    """
    endpoint = os.environ.get(ENDPOINT_ENV, "").strip()
    if endpoint:
        if not endpoint.startswith("https://"):  # a bearer token never travels over plain http
            raise ConfigError(f"{ENDPOINT_ENV} must be an https:// URL, got {endpoint!r}")
        return endpoint.rstrip("/")
    account = os.environ.get(ACCOUNT_ENV, "").strip()
    if not account:
        return None
    if not _ACCOUNT_NAME.match(account):
        raise ConfigError(f"{ACCOUNT_ENV}={account!r} is not a storage account name (3-24 lowercase letters, digits)")
    return f"https://{account}.blob.core.windows.net"


def make_service(options: AzureOptions, *, what: str, **client_kwargs: Any) -> Any:
    """A ``BlobServiceClient`` with the SDK's retries off and the timeouts of ``options``.

    Args:
        what: the root, for messages.
        **client_kwargs: more keyword arguments for the client (tests pass ``raw_request_hook``).

    Raises:
        ConfigError: a malformed connection string or endpoint; the extra is missing.
        StoragePermissionError: neither a connection string nor an account is set.
    """
    from azure.storage.blob import BlobServiceClient

    kwargs: dict[str, Any] = {
        "retry_total": 0,  # RetryPolicy decides; the SDK must not retry underneath it
        "connection_timeout": options.connect_timeout_s,
        "read_timeout": options.read_timeout_s,
        # One request per Put Blob and per ranged read: the SDK never splits them itself.
        "max_single_put_size": MAX_SINGLE_PUT_BYTES,
        "max_single_get_size": options.part_size_bytes,
        "logger": HTTP_LOG,
        **client_kwargs,
    }
    connection_string = os.environ.get(CONNECTION_STRING_ENV, "").strip()
    if connection_string:
        try:
            return BlobServiceClient.from_connection_string(connection_string, **kwargs)
        except ValueError:  # the SDK's message may quote the string, which holds a secret
            raise ConfigError(f"{CONNECTION_STRING_ENV} is malformed (not 'Name=value;...' with an account)") from None
    url = account_url()
    if url is None:
        raise StoragePermissionError(errno.EACCES, f"{what}: {NO_CREDENTIALS}")
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:
        raise ConfigError(MISSING_EXTRA) from exc
    return BlobServiceClient(url, credential=DefaultAzureCredential(), **kwargs)

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
from dataclasses import dataclass
from typing import Any, ClassVar

from spotrun.errors import ConfigError, StoragePermissionError
from spotrun.storage.azure_location import MISSING_EXTRA
from spotrun.storage.options import ObjectStoreOptions
from spotrun.storage.part_sizes import AZURE_LIMITS

MIB = 1024 * 1024
#: Most bytes one Put Blob may carry (service versions since 2019-12-12), so the most
#: ``put_if_absent`` stores.
MAX_SINGLE_PUT_BYTES = 5000 * MIB
#: Most bytes one staged block may hold.
MAX_BLOCK_BYTES = AZURE_LIMITS.max_part_bytes
#: Most committed blocks one blob may have.
MAX_BLOCKS = AZURE_LIMITS.max_parts

CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT"
ENDPOINT_ENV = "AZURE_STORAGE_BLOB_ENDPOINT"

#: The SDK logs every request and answer, headers included, at INFO: it gets this logger, quiet
#: unless its level is lowered (``logging.getLogger("spotrun.storage.azure.http").setLevel("INFO")``).
HTTP_LOG = logging.getLogger("spotrun.storage.azure.http")
HTTP_LOG.setLevel(logging.WARNING)
# DefaultAzureCredential logs a block of every credential it tried at WARNING when none gives a
# token; spotrun's own error says it in one line (NO_IDENTITY), so that block is kept for debugging.
logging.getLogger("azure.identity").setLevel(logging.ERROR)

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
class AzureOptions(ObjectStoreOptions):
    """Options of :class:`~spotrun.storage.azure.AzureStorage`: those of
    :class:`~spotrun.storage.options.ObjectStoreOptions`, parts being staged blocks (no minimum
    size; at most Azure's largest block)."""

    store: ClassVar[str] = "Azure"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("part_size_bytes", "max_part_size_bytes"):
            if getattr(self, name) > MAX_BLOCK_BYTES:
                raise ConfigError(
                    f"{name} must be <= {MAX_BLOCK_BYTES} (Azure's largest block), got {getattr(self, name)}"
                )


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
        "max_single_get_size": max(options.part_size_bytes, options.max_part_size_bytes),
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

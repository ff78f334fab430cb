"""How the Azure backend classifies the SDK's errors: retry or not, and which spotrun error.

Every decision is made on the error code (``x-ms-error-code``: ``BlobNotFound``, ``ServerBusy``...),
the HTTP status or the exception type, never on message text (which differs between Azure and
Azurite, and between service versions).
"""

from __future__ import annotations

import enum
import errno

import requests.exceptions
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    IncompleteReadError,
    ServiceRequestError,
    ServiceResponseError,
)

from spotrun.errors import ObjectNotFoundError, StorageError, StoragePermissionError
from spotrun.storage.azure_config import NO_IDENTITY

#: Statuses retried whatever the code says: throttling (429, 503 ``ServerBusy``) and server errors.
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
#: Codes of throttling and transient server-side failures.
RETRYABLE_CODES = frozenset({"ServerBusy", "InternalError", "OperationTimedOut"})
PERMISSION_CODES = frozenset(
    {
        "AuthenticationFailed",
        "AuthorizationFailure",  # Azurite's answer to a wrong key
        "AuthorizationPermissionMismatch",
        "AuthorizationPermissionDenied",
        "InsufficientAccountPermissions",
        "AccountIsDisabled",
    }
)
#: A Put Blob with ``If-None-Match: *`` found a blob there (409; the SDK turns a 412 into it too).
EXISTS_CODES = frozenset({"BlobAlreadyExists"})

#: Everything the SDK raises that :func:`translate` turns into a spotrun error.
AZURE_ERRORS = (AzureError, requests.exceptions.RequestException)


def error_code(exc: BaseException) -> str:
    """The service's error code (the ``x-ms-error-code`` header); ``""`` when it has none."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or {}
    code = headers.get("x-ms-error-code") or getattr(exc, "error_code", None) or ""
    return str(code.value if isinstance(code, enum.Enum) else code)


def http_status(exc: BaseException) -> int:
    """The HTTP status of an SDK error (0 when it has none: no answer came)."""
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    return int(status) if isinstance(status, int) else 0


def _inner(exc: BaseException) -> BaseException | None:
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    return inner if isinstance(inner, BaseException) and inner is not exc else None


def _is_ssl(exc: BaseException) -> bool:
    inner = _inner(exc)
    return isinstance(exc, requests.exceptions.SSLError) or (inner is not None and _is_ssl(inner))


def is_retryable(exc: BaseException) -> bool:
    """Whether a fresh attempt of the same request may succeed.

    True for throttling (``503 ServerBusy``, 429), 5xx (``500 InternalError``,
    ``OperationTimedOut``), refused, dropped or timed-out connections and bodies cut short;
    False for everything else (missing blobs, denied access, failed preconditions, TLS errors).
    """
    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        return not _is_ssl(exc)
    if isinstance(exc, ClientAuthenticationError):
        return False
    if isinstance(exc, HttpResponseError):
        status = http_status(exc)
        if status:
            return status in RETRYABLE_STATUSES or error_code(exc) in RETRYABLE_CODES
        if isinstance(exc, IncompleteReadError):
            return True
        inner = _inner(exc)  # the downloader wraps a broken body it gave up re-reading
        return inner is not None and is_retryable(inner)
    return False


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether a conditional request's ``If-Match`` did not hold (412 ``ConditionNotMet``)."""
    return isinstance(exc, HttpResponseError) and http_status(exc) == 412


def is_already_exists(exc: BaseException) -> bool:
    """Whether a Put Blob with ``If-None-Match: *`` found a committed blob (409 or 412)."""
    return isinstance(exc, HttpResponseError) and (error_code(exc) in EXISTS_CODES or http_status(exc) == 412)


def translate(exc: BaseException, *, what: str, container: str, endpoint: str = "?") -> StorageError:
    """Turn an SDK exception into the matching spotrun storage error (raise it ``from exc``).

    Args:
        exc: the SDK exception, after retries gave up.
        what: the operation and object, ``"get az://container/a/b"``; starts the message.
        container: named in the message when the container itself is missing.
        endpoint: the blob endpoint, named when it cannot be reached.

    Returns:
        :class:`ObjectNotFoundError` for a missing blob or container,
        :class:`StoragePermissionError` for denied access or no usable credentials,
        :class:`StorageError` for everything else.
    """
    code = error_code(exc)
    status = http_status(exc)
    if code == "ContainerNotFound":
        return ObjectNotFoundError(errno.ENOENT, f"{what}: container {container!r} does not exist (ContainerNotFound)")
    if status == 404:
        return ObjectNotFoundError(errno.ENOENT, f"{what}: no such object ({code or status})")
    if status in (401, 403) or code in PERMISSION_CODES:
        return StoragePermissionError(
            errno.EACCES, f"{what}: access denied ({code or status}); check the credentials in use"
        )
    if type(exc).__name__ == "AzureSigningError":  # the connection string's key cannot sign a request
        return StoragePermissionError(
            errno.EACCES,
            f"{what}: the account key cannot sign requests (is AccountKey in AZURE_STORAGE_CONNECTION_STRING "
            "the account's base64 key?)",
        )
    if isinstance(exc, ClientAuthenticationError):  # no answer from the store: no token was obtained
        return StoragePermissionError(errno.EACCES, f"{what}: {NO_IDENTITY} ({type(exc).__name__})")
    if code == "InvalidHeaderValue" and status == 400:
        # What an emulator or an Azure Stack older than the SDK answers to every request: the
        # SDK's x-ms-version is one it does not know.
        return StorageError(
            errno.EIO,
            f"{what}: Azure error InvalidHeaderValue (HTTP 400): the store may not support this SDK's API "
            "version (x-ms-version); upgrade it, or start Azurite with --skipApiVersionCheck",
        )
    if status:
        return StorageError(errno.EIO, f"{what}: Azure error {code or '?'} (HTTP {status})")
    if isinstance(exc, ServiceRequestError):
        return StorageError(
            errno.ECONNREFUSED, f"{what}: cannot reach the blob endpoint {endpoint} ({type(exc).__name__})"
        )
    # Other failures: the first line of their own message names the cause.
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return StorageError(errno.EIO, f"{what}: {type(exc).__name__}: {first_line}")

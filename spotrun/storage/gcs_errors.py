"""How the GCS backend classifies the errors of Google's client library: retry or not, and
which spotrun error.

Every decision is made on the HTTP status (google.api_core's exception classes carry it) or
the exception type, never on message text (which differs between GCS and its emulators).
"""

from __future__ import annotations

import errno
import os

import google.auth.exceptions
import requests.exceptions
import urllib3.exceptions
from google.api_core import exceptions as api_exceptions

from spotrun.errors import ObjectNotFoundError, ObjectTooShortError, StorageError, StoragePermissionError

#: Statuses GCS asks clients to retry with exponential backoff (429 and 5xx; 408 a timed-out request).
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

# Connection-level failures a fresh attempt may get past; an SSL error is a configuration problem.
_RETRYABLE_EXCEPTIONS = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
    google.auth.exceptions.TransportError,  # the metadata server or token endpoint did not answer
    ConnectionError,
)

#: Everything the client library raises that :func:`translate` turns into a spotrun error.
GCS_ERRORS = (
    api_exceptions.GoogleAPIError,
    google.auth.exceptions.GoogleAuthError,
    requests.exceptions.RequestException,
    urllib3.exceptions.HTTPError,
    ConnectionError,
)

_NO_CREDENTIALS = (
    "no Google credentials found: run on GCE/GKE with a service account (workload identity on GKE), "
    "set GOOGLE_APPLICATION_CREDENTIALS to a key file, or run `gcloud auth application-default login`"
)


def http_status(exc: BaseException) -> int:
    """The HTTP status of a google.api_core error (0 when it has none)."""
    code = getattr(exc, "code", None) if isinstance(exc, api_exceptions.GoogleAPICallError) else None
    return int(code) if isinstance(code, int) else 0


def is_retryable(exc: BaseException) -> bool:
    """Whether a fresh attempt of the same request may succeed: throttling (429), 5xx, a timed-out
    request, a dropped or refused connection; not missing objects, denied access, failed preconditions."""
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return http_status(exc) in RETRYABLE_STATUSES
    if isinstance(exc, requests.exceptions.SSLError):
        return False
    return isinstance(exc, _RETRYABLE_EXCEPTIONS)


def is_precondition_failed(exc: BaseException | None) -> bool:
    """Whether ``exc`` says a request's ``ifGenerationMatch`` did not hold (412)."""
    return exc is not None and http_status(exc) == 412


def translate(exc: BaseException, *, what: str, bucket: str, missing_means_bucket: bool = False) -> StorageError:
    """Turn an error of Google's client library into the matching spotrun storage error.

    Args:
        exc: the exception, after retries gave up; the caller raises the result ``from exc``.
        what: the operation and object (``"get gs://bucket/a/b"``); starts the message.
        bucket: the bucket, named where a 404 can only mean that it is missing.
        missing_means_bucket: a 404 of this request can only mean a missing bucket (an upload,
            a listing), not a missing object.
    """
    status = http_status(exc)
    if status == 404:
        if missing_means_bucket:
            return ObjectNotFoundError(errno.ENOENT, f"{what}: bucket {bucket!r} does not exist (404)")
        return ObjectNotFoundError(errno.ENOENT, f"{what}: no such object (404)")
    if status == 416:
        return ObjectTooShortError(errno.EIO, f"{what}: the range starts past the object's end (416)")
    if status in (401, 403):
        return StoragePermissionError(errno.EACCES, f"{what}: access denied ({status}); check the credentials")
    if isinstance(exc, google.auth.exceptions.DefaultCredentialsError):
        return no_credentials_error(what, exc)
    if isinstance(exc, google.auth.exceptions.RefreshError):
        return StoragePermissionError(errno.EACCES, f"{what}: the credentials could not be refreshed ({exc})")
    if isinstance(exc, requests.exceptions.ConnectionError):
        return StorageError(errno.ECONNREFUSED, f"{what}: cannot connect ({type(exc).__name__})")
    if status:
        return StorageError(errno.EIO, f"{what}: GCS error (HTTP {status})")
    return StorageError(errno.EIO, f"{what}: {type(exc).__name__}: {exc}")


def no_credentials_error(what: str, exc: BaseException) -> StoragePermissionError:
    """The error of a client that could not find Application Default Credentials: google-auth's
    own words where ``GOOGLE_APPLICATION_CREDENTIALS`` names a file it could not use."""
    key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key_file:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return StoragePermissionError(
            errno.EACCES, f"{what}: GOOGLE_APPLICATION_CREDENTIALS={key_file} cannot be used: {first_line}"
        )
    return StoragePermissionError(errno.EACCES, f"{what}: {_NO_CREDENTIALS} ({type(exc).__name__})")

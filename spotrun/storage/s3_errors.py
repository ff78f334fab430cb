"""How the S3 backend classifies botocore errors: retry or not, and which spotrun error.

Every decision is made on the error *code* (``NoSuchKey``, ``SlowDown``...), the HTTP
status, or the exception type -- never on message text, which differs between AWS,
MinIO, R2 and moto.
"""

from __future__ import annotations

import errno

import urllib3.exceptions
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from spotrun.errors import (
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
)

#: Error codes that mean "too many requests, back off and try again".
THROTTLING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
    }
)
#: Error codes of transient server-side failures.
TRANSIENT_CODES = frozenset({"InternalError", "ServiceUnavailable", "RequestTimeout"})
#: HTTP statuses retried whatever the code says.
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})

NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
    }
)
#: Conditional-write outcomes: the precondition (``IfNoneMatch``/``IfMatch``) did not hold.
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412"})
#: A concurrent conditional write was in progress; AWS asks clients to retry.
CONFLICT_CODES = frozenset({"ConditionalRequestConflict", "409"})
#: The store does not implement a feature the request used (a header, e.g. ``If-None-Match``).
NOT_IMPLEMENTED_CODES = frozenset({"NotImplemented", "501"})

# Connection-level failures that a fresh attempt may get past. SSLError and proxy
# configuration errors are deliberately absent: they are configuration problems.
_RETRYABLE_EXCEPTIONS = (
    EndpointConnectionError,
    ConnectTimeoutError,
    ConnectionClosedError,
    ReadTimeoutError,
    ResponseStreamingError,
    IncompleteReadError,
    urllib3.exceptions.ProtocolError,
)


def error_code(exc: ClientError) -> str:
    """The S3 error code of a ``ClientError`` (``""`` when the response had none)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int:
    """The HTTP status of a ``ClientError`` (0 when unknown)."""
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_retryable(exc: BaseException) -> bool:
    """Whether a fresh attempt of the same request may succeed.

    True for throttling (``503 SlowDown`` and friends), 5xx server errors, 429, and
    dropped or refused connections; False for everything else (missing keys, denied
    access, failed preconditions, bugs).
    """
    if isinstance(exc, ClientError):
        code = error_code(exc)
        return (
            code in THROTTLING_CODES
            or code in TRANSIENT_CODES
            or code in CONFLICT_CODES
            or http_status(exc) in RETRYABLE_STATUSES
        )
    return isinstance(exc, _RETRYABLE_EXCEPTIONS)


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says a conditional request's precondition did not hold (412)."""
    return isinstance(exc, ClientError) and (error_code(exc) in PRECONDITION_CODES or http_status(exc) == 412)


def is_not_implemented(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``501 NotImplemented``: the store lacks a feature the request used."""
    return isinstance(exc, ClientError) and (error_code(exc) in NOT_IMPLEMENTED_CODES or http_status(exc) == 501)


def is_conditional_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is S3's 409 ``ConditionalRequestConflict`` (a racing conditional write)."""
    return isinstance(exc, ClientError) and error_code(exc) in CONFLICT_CODES


def translate(exc: Exception, *, what: str, bucket: str) -> StorageError:
    """Turn a botocore exception into the matching spotrun storage error.

    The caller raises the result ``from exc`` so the original stays attached as the
    cause.

    Args:
        exc: the botocore (or urllib3) exception, after retries gave up.
        what: the operation and object, e.g. ``"get s3://bucket/a/b"``; starts the message.
        bucket: bucket name, named in the message when the bucket itself is missing.

    Returns:
        :class:`ObjectNotFoundError` for missing keys or buckets,
        :class:`StoragePermissionError` for denied access or missing credentials,
        :class:`StorageError` for everything else.
    """
    if isinstance(exc, ClientError):
        code = error_code(exc)
        status = http_status(exc)
        if code == "NoSuchBucket":
            return ObjectNotFoundError(errno.ENOENT, f"{what}: bucket {bucket!r} does not exist (NoSuchBucket)")
        if code in NOT_FOUND_CODES or status == 404:
            return ObjectNotFoundError(errno.ENOENT, f"{what}: no such object ({code or status})")
        if code in PERMISSION_CODES or status == 403:
            return StoragePermissionError(
                errno.EACCES, f"{what}: access denied ({code or status}); check the credentials"
            )
        return StorageError(errno.EIO, f"{what}: S3 error {code or '?'} (HTTP {status})")
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return StoragePermissionError(
            errno.EACCES,
            f"{what}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run with an instance role)",
        )
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)):
        endpoint = exc.kwargs.get("endpoint_url", "?")
        return StorageError(
            errno.ECONNREFUSED,
            f"{what}: cannot connect to endpoint {endpoint} ({type(exc).__name__})",
        )
    # Other botocore/urllib3 failures: their own message names the endpoint or cause.
    return StorageError(errno.EIO, f"{what}: {type(exc).__name__}: {exc}")

"""The S3 backend's retry policy: :class:`spotrun.storage.retry.RetryPolicy` with S3's
classification of retryable errors (:func:`spotrun.storage.s3_errors.is_retryable`) as its
default. botocore's own retries are switched off (see :mod:`spotrun.storage.s3_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from spotrun.storage import retry
from spotrun.storage.s3_errors import is_retryable


@dataclass(frozen=True)
class RetryPolicy(retry.RetryPolicy):
    """:class:`spotrun.storage.retry.RetryPolicy` retrying what S3 says may succeed next time."""

    should_retry: Callable[[BaseException], bool] = field(default=is_retryable, repr=False)

"""The S3 backend's one retry policy: jittered exponential backoff, bounded by a deadline.

botocore's own retries are switched off (see :mod:`spotrun.storage.s3`) so that this is
the only place that decides whether and when to try again. Retrying stops *before* a
sleep that would end past the deadline, so a caller with 30 s left gets its error with
time to spare instead of after it. ``sleep`` and ``clock`` are injectable so tests never
really wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import tenacity

from spotrun.storage.s3_errors import is_retryable

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to retry one S3 request.

    Attributes:
        deadline_s: most seconds one operation may spend retrying, from its first
            attempt; also the default when the caller gives no deadline of its own.
        initial_backoff_s: scale of the backoff; the wait after failed attempt ``n``
            (1-based) is drawn uniformly from ``[0, initial_backoff_s * 2**(n-1)]``
            ("full jitter"), capped by ``max_backoff_s``.
        max_backoff_s: upper bound of any single wait.
        sleep: function that waits the given seconds (``time.sleep``; tests pass a fake).
        clock: monotonic clock in seconds (``time.monotonic``; tests pass a fake that
            the fake ``sleep`` advances).
        should_retry: predicate on the exception of a failed attempt.

    Raises:
        ValueError: a negative deadline or a non-positive backoff.
    """

    deadline_s: float = 120.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    should_retry: Callable[[BaseException], bool] = field(default=is_retryable, repr=False)

    def __post_init__(self) -> None:
        if self.deadline_s < 0:
            raise ValueError(f"deadline_s must be >= 0, got {self.deadline_s}")
        if self.initial_backoff_s <= 0 or self.max_backoff_s <= 0:
            raise ValueError(
                f"backoffs must be positive, got initial_backoff_s={self.initial_backoff_s}, "
                f"max_backoff_s={self.max_backoff_s}"
            )

    def deadline_from_now(self, timeout_s: float | None = None) -> float:
        """Absolute ``clock`` time at which an operation starting now must stop retrying.

        Args:
            timeout_s: the caller's own limit in seconds; the earlier of it and
                ``deadline_s`` wins. ``None`` means ``deadline_s``.
        """
        limit_s = self.deadline_s if timeout_s is None else min(timeout_s, self.deadline_s)
        return self.clock() + limit_s

    def call(self, fn: Callable[[], T], *, what: str, deadline_at: float | None = None) -> T:
        """Run ``fn`` until it succeeds, fails for good, or the deadline would be passed.

        Args:
            fn: one attempt; it must be safe to repeat (each S3 request here is).
            what: the operation, for the log line written before each retry.
            deadline_at: absolute ``clock`` time after which no attempt starts; ``None``
                means ``deadline_s`` from now.

        Returns:
            What ``fn`` returned.

        Raises:
            Exception: the last attempt's exception, unchanged, when it is not retryable
                or the next wait would end past the deadline.
        """
        if deadline_at is None:
            deadline_at = self.deadline_from_now()

        def past_deadline(state: tenacity.RetryCallState) -> bool:
            return self.clock() + state.upcoming_sleep >= deadline_at

        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "%s: attempt %d failed (%s); retrying in %.2f s",
                what,
                state.attempt_number,
                type(exc).__name__,
                state.upcoming_sleep,
            )

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(self.should_retry),
            wait=tenacity.wait_random_exponential(multiplier=self.initial_backoff_s, max=self.max_backoff_s),
            stop=past_deadline,
            sleep=self.sleep,
            before_sleep=log_retry,
            reraise=True,
        )
        return retrying(fn)

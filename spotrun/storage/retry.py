"""The object stores' one retry policy: jittered exponential backoff, bounded by a deadline,
and the per-thread deadline blocks (:meth:`RetryingStorage.deadline`) every object store shares.

Each backend switches its client library's own retries off so that this is the only place that
decides whether and when to try again, and passes its own ``should_retry`` (which errors are
throttling or transient is the store's to say). Retrying stops *before* a sleep that would end
past the deadline, so a caller with 30 s left gets its error with time to spare instead of after
it. ``sleep`` and ``clock`` are injectable so tests never really wait.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tenacity

from spotrun.errors import StorageError
from spotrun.storage import part_sizes
from spotrun.storage.base import Storage
from spotrun.storage.options import ObjectStoreOptions

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Runs one retried request: ``call(fn, what)`` -> what ``fn`` returned.
CallWithRetry = Callable[[Callable[[], Any], str], Any]


def _never(exc: BaseException) -> bool:
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to retry one request to an object store.

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
        should_retry: predicate on the exception of a failed attempt (the backend's).

    Raises:
        ValueError: a negative deadline or a non-positive backoff.
    """

    deadline_s: float = 120.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    should_retry: Callable[[BaseException], bool] = field(default=_never, repr=False)

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
            fn: one attempt; it must be safe to repeat.
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


class RetryingStorage(Storage):
    """A :class:`~spotrun.storage.base.Storage` in an object store: its requests retry under
    :class:`RetryPolicy`, bounded by the operation's own deadline and by any :meth:`deadline`
    block around it; keys live under ``self._prefix``.

    Args:
        options: the backend's transfer, retry and connection options.
        should_retry: which of the client library's errors are worth another attempt.
    """

    _prefix: str

    def __init__(self, options: ObjectStoreOptions, should_retry: Callable[[BaseException], bool]) -> None:
        self._options = options
        self._retry = RetryPolicy(
            deadline_s=options.retry_deadline_s, sleep=options.sleep, clock=options.clock, should_retry=should_retry
        )
        self._local = threading.local()

    @property
    def read_concurrency(self) -> int:
        """Ranged GETs a reader keeps in flight: ``max_concurrency``."""
        return self._options.max_concurrency

    def read_unit_bytes(self, total_bytes: int, floor_bytes: int) -> int:
        """One ranged GET per unit, the unit grown with the read
        (:func:`~spotrun.storage.part_sizes.read_unit_size`)."""
        return part_sizes.read_unit_size(total_bytes, self._options, floor_bytes=floor_bytes)

    def spreads_rank_keys(self, world_size: int) -> bool:
        """As the ``key_layout`` option says (:meth:`ObjectStoreOptions.spreads_rank_keys`)."""
        return self._options.spreads_rank_keys(world_size)

    def _name(self, key: str) -> str:
        """The store's name of the object at ``key``: ``prefix/key``."""
        return f"{self._prefix}/{key}" if self._prefix else key

    def _root(self) -> str:
        """What every object name under this root starts with (``prefix/``, or nothing)."""
        return f"{self._prefix}/" if self._prefix else ""

    def _own_earlier_attempt_landed(self, key: str, body: bytes | memoryview) -> bool:
        """After a retried create-only write lost, whether the object there is our own first try
        (it landed, its answer was lost on the way): equal bytes mean it did."""
        try:
            landed = self._get(key) == bytes(body)
        except StorageError:
            return False
        if landed:
            log.info("put_if_absent %s: an earlier attempt of this call had stored it", key)
        return landed

    @contextlib.contextmanager
    def deadline(self, timeout_s: float) -> Iterator[None]:
        """Bound every operation this thread starts inside the block to ``timeout_s`` from now.

        Operations then stop retrying before the deadline (or before their own
        ``retry_deadline_s``, whichever comes first); one that starts after it has
        passed raises :class:`StorageError` at once. Blocks nest; the earliest wins.
        The deadline bounds retrying, not a request in flight: one attempt can still
        take up to the connect timeout plus the read timeout (per socket read).
        """
        previous = getattr(self._local, "deadline_at", None)
        at = self._retry.clock() + timeout_s
        self._local.deadline_at = at if previous is None else min(previous, at)
        try:
            yield
        finally:
            self._local.deadline_at = previous

    def _caller(self, what: str) -> CallWithRetry:
        """A ``call(fn, what)`` that retries under this operation's deadline."""
        deadline_at = self._retry.deadline_from_now()
        contextual = getattr(self._local, "deadline_at", None)
        if contextual is not None:
            deadline_at = min(deadline_at, contextual)
        if self._retry.clock() >= deadline_at:
            raise StorageError(errno.ETIMEDOUT, f"{what}: deadline passed before it started")
        return lambda fn, label: self._retry.call(fn, what=label, deadline_at=deadline_at)

"""The notice every source delivers, the one interface of a source, and polled sources.

A source (:class:`NoticeSource`, aws-node-termination-handler's ``Monitor``) knows one way to
learn of a preemption and delivers each notice to the supervisor's
:class:`~spotrun.notices.inbox.Inbox` as a :class:`Notice`; :class:`NoticeWatch` starts and
stops the sources of one run. Most are polled (:class:`PolledSource`, run by a
:class:`NoticePoller` that drops repeats and logs each problem once). :data:`REBALANCE` asks for
an ordinary checkpoint; every other kind is a stop. Details: ``docs/design/internals.md`` (Notices).
"""

from __future__ import annotations

import abc
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from spotrun.notices.inbox import Inbox

log = logging.getLogger(__name__)

#: Kind of a notice that asks for an ordinary checkpoint, not for a stop.
REBALANCE = "rebalance"
#: At most this many distinct notice bodies are remembered per source for de-duplication.
_MAX_REMEMBERED = 1024


@dataclass(frozen=True)
class Notice:
    """One preemption notice.

    Attributes:
        source: the name of the source that sent it (``"signal"``, ``"aws"``, ``"gcp"``,
            ``"azure"``, ``"file"``).
        kind: what it says, e.g. ``"SIGTERM"`` or ``"spot instance-action terminate"``.
        received_unix_s: when the supervisor learned of it (seconds since the epoch).
        deadline_unix_s: when the machine goes away, if the source knows (seconds since the
            epoch); ``None`` means "the configured grace period from ``received_unix_s``".
        acknowledge: called once after the emergency checkpoint committed (Azure wants a
            ``StartRequests`` POST); ``None`` when the source needs no acknowledgement.
    """

    source: str
    kind: str
    received_unix_s: float
    deadline_unix_s: float | None = None
    acknowledge: Callable[[], None] | None = None


def is_stop(notice: Notice) -> bool:
    """True unless ``notice`` only recommends an ordinary checkpoint (kind :data:`REBALANCE`)."""
    return notice.kind != REBALANCE


class Endpoint(NamedTuple):
    """A cloud's metadata server as the options and the environment name it.

    Attributes:
        url: ``http://host[:port]``.
        named_by: the setting that named it (``"--aws-metadata-endpoint is set"``); ``None``
            for the cloud's default address.
    """

    url: str
    named_by: str | None


class PollProblem(Exception):
    """One poll could not be completed; the poller logs it once per ``key`` and retries.

    Attributes:
        key: short name of the kind of problem (``"timeout"``, ``"HTTP 500"``, ``"bad JSON"``);
            problems with the same key are logged once per source.
        message: one line for the log.
    """

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key
        self.message = message


@dataclass(frozen=True)
class Finding:
    """A notice as a source sees it, before de-duplication.

    Attributes:
        kind: what it says (``"spot instance-action terminate"``, :data:`REBALANCE`, ...).
        body: bytes that identify this notice (usually the response body); a finding whose
            ``kind`` and ``body`` were already seen is a repeat and is dropped.
        deadline_unix_s: when the machine goes away, in seconds since the epoch; ``None``
            means the supervisor's configured grace period.
        acknowledge: called once after the emergency checkpoint committed, or ``None``.
    """

    kind: str
    body: bytes
    deadline_unix_s: float | None = None
    acknowledge: Callable[[], None] | None = None


class ProblemLog:
    """Logs each distinct problem key of one source once as a warning, repeats at debug."""

    def __init__(self, source_name: str):
        self.source_name = source_name
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def report(self, key: str, message: str) -> None:
        """Log ``message`` as a warning the first time ``key`` is reported, at debug after."""
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        level = logging.WARNING if first else logging.DEBUG
        log.log(
            level, "%s notices: %s%s", self.source_name, message, " (logged once; retrying quietly)" if first else ""
        )


class NoticeSource(abc.ABC):
    """One way to learn of a preemption; started at most once, then stopped.

    Attributes:
        name: the source's name in ``--notice`` and in :attr:`Notice.source`
            (``"aws"``, ``"gcp"``, ``"azure"``, ``"file"``, ``"signal"``).
    """

    name: str = "source"

    @abc.abstractmethod
    def start(self, inbox: Inbox) -> None:
        """Begin delivering this source's notices into ``inbox`` (a source that installs
        signal handlers must be started from the main thread)."""

    @abc.abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Stop delivering and undo what :meth:`start` changed.

        Args:
            timeout_s: the longest to wait for the source's own threads to end, in seconds.
        """

    def describe(self) -> str:
        """One line saying where this source looks, for the start-up log."""
        return self.name


class PolledSource(NoticeSource):
    """A source that asks something again and again (a metadata server, a file), in its own thread.

    Attributes:
        poll_period_s: seconds between the end of one poll and the start of the next.
        retry_after_error_s: seconds to wait instead after a poll that failed.
        problems: where :meth:`poll_once` reports problems that do not end the poll.
    """

    def __init__(self, *, poll_period_s: float, retry_after_error_s: float | None = None):
        self.poll_period_s = poll_period_s
        self.retry_after_error_s = poll_period_s if retry_after_error_s is None else retry_after_error_s
        self.problems = ProblemLog(self.name)
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    @abc.abstractmethod
    def poll_once(self) -> list[Finding]:
        """Ask once; return the notices now announced (possibly repeats), ``[]`` for none.

        May block for a bounded time (a request timeout, a long poll).

        Raises:
            PollProblem: the poll failed; the poller waits ``retry_after_error_s`` and retries.
        """

    def start(self, inbox: Inbox) -> None:
        """Poll in a daemon thread, posting new notices with ``inbox.post``."""
        log.info("watching for preemption notices: %s", self.describe())
        poller = NoticePoller(self, inbox.post)
        self._thread = threading.Thread(
            target=poller.run, args=(self._stop_event,), name=f"spotrun-notice-{self.name}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop polling: nothing is posted once the thread sees it. A thread blocked in a
        request longer than ``timeout_s`` is left to end on its own."""
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        """Whether the polling thread is still running."""
        return self._thread is not None and self._thread.is_alive()


class NoticePoller:
    """Polls one source, de-duplicates its findings and posts new ones as notices."""

    def __init__(self, source: PolledSource, post: Callable[[Notice], None], *, clock: Callable[[], float] = time.time):
        self.source = source
        self._post = post
        self._clock = clock
        self._seen: dict[str, None] = {}  # insertion-ordered set of body hashes

    def poll(self, stop_event: threading.Event | None = None) -> tuple[list[Notice], bool]:
        """Poll once and post the new notices (not after ``stop_event`` is set).

        Returns:
            The notices posted, and whether the poll succeeded. Never raises.
        """
        try:
            findings = self.source.poll_once()
        except PollProblem as problem:
            self.source.problems.report(problem.key, problem.message)
            return [], False
        except Exception as exc:  # a bug or an unforeseen answer must not stop the polling
            self.source.problems.report(f"unexpected {type(exc).__name__}", f"unexpected error: {exc!r}")
            log.debug("%s notices: unexpected error", self.source.name, exc_info=True)
            return [], False
        received_unix_s = self._clock()
        posted = []
        for finding in findings:
            if stop_event is not None and stop_event.is_set():
                break
            if not self._is_new(finding):
                continue
            notice = Notice(
                source=self.source.name,
                kind=finding.kind,
                received_unix_s=received_unix_s,
                deadline_unix_s=finding.deadline_unix_s,
                acknowledge=finding.acknowledge,
            )
            try:
                self._post(notice)
            except Exception as exc:
                self.source.problems.report("post failed", f"could not deliver a notice: {exc!r}")
                continue
            posted.append(notice)
        return posted, True

    def run(self, stop_event: threading.Event) -> None:
        """Poll until ``stop_event`` is set, waiting the source's period between polls."""
        while not stop_event.is_set():
            _, ok = self.poll(stop_event)
            stop_event.wait(self.source.poll_period_s if ok else self.source.retry_after_error_s)

    def _is_new(self, finding: Finding) -> bool:
        digest = hashlib.sha256(finding.kind.encode("utf-8", "replace") + b"\0" + finding.body).hexdigest()
        if digest in self._seen:
            return False
        self._seen[digest] = None
        if len(self._seen) > _MAX_REMEMBERED:
            del self._seen[next(iter(self._seen))]
        return True


class NoticeWatch:
    """The sources of one supervisor run, delivering into one inbox.

    Sources may be started from several threads (``auto`` starts a detected cloud's from a
    background thread); none starts after :meth:`stop`. Use as a context manager, or call
    :meth:`stop`.
    """

    def __init__(self, inbox: Inbox):
        self.inbox = inbox
        self.sources: list[NoticeSource] = []
        self._lock = threading.Lock()  # held while starting, so stop waits for a start under way
        self._stopped = False

    def start(self, sources: Sequence[NoticeSource]) -> None:
        """Start ``sources`` (nothing once :meth:`stop` was called).

        Raises:
            Whatever a source's :meth:`~NoticeSource.start` raises; the sources started
            before it are stopped by :meth:`stop`.
        """
        with self._lock:
            for source in sources:
                if self._stopped:
                    return
                source.start(self.inbox)
                self.sources.append(source)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop every source, the last started first; wait up to ``timeout_s`` seconds in
        total for their threads to end."""
        with self._lock:
            self._stopped = True
            sources, self.sources = self.sources, []
        end = time.monotonic() + timeout_s
        for source in reversed(sources):
            source.stop(max(0.0, end - time.monotonic()))

    def __enter__(self) -> NoticeWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

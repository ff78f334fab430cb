"""The event log kept with the checkpoints: what each start of the job did, for ``spotrun report``.

Every writer (rank 0 of the training job, each ``spotrun run`` launch) keeps one small
JSON-lines object per incarnation under ``events/``. Object stores cannot append, so
:class:`EventLog` keeps its records in memory and rewrites the object from a thread of its own;
the caller never waits for storage and never sees a failure. Object names and the ``progress``
record: ``docs/design/internals.md`` (Event log and goodput).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from spotrun.checkpoint import strict_json
from spotrun.errors import ConfigError, ObjectNotFoundError, UnsafeObjectError
from spotrun.storage.base import Storage
from spotrun.tools import process_local

log = logging.getLogger(__name__)

#: Folder of the event log under the checkpoint root.
EVENTS_DIR = "events"
#: Environment variable: least seconds between two writes of the progress record.
PROGRESS_INTERVAL_ENV = "SPOTRUN_EVENT_INTERVAL_S"
#: Default least seconds between two writes of the progress record.
DEFAULT_PROGRESS_INTERVAL_S = 30.0
#: Most seconds one write of an event object may take, retries included.
FLUSH_TIMEOUT_S = 30.0
#: Seconds before a failed write is tried again (sooner when a record is added).
RETRY_AFTER_S = 5.0
#: Most seconds :meth:`EventLog.close` waits for the last write: a job stopping for a
#: preemption must not spend its grace period on its event log (a few KB: milliseconds when
#: the store is healthy).
CLOSE_TIMEOUT_S = 2.0

_KEY_RE = re.compile(r"^incarnation-(\d+)\.(?:rank-(\d+)|supervisor-([A-Za-z0-9._-]+))\.jsonl$")
_HOST_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def rank_key(incarnation: int, rank: int) -> str:
    """Key of a training rank's object: ``events/incarnation-000000003.rank-00000.jsonl``."""
    return f"{EVENTS_DIR}/incarnation-{incarnation:09d}.rank-{rank:05d}.jsonl"


def key_host(host: str) -> str:
    """``host`` as spelt in a supervisor object's key (characters other than letters,
    digits, ``.``, ``_`` and ``-`` replaced)."""
    return _HOST_UNSAFE.sub("_", host).strip("._-") or "host"


def supervisor_key(incarnation: int, host: str, writer_id: str) -> str:
    """Key of one supervisor launch's object (``incarnation``: the number the launch planned;
    ``writer_id``: unique to the supervisor process, letters and digits)."""
    return f"{EVENTS_DIR}/incarnation-{incarnation:09d}.supervisor-{key_host(host)}-{writer_id}.jsonl"


def progress_interval_s(value: float | None = None) -> float:
    """The progress record's least interval in seconds: ``value``, else
    ``$SPOTRUN_EVENT_INTERVAL_S``, else :data:`DEFAULT_PROGRESS_INTERVAL_S`.

    Raises:
        ConfigError: not a number >= 0.
    """
    source = "event_interval_s"
    if value is None:
        text = os.environ.get(PROGRESS_INTERVAL_ENV)
        if text is None or not text.strip():
            return DEFAULT_PROGRESS_INTERVAL_S
        source = f"${PROGRESS_INTERVAL_ENV}"
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{source} must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{source} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class EventObject:
    """One stored event object, parsed.

    Attributes:
        key: its key under the root.
        incarnation: the incarnation in its name (a supervisor's: the one its launch planned).
        rank: the training rank that wrote it; ``None`` for a supervisor's.
        writer: ``rank-00000`` or ``supervisor-<host>-<id>``, as in the key.
        records: its records in order, each a dict with ``event`` and ``time_unix_s``.
    """

    key: str
    incarnation: int
    rank: int | None
    writer: str
    records: tuple[dict[str, Any], ...]


def parse_key(key: str) -> tuple[int, int | None, str] | None:
    """``(incarnation, rank or None, writer)`` of an event object's key; ``None`` for any
    other key."""
    folder, _, name = key.rpartition("/")
    match = _KEY_RE.match(name) if folder == EVENTS_DIR else None
    if match is None:
        return None
    rank = int(match.group(2)) if match.group(2) is not None else None
    return int(match.group(1)), rank, name.split(".", 1)[1].removesuffix(".jsonl")


def parse_records(data: bytes, where: str) -> tuple[dict[str, Any], ...]:
    """The records of an event object's bytes; a line that is not a record is skipped with
    a warning naming ``where``."""
    records = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = strict_json.loads(line.encode(), max_bytes=None, what="event record")  # no RecursionError
        except ValueError:
            record = None
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("event"), str)
            or not isinstance(record.get("time_unix_s"), (int, float))
        ):
            log.warning("%s line %d is not an event record; skipped", where, number)
            continue
        records.append(record)
    return tuple(records)


def read_events(storage: Storage, *, max_workers: int = 8) -> list[EventObject]:
    """Every event object under ``storage``'s root, sorted by key (objects read in parallel).

    Raises:
        StorageError: listing or reading failed.
    """
    named = []
    for info in storage.list(f"{EVENTS_DIR}/"):
        parsed = parse_key(info.key)
        if parsed is not None:
            named.append((info.key, parsed))

    def read(item: tuple[str, tuple[int, int | None, str]]) -> EventObject | None:
        key, (incarnation, rank, writer) = item
        try:
            data = storage.get(key)
        except ObjectNotFoundError:  # deleted since the listing
            return None
        except UnsafeObjectError as exc:  # a link or a FIFO in the root: not read, said
            log.warning("event log %s skipped: %s", key, exc.strerror)
            return None
        return EventObject(key, incarnation, rank, writer, parse_records(data, f"{storage.uri}/{key}"))

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(named) or 1))) as pool:
        found = [obj for obj in pool.map(read, sorted(named)) if obj is not None]
    return found


def _record(event: str, fields: dict[str, Any]) -> str:
    record = {"event": event, "time_unix_s": round(fields.pop("time_unix_s", None) or time.time(), 6)}
    record.update(fields)
    return json.dumps(record, separators=(",", ":"), allow_nan=False, default=str) + "\n"


class EventLog:
    """One event object, rewritten whole from a thread of its own after each change.

    Thread-safe; no method waits for storage except :meth:`close` (bounded).

    Args:
        storage: the checkpoint root.
        key: the object's key (:func:`rank_key`, :func:`supervisor_key`).
        progress_interval_s: least seconds between two writes caused by :meth:`progress`
            alone (records added by :meth:`append` are written at once).
        flush_timeout_s: most seconds one write may take, retries included.
    """

    def __init__(
        self,
        storage: Storage,
        key: str,
        *,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
        flush_timeout_s: float = FLUSH_TIMEOUT_S,
    ) -> None:
        self.storage = storage
        self.key = key
        self._interval_s = progress_interval_s
        self._flush_timeout_s = flush_timeout_s
        self._lines: list[str] = []
        self._progress: tuple[int, float] | None = None  # (step, unix s): set without a lock
        self._written_progress: tuple[int, float] | None = None
        self._written_lines = 0
        self._changed = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._failing = False
        process_local.at_exit(_close_at_exit, weakref.ref(self))  # a job that never called close()

    def append(self, event: str, **fields: Any) -> None:
        """Add the record ``event`` with ``fields`` (JSON values; ``time_unix_s`` defaults
        to now) and have it written soon."""
        line = _record(event, fields)
        with self._changed:
            self._lines.append(line)
            self._start()
            self._changed.notify()

    def progress(self, step: int, time_unix_s: float | None = None) -> None:
        """Note that ``step`` was reached (at ``time_unix_s``, default now). Costs an
        assignment: the record is written with the next write, at most
        ``progress_interval_s`` later."""
        self._progress = (step, time.time() if time_unix_s is None else time_unix_s)
        if self._thread is None:
            with self._changed:
                self._start()

    @property
    def last_progress(self) -> tuple[int, float] | None:
        """The newest ``(step, time_unix_s)`` given to :meth:`progress`, if any."""
        return self._progress

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is not written yet and stop the thread, waiting at most ``timeout_s``
        seconds (a write still running then finishes on its own; logged). A later
        :meth:`append` starts the thread again."""
        with self._changed:
            thread = self._thread
            if thread is None:
                return
            self._closing = True
            self._changed.notify()
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning(
                "the event log %s/%s was not written within %.0f s; its last records may be lost",
                self.storage.uri,
                self.key,
                timeout_s,
            )

    # --- the writer thread ------------------------------------------------------

    def _start(self) -> None:
        """Start the writer thread if none runs (the caller holds the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spotrun-event-log", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                # Records are written at once; progress alone waits for the interval (the timed wake).
                while not self._closing and len(self._lines) == self._written_lines:
                    if not self._changed.wait(max(self._interval_s, 0.05)) and self._progress != self._written_progress:
                        break
                lines, progress, closing = list(self._lines), self._progress, self._closing
                if closing and len(lines) == self._written_lines and progress == self._written_progress:
                    self._thread, self._closing = None, False  # all written: a later append starts anew
                    return
            if not self._write(lines, progress):
                with self._changed:
                    if closing:  # given up: what is not written is lost
                        self._thread, self._closing = None, False
                        return
                    self._changed.wait(RETRY_AFTER_S)  # until then, or the next record or close()

    def _write(self, lines: list[str], progress: tuple[int, float] | None) -> bool:
        """Put the whole object; whether it was stored (a failure is logged once until a
        write succeeds again)."""
        body = "".join(lines)
        if progress is not None:
            body += _record("progress", {"step": progress[0], "time_unix_s": progress[1]})
        try:
            with self.storage.deadline(self._flush_timeout_s):
                self.storage.put(self.key, body.encode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - the event log never stops the job
            if not self._failing:
                log.warning(
                    "cannot write the event log %s/%s: %s (tried again at the next record)",
                    self.storage.uri,
                    self.key,
                    exc.strerror if isinstance(exc, OSError) and exc.strerror else exc,
                )
            self._failing = True
            return False
        if self._failing:
            log.info("the event log %s/%s is written again", self.storage.uri, self.key)
        self._failing = False
        with self._changed:
            self._written_lines, self._written_progress = len(lines), progress
        return True


def _close_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit, write what a log that was never closed still holds - unless its
    store is failing (the exit does not wait for it then)."""
    event_log = ref()
    if event_log is not None and not event_log._failing:
        try:
            event_log.close()
        except Exception:  # noqa: BLE001 - never fail the exit
            log.exception("writing the event log at exit")

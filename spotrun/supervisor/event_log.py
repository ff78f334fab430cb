"""The supervisor's part of the event log (:mod:`spotrun.eventlog.records`): an observer
(:mod:`spotrun.supervisor.observers`) that keeps one object per launch,
``events/incarnation-<N>.supervisor-<host>-<id>.jsonl`` (``N``: the incarnation the launch
planned; ``id``: random per supervisor process).

Each object holds the events of its launch as records (the observer's fields, ``event`` the
event's name): ``launch``, then ``notice``, ``decision``, ``command_exit``, ``restart``, and
``exit`` for the last launch. The first launch's object starts with the supervisor's
``start``, to which ``spotrun_started_unix_s`` is added (when spotrun's command line began,
:data:`spotrun.cli.STARTED_UNIX_S`; the report counts the supervisor's own start-up from then).
Not the process's start time in ``/proc``: a shell that execs spotrun hands on its pid and its
start time, so ``bash -c "pip install ... && exec spotrun run ..."`` would count the install
(logs of earlier versions hold that, as ``process_started_unix_s``). Events before the first
launch wait for it; a supervisor that exits without launching anything leaves no object.
Writing happens on the event log's threads: an event never waits for storage.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from spotrun.eventlog.records import CLOSE_TIMEOUT_S, EventLog, supervisor_key
from spotrun.storage import Storage
from spotrun.supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)


class EventLogObserver:
    """Writes the supervisor's events into the event log under the checkpoint root.

    Args:
        open_root: opens the checkpoint root (called once, at the first launch: after the
            supervisor's preflight check of the storage).
        host: the host name in the objects' keys; default this host's.
        started_unix_s: when spotrun began (seconds since the epoch), recorded in the
            ``start`` record; ``None``: the ``start`` record's own time is the beginning.
    """

    def __init__(
        self, open_root: Callable[[], Storage], *, host: str | None = None, started_unix_s: float | None = None
    ) -> None:
        self._open_root = open_root
        self._started_unix_s = started_unix_s
        self._storage: Storage | None = None
        self._host = host or socket.gethostname()
        self._writer_id = uuid.uuid4().hex[:8]
        self._waiting: list[tuple[str, dict[str, Any]]] = []  # events before the first launch
        self._current: EventLog | None = None
        self._logs: list[EventLog] = []

    @classmethod
    def for_config(cls, config: SupervisorConfig, *, started_unix_s: float | None = None) -> EventLogObserver:
        """The observer for ``spotrun run`` with ``config`` (its checkpoint root)."""
        return cls(lambda: config.location.open(), started_unix_s=started_unix_s)

    def event(self, name: str, fields: dict[str, Any]) -> None:
        """Record event ``name`` (see :mod:`spotrun.supervisor.observers`)."""
        if name == "start" and self._started_unix_s is not None:
            fields = {**fields, "spotrun_started_unix_s": round(self._started_unix_s, 6)}
        if name == "launch":
            if self._storage is None:
                self._storage = self._open_root()
            self._current = EventLog(self._storage, supervisor_key(fields["incarnation"], self._host, self._writer_id))
            self._logs.append(self._current)
            for waiting_name, waiting_fields in self._waiting:
                self._current.append(waiting_name, **waiting_fields)
            self._waiting.clear()
        if self._current is None:
            self._waiting.append((name, fields))
        else:
            self._current.append(name, **fields)

    def close(self) -> None:
        """Write every launch's object, waiting :data:`~spotrun.eventlog.records.CLOSE_TIMEOUT_S` in all
        at most (the supervisor's exit code must not wait for a slow store)."""
        end_s = time.monotonic() + CLOSE_TIMEOUT_S
        for event_log in self._logs:
            event_log.close(timeout_s=max(0.0, end_s - time.monotonic()))

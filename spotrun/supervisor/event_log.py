"""The supervisor's part of the event log (:mod:`spotrun.events`): an observer
(:mod:`spotrun.supervisor.observers`) that keeps one object per launch,
``events/incarnation-<N>.supervisor-<host>-<id>.jsonl`` (``N``: the incarnation the launch
planned; ``id``: random per supervisor process).

Each object holds the events of its launch as records (the observer's fields, ``event`` the
event's name): ``launch``, then ``notice``, ``decision``, ``command_exit``, ``restart``, and
``exit`` for the last launch. The first launch's object starts with the supervisor's
``start``, to which ``process_started_unix_s`` is added (when the process began, from
``/proc``; the report counts the supervisor's own start-up from then). Events before the first
launch wait for it; a supervisor that exits without launching anything leaves no object.
Writing happens on the event log's threads: an event never waits for storage.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from spotrun.events import CLOSE_TIMEOUT_S, EventLog, supervisor_key
from spotrun.storage import Storage
from spotrun.supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)


def process_started_unix_s() -> float | None:
    """When this process began, in seconds since the epoch (about 10 ms resolution), from
    ``/proc``; ``None`` where that cannot be read (not Linux)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime_s = float(f.read().split()[0])
        started_after_boot_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5)
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime_s - started_after_boot_s)


class EventLogObserver:
    """Writes the supervisor's events into the event log under the checkpoint root.

    Args:
        open_root: opens the checkpoint root (called once, at the first launch: after the
            supervisor's preflight check of the storage).
        host: the host name in the objects' keys; default this host's.
    """

    def __init__(self, open_root: Callable[[], Storage], *, host: str | None = None) -> None:
        self._open_root = open_root
        self._storage: Storage | None = None
        self._host = host or socket.gethostname()
        self._writer_id = uuid.uuid4().hex[:8]
        self._waiting: list[tuple[str, dict[str, Any]]] = []  # events before the first launch
        self._current: EventLog | None = None
        self._logs: list[EventLog] = []

    @classmethod
    def for_config(cls, config: SupervisorConfig) -> EventLogObserver:
        """The observer for ``spotrun run`` with ``config`` (its checkpoint root)."""
        return cls(lambda: config.location.open())

    def event(self, name: str, fields: dict[str, Any]) -> None:
        """Record event ``name`` (see :mod:`spotrun.supervisor.observers`)."""
        if name == "start":
            fields = {**fields, "process_started_unix_s": process_started_unix_s()}
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
        """Write every launch's object, waiting :data:`~spotrun.events.CLOSE_TIMEOUT_S` in all
        at most (the supervisor's exit code must not wait for a slow store)."""
        end_s = time.monotonic() + CLOSE_TIMEOUT_S
        for event_log in self._logs:
            event_log.close(timeout_s=max(0.0, end_s - time.monotonic()))

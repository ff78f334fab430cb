"""What the supervisor tells its observers (the event log, the metrics): one call per event.

The supervisor calls :meth:`Observers.emit` at each point an operator cares about (``start``,
``launch``, ``notice``, ``decision``, ``command_exit``, ``restart``, ``exit``); each observer gets
``(name, fields)`` and must never raise into the supervisor (a failing observer is logged once
per event name). The events' fields: ``docs/design/internals.md`` (Event log and goodput).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Observer(Protocol):
    """Receives the supervisor's events."""

    def event(self, name: str, fields: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Observers:
    """Fans each event out to every observer; an observer's failure is logged, not raised."""

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self._observers = list(observers)
        self._failed: set[tuple[int, str]] = set()

    def add(self, observer: Observer) -> None:
        """Add an observer; it gets every later event."""
        self._observers.append(observer)

    def emit(self, name: str, **fields: Any) -> None:
        """Send event ``name`` with ``fields`` (plus ``time_unix_s``) to every observer."""
        fields.setdefault("time_unix_s", time.time())
        for index, observer in enumerate(self._observers):
            try:
                observer.event(name, dict(fields))
            except Exception as exc:  # never let an observer end the supervision
                if (index, name) not in self._failed:
                    self._failed.add((index, name))
                    log.warning(
                        "%s failed on event %r: %s (the supervision goes on)", type(observer).__name__, name, exc
                    )

    def close(self) -> None:
        """Close every observer (flush what it holds); failures are logged."""
        for observer in self._observers:
            try:
                observer.close()
            except Exception as exc:
                log.warning("closing %s failed: %s", type(observer).__name__, exc)

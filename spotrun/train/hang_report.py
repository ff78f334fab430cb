"""Telling the supervisor that a rank stopped answering.

When one of spotrun's collectives gives up (:class:`~spotrun.errors.CollectiveTimeoutError`,
naming the ranks that did not arrive), spotrun's process group is unusable and the job must
restart. The rank says so in its log and, under ``spotrun run``, writes the report of
:mod:`spotrun.control.hangs` before the error reaches the training script: the supervisor
names the rank, and stops the command (then restarts it, ``--max-restarts``) when this process
still runs 10 s later, its training thread stuck in the job's own collective with the rank that
stopped. Without a supervisor nothing is written; the error is raised as always.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from spotrun.control import hangs
from spotrun.errors import CollectiveTimeoutError, SpotrunError
from spotrun.tools import dist

log = logging.getLogger("spotrun.checkpointer")

F = TypeVar("F", bound=Callable[..., Any])


def report_collective_timeout(control_dir: str | None, exc: CollectiveTimeoutError) -> None:
    """Log ``exc`` and, under ``spotrun run``, report it to the supervisor; once per error, never raises."""
    if getattr(exc, "_spotrun_reported", False):
        return
    exc._spotrun_reported = True  # type: ignore[attr-defined]  # the training thread raises it again
    log.error("rank %d: %s; spotrun's collectives cannot go on: the job must restart", dist.rank(), exc)
    if not control_dir:
        return
    try:
        hangs.write_collective_timeout_report(
            control_dir, ranks=exc.ranks, what=exc.what, timeout_s=exc.timeout_s, message=str(exc), rank=dist.rank()
        )
    except (OSError, SpotrunError) as error:  # the error itself still ends the job
        log.warning("could not report the collective timeout to the supervisor: %s", error)


def reports_collective_timeout(method: F) -> F:
    """Decorator of the Checkpointer's public methods: a :class:`CollectiveTimeoutError` leaving
    one is reported first (to ``self._env.control_dir``), then raised unchanged."""

    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except CollectiveTimeoutError as exc:
            report_collective_timeout(self._env.control_dir, exc)
            raise

    return wrapper  # type: ignore[return-value]

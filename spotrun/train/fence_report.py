"""Telling the supervisor that a newer start of the job fenced these workers.

When a save or a claim raises :class:`~spotrun.errors.FencedError`, this process belongs to
an older copy of the job (the same command started twice, a retry while the first copy still
runs). Restarting it would claim yet another incarnation and fence the newer copy in turn, so
the two would take turns. Local rank 0 of each node therefore writes ``fenced.json`` into the
control directory (:func:`spotrun.control.files.write_fence_report`) before the error reaches the
training script: the supervisor then stops instead of restarting, whatever the script's exit
code, and a claim later in the same launch is refused (:mod:`spotrun.checkpoint.claim`).
Without a supervisor (no ``$SPOTRUN_CONTROL_DIR``) nothing is written; the error is raised
as always.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from spotrun.checkpoint import fencing
from spotrun.control import files as control
from spotrun.errors import FencedError, SpotrunError
from spotrun.storage import Storage

log = logging.getLogger("spotrun.checkpointer")

#: Most seconds spent looking up the newer incarnation's record for the report.
LOOKUP_TIMEOUT_S = 10.0

F = TypeVar("F", bound=Callable[..., Any])


def reports_fence(method: F) -> F:
    """Decorator of the Checkpointer's public methods: a :class:`FencedError` leaving one is
    reported first (``self._report_fenced``), then raised unchanged."""

    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except FencedError as exc:
            self._report_fenced(exc)
            raise

    return wrapper  # type: ignore[return-value]


def report_fenced(storage: Storage, control_dir: str, incarnation: int | None, exc: FencedError) -> None:
    """Write the fence report of this launch, unless there is one (never raises: the
    ``FencedError`` is what counts).

    The report is written at once with what is known, then again naming the newest incarnation
    on the root and where it runs (one listing and one read, bounded by
    :data:`LOOKUP_TIMEOUT_S`): a supervisor that stops the workers during that lookup (a
    notice's deadline) still finds the first.
    """
    try:
        if control.read_fence_report(control_dir) is not None:
            return  # reported earlier in this launch (the claim of a worker restarted within it refused)
    except SpotrunError:
        pass  # unreadable: written again below
    fenced_unix_s = time.time()

    def write(claim: fencing.Claim | None) -> None:
        control.write_fence_report(
            control_dir,
            control.FenceReport(
                incarnation=incarnation,
                newer_incarnation=claim.incarnation if claim else None,
                newer_host=claim.host if claim else None,
                newer_pid=claim.pid if claim else None,
                newer_supervisor_pid=claim.supervisor_pid if claim else None,
                message=str(exc),
                fenced_unix_s=fenced_unix_s,
            ),
        )

    try:
        write(None)
    except OSError as error:
        log.error("cannot tell the supervisor that this launch was fenced (%s): it may restart it", error)
        return
    try:
        with storage.deadline(LOOKUP_TIMEOUT_S):
            claim = fencing.newest_claim(storage)
    except (SpotrunError, OSError) as error:
        log.warning("fenced; the newer incarnation's record could not be read: %s", error)
        claim = None
    if claim is not None and (incarnation is None or claim.incarnation > incarnation):
        try:
            write(claim)
        except OSError as error:
            log.warning("cannot name the newer incarnation in the fence report: %s", error)
    newer = claim.describe() if claim is not None else "a newer incarnation"
    log.error(
        "fenced by %s of this job on %s: this copy (incarnation %s) stops, and spotrun run does not restart it",
        newer,
        storage.uri,
        "none" if incarnation is None else incarnation,
    )

"""The supervisor's look for a rank that stopped answering (:mod:`spotrun.control.hangs`).

A worker whose collective gave up writes its report into the control directory; the supervisor
looks about once a second (one ``open``) while the command runs. On a report it says which rank
did not answer and stops the command: the rank that stopped would otherwise hold it until
torchrun's shutdown timeout (it waits that long for a stopped worker before its SIGKILL), and a
training thread stuck in the job's own collective would hold it until the job's own timeout.
The launch then counts as failed (``--max-restarts``), or, after a notice, as preempted without
an emergency checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from spotrun.control import hangs
from spotrun.errors import SpotrunError

log = logging.getLogger("spotrun.supervisor.run")  # the supervisor's own log lines

LOOK_INTERVAL_S = hangs.LOOK_INTERVAL_S


class HangWatch:
    """The look for one launch's report (its control directory)."""

    def __init__(self, control_dir: str, clock: Callable[[], float] = time.time) -> None:
        self._control_dir = control_dir
        self._clock = clock
        self.next_look_unix_s = clock() + LOOK_INTERVAL_S
        self.report: hangs.CollectiveTimeoutReport | None = None

    def look(self, *, stopping: bool = True) -> bool:
        """Whether a report came since the last look (said once: the rank that did not answer, and
        whether the supervisor stops the command for it); looks only when due unless not ``stopping``
        (the command already exited: a last look)."""
        now = self._clock()
        if self.report is not None or (stopping and now < self.next_look_unix_s):
            return False
        self.next_look_unix_s = now + LOOK_INTERVAL_S
        try:
            self.report = hangs.read_collective_timeout_report(self._control_dir)
        except SpotrunError as exc:
            log.error("%s", exc)
            return False
        if self.report is None:
            return False
        log.error(
            "a rank stopped answering: %s%s",
            self.report.describe(),
            "; stopping the command" if stopping else "",
        )
        return True

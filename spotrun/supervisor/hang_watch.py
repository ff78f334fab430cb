"""The supervisor's look for a rank that stopped answering (:mod:`spotrun.control.hangs`).

A worker whose collective gave up writes its report into the control directory; the supervisor
looks about once a second (one ``open``) while the command runs and names the rank in its log.
A worker that raised the error exits, and torchrun stops the others itself (a stopped worker
only with SIGKILL, after its shutdown timeout, which ``spotrun run`` sets to the grace period)
and then fails or restarts the workers as it was told (an elastic job's membership change
included): the supervisor leaves that to torchrun. But when the reporting process still runs
:data:`REPORTER_EXIT_WAIT_S` after its report, its training thread is stuck (in the job's own
collective with the rank that stopped, which spotrun cannot bound): the supervisor stops the
command. Either way the launch then counts as failed (``--max-restarts``), or, after a notice,
as preempted without an emergency checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from spotrun.control import hangs
from spotrun.errors import SpotrunError
from spotrun.supervisor import process

log = logging.getLogger("spotrun.supervisor.run")  # the supervisor's own log lines

LOOK_INTERVAL_S = hangs.LOOK_INTERVAL_S
#: How long the process that reported may run on before the supervisor stops the command, in
#: seconds: a worker that raised exits within it.
REPORTER_EXIT_WAIT_S = 10.0


class HangWatch:
    """The look for one launch's report (its control directory)."""

    def __init__(self, control_dir: str, clock: Callable[[], float] = time.time) -> None:
        self._control_dir = control_dir
        self._clock = clock
        self.next_look_unix_s = clock() + LOOK_INTERVAL_S
        self.report: hangs.CollectiveTimeoutReport | None = None
        self._reporter: process.ProcInfo | None = None
        self._seen_unix_s = 0.0
        self.stopping = False  # the command is stopped for a stuck reporter

    def look(self, *, running: bool = True) -> None:
        """Read the report when a look is due (always when not ``running``: the command exited)
        and say it once: the rank that did not answer and which rank reported it."""
        now = self._clock()
        if running and now < self.next_look_unix_s:
            return
        self.next_look_unix_s = now + LOOK_INTERVAL_S  # the next look, or the next look at the reporter
        if self.report is not None:
            return
        try:
            self.report = hangs.read_collective_timeout_report(self._control_dir)
        except SpotrunError as exc:
            log.error("%s", exc)
            return
        if self.report is not None:
            self._seen_unix_s = now
            self._reporter = process.proc_info(self.report.pid) if self.report.pid else None
            log.error("a rank stopped answering: %s", self.report.describe())

    def stuck(self) -> bool:
        """Look (:meth:`look`); True once, when the reporting process still runs
        :data:`REPORTER_EXIT_WAIT_S` after the report was seen (said: the command is stopped)."""
        self.look()
        reporter = self._reporter
        if self.stopping or reporter is None or self._clock() < self._seen_unix_s + REPORTER_EXIT_WAIT_S:
            return False
        if not process.is_alive(reporter):
            self._reporter = None  # it exited: torchrun takes over
            return False
        self.stopping = True
        log.error(
            "rank %d (pid %d) still runs %.0f s after its report: stuck (in the job's own collective?); "
            "stopping the command",
            self.report.rank if self.report else -1,
            reporter.pid,
            self._clock() - self._seen_unix_s,
        )
        return True

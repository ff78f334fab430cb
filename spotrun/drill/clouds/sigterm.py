"""A SIGTERM in the drill (:class:`SignalDrill`): the notice of Kubernetes, systemd and the
like, sent to ``spotrun run`` itself; no metadata server."""

from __future__ import annotations

import os
import signal

from spotrun.drill.clouds.base import DrillCloud
from spotrun.supervisor import process


class SignalDrill(DrillCloud):
    """SIGTERM to the supervisor, once it has installed its handler."""

    name = "signal"
    lead_s = 30.0  # Kubernetes' default terminationGracePeriodSeconds

    def run_options(self) -> list[str]:
        return ["--notice", "none"]  # signals are always notices

    def ready(self, pid: int) -> bool:
        # still starting up: a SIGTERM now would kill it instead of being a notice
        return process.catches_signal(pid, signal.SIGTERM)

    def serve(self, pid: int, deadline_unix_s: float) -> None:
        os.kill(pid, signal.SIGTERM)


#: This module's cloud (see :data:`spotrun.drill.clouds.MODULES`).
CLOUD = SignalDrill

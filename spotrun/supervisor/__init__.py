"""The node supervisor, ``spotrun run -- torchrun ...``: the main loop (:mod:`.run`), the exit
codes (:mod:`.exit_codes`), its options (:mod:`.config`, :mod:`.config_file`), each launch
(:mod:`.launch`), the storage check (:mod:`.preflight`), the process tree (:mod:`.process`), the
emergency-save estimate, metrics and the supervisor's events.

Torch-free. May import tools, control, storage, notices, checkpoint (without torch at import)
and eventlog.
"""

from spotrun.supervisor.config import SupervisorConfig
from spotrun.supervisor.exit_codes import (
    EXIT_FENCED,
    EXIT_FINISHED,
    EXIT_PREEMPTED_NOT_SAVED,
    EXIT_PREEMPTED_SAVED,
)
from spotrun.supervisor.run import supervise

__all__ = [
    "EXIT_FENCED",
    "EXIT_FINISHED",
    "EXIT_PREEMPTED_NOT_SAVED",
    "EXIT_PREEMPTED_SAVED",
    "SupervisorConfig",
    "supervise",
]

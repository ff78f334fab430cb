"""The node supervisor: ``spotrun run -- torchrun ...``.

* :mod:`spotrun.supervisor.run`     the main loop and the exit codes;
* :mod:`spotrun.supervisor.config`  :class:`SupervisorConfig`, the options;
* :mod:`spotrun.supervisor.launch`  resume point and environment of each launch;
* :mod:`spotrun.supervisor.preflight` the storage check before the first launch;
* :mod:`spotrun.supervisor.process` descendants, stopping the process tree, reaping.

The notices it acts on (signals, cloud metadata servers) come from :mod:`spotrun.notices`.
"""

from spotrun.supervisor.config import SupervisorConfig
from spotrun.supervisor.run import (
    EXIT_FENCED,
    EXIT_FINISHED,
    EXIT_PREEMPTED_NOT_SAVED,
    EXIT_PREEMPTED_SAVED,
    supervise,
)

__all__ = [
    "EXIT_FENCED",
    "EXIT_FINISHED",
    "EXIT_PREEMPTED_NOT_SAVED",
    "EXIT_PREEMPTED_SAVED",
    "SupervisorConfig",
    "supervise",
]

"""Options of the node supervisor (``spotrun run``), validated when constructed."""

from __future__ import annotations

from dataclasses import dataclass

from spotrun.env import DEFAULT_CHECKPOINT_URI
from spotrun.errors import ConfigError

#: Upper bound of the wait before a crash restart, in seconds.
MAX_RESTART_BACKOFF_S = 300.0


@dataclass(frozen=True)
class SupervisorConfig:
    """Options of ``spotrun run``.

    Attributes:
        command: the launch command and its arguments (``["torchrun", ...]``).
        checkpoint_uri: root of the checkpoints (local path, ``file://`` or ``s3://``).
        grace_period_s: seconds between a notice and the hard kill of the machine or pod
            (Kubernetes' ``terminationGracePeriodSeconds``, 30 by default).
        safety_margin_s: seconds kept free before the end of the grace period: the save
            deadline is ``notice + grace_period_s - safety_margin_s``. Keep it at least
            ``stop_timeout_s`` so stopping the command also fits in the grace period.
        stop_timeout_s: seconds between SIGTERM and SIGKILL when stopping the command.
        max_restarts: crash restarts allowed (a failure without a notice).
        restart_backoff_s: wait before the first restart in seconds; doubles every restart,
            capped at :data:`MAX_RESTART_BACKOFF_S`.

    Raises:
        ConfigError: an empty command or an out-of-range value.
    """

    command: tuple[str, ...]
    checkpoint_uri: str = DEFAULT_CHECKPOINT_URI
    grace_period_s: float = 30.0
    safety_margin_s: float = 5.0
    stop_timeout_s: float = 5.0
    max_restarts: int = 0
    restart_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command or not self.command[0]:
            raise ConfigError("no launch command given: use spotrun run -- COMMAND...")
        if not self.grace_period_s > 0:
            raise ConfigError(f"grace period must be > 0 s, got {self.grace_period_s}")
        if not 0 <= self.safety_margin_s < self.grace_period_s:
            raise ConfigError(
                f"safety margin must be >= 0 and < the grace period ({self.grace_period_s} s), "
                f"got {self.safety_margin_s}"
            )
        if not self.stop_timeout_s > 0:
            raise ConfigError(f"stop timeout must be > 0 s, got {self.stop_timeout_s}")
        if self.max_restarts < 0:
            raise ConfigError(f"max restarts must be >= 0, got {self.max_restarts}")
        if not self.restart_backoff_s >= 0:
            raise ConfigError(f"restart backoff must be >= 0 s, got {self.restart_backoff_s}")

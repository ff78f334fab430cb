"""The settings of a :class:`~spotrun.train.checkpointer.Checkpointer`, one documented field each,
checked once when they are made (torchtitan's checkpointer ``Config`` pattern).

What is checkpointed (``state``, ``rank_state``) and a ready storage backend are objects, not
settings: they stay arguments of the Checkpointer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spotrun.checkpoint.shard import DEFAULT_MAX_FILE_SIZE_BYTES, DEFAULT_MAX_HEADER_BYTES
from spotrun.control.env import (
    DEFAULT_AGREEMENT_TIMEOUT_S,
    DEFAULT_RESTORE_TIMEOUT_S,
    DEFAULT_SAVE_TIMEOUT_S,
    WorkerEnv,
)
from spotrun.errors import ConfigError
from spotrun.train.agreement import check_agreement

#: What a due save does while the previous background save is still in flight.
ON_SAVE_IN_FLIGHT = ("wait", "skip")


@dataclass(frozen=True)
class CheckpointerOptions:
    """How a Checkpointer saves; the arguments of the same names of ``spotrun.Checkpointer(...)``.

    With ``background_saves``, periodic and supervisor-requested saves copy the state into
    staging buffers (host memory allocated once and reused, pinned for GPU tensors) and return;
    the write, checksums, upload and commit run on a background thread while training goes on,
    at most one save at a time. A failed background save is reported at the first
    :meth:`~spotrun.train.checkpointer.Checkpointer.end_of_step` after it ended on every rank
    (at a step that looks for requests, or at the next due save) and counts as a failed periodic
    save. ``save()`` and emergency saves are always synchronous. An emergency save requested by
    the supervisor gets the smaller of ``save_timeout_s`` and the time left until the request's
    ``deadline_unix_s``.

    Raises:
        ConfigError: a setting out of range.
    """

    uri: str | None = None
    """Checkpoint root; default ``$SPOTRUN_CHECKPOINT_URI``, else ``./checkpoints``."""
    interval_steps: int = 0
    """Save every this many steps in ``end_of_step``; 0 = never."""
    check_interval_steps: int = 1
    """Look for a save request every this many steps (each look is one all-reduce of a few flags)."""
    handle_signals: bool = True
    """Turn SIGTERM/SIGINT into an emergency-save request (main thread only; a second SIGINT interrupts)."""
    max_failed_periodic_saves: int = 3
    """Consecutive failed periodic saves tolerated (logged) before ``end_of_step`` raises."""
    save_timeout_s: float = DEFAULT_SAVE_TIMEOUT_S
    """Most seconds the storage operations of one save may take, retries included."""
    max_file_size_bytes: int = DEFAULT_MAX_FILE_SIZE_BYTES
    """Most bytes of one streamed shard file (4 GiB); a larger single tensor gets a file of its own."""
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    """Most bytes of one shard file's safetensors header (16 MiB; at most safetensors' 100 MB)."""
    background_saves: bool = True
    """Periodic and requested saves are staged, then written on a background thread (see above)."""
    on_save_in_flight: str = "wait"
    """A due save while the previous one is in flight: ``"wait"`` (logged) or ``"skip"`` (served later)."""
    event_interval_s: float | None = None
    """Rank 0's event log writes the newest step at most this often; default ``$SPOTRUN_EVENT_INTERVAL_S``, else 30."""
    keep_last: int | None = None
    """Retention: keep this many newest complete steps; ``None``: ``$SPOTRUN_KEEP_LAST``; unset or 0: all."""
    keep_every: int | None = None
    """Retention: also keep the steps divisible by this; ``None``: ``$SPOTRUN_KEEP_EVERY``."""
    memory_interval_steps: int | None = None
    """Save to the fast tier (host memory) every this many steps; ``None``: ``$SPOTRUN_MEMORY_INTERVAL_STEPS``."""
    memory_dir: str | None = None
    """The fast tier's checkpoint root (a tmpfs directory); ``None``: ``$SPOTRUN_MEMORY_DIR`` (``spotrun run``)."""
    memory_budget_bytes: int | None = None
    """Most bytes of this node's fast tier; ``None``: ``$SPOTRUN_MEMORY_BUDGET_BYTES``, else its free space."""
    restore_timeout_s: float | None = None
    """Bound of each collective of ``restore()``, seconds; ``None``: ``$SPOTRUN_RESTORE_TIMEOUT_S``, else 1800."""
    agreement_timeout_s: float | None = None
    """Bound of ``end_of_step``'s agreement, seconds; ``None``: ``$SPOTRUN_AGREEMENT_TIMEOUT_S``, else 300."""
    agreement: str | None = None
    """The per-step agreement: immediate, pipelined or auto (from 64 ranks); ``None``: ``$SPOTRUN_AGREEMENT``."""

    def __post_init__(self) -> None:
        if self.interval_steps < 0 or self.check_interval_steps < 1:
            raise ConfigError("interval_steps must be >= 0 and check_interval_steps >= 1")
        if not self.save_timeout_s > 0:
            raise ConfigError(f"save_timeout_s must be > 0, got {self.save_timeout_s}")
        for name in ("restore_timeout_s", "agreement_timeout_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a finite number > 0, got {value}")
        if (self.memory_interval_steps or 0) < 0 or (
            self.memory_budget_bytes is not None and self.memory_budget_bytes < 0
        ):
            raise ConfigError("memory_interval_steps and memory_budget_bytes must be >= 0")
        if self.agreement is not None:
            check_agreement(self.agreement)
        if self.on_save_in_flight not in ON_SAVE_IN_FLIGHT:
            raise ConfigError(f"on_save_in_flight must be one of {ON_SAVE_IN_FLIGHT}, got {self.on_save_in_flight!r}")

    def with_timeouts(self, env: WorkerEnv) -> CheckpointerOptions:
        """These options with the collectives' bounds left ``None`` taken from ``env``, else the
        defaults (``docs/reference/timeouts.md``)."""
        return replace(
            self,
            restore_timeout_s=self.restore_timeout_s or env.restore_timeout_s or DEFAULT_RESTORE_TIMEOUT_S,
            agreement_timeout_s=self.agreement_timeout_s or env.agreement_timeout_s or DEFAULT_AGREEMENT_TIMEOUT_S,
            agreement=check_agreement(self.agreement or env.agreement or "auto"),
        )


def option_attribute(name: str) -> property:
    """``options.<name>`` as an attribute of the object holding ``options``; setting it replaces them
    (checked again) through the holder's ``_use(options)``."""
    return property(
        lambda self: getattr(self.options, name),
        lambda self, value: self._use(replace(self.options, **{name: value})),
        doc=f"``options.{name}`` (:class:`CheckpointerOptions`).",
    )

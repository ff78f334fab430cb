"""Options of ``spotrun drill``: :class:`DrillConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from spotrun.control.env import DEFAULT_CHECKPOINT_URI
from spotrun.drill.clouds import clouds
from spotrun.errors import ConfigError
from spotrun.storage import StorageLocation, parse_location

#: Trigger used when neither ``after_steps`` nor ``after_s`` is given, in seconds.
DEFAULT_AFTER_S = 60.0


@dataclass(frozen=True)
class DrillConfig:
    """Options of ``spotrun drill``.

    Attributes:
        command: the launch command (``["torchrun", ...]``).
        cloud: whose notice to rehearse: a name of :func:`spotrun.drill.clouds.clouds`
            (``aws``, ``gcp``, ``azure``, ``signal``).
        after_steps: serve the notice once a checkpoint of a step >= this is complete.
        after_s: serve the notice this many seconds after the launch (default 60 when
            ``after_steps`` is not given either).
        checkpoint_uri: checkpoint root of the job.
        s3_endpoint_url: S3 endpoint for an ``s3://`` URI (as ``spotrun run``).
        grace_period_s: seconds from the notice to the (pretend) end of the machine;
            ``None``: the cloud's own lead (its ``lead_s``). A GCP notice carries no
            time: the supervisor gives it its 30 s window whatever this says.
        restart_timeout_s: seconds the restarted job may take to start, restore, run one
            step and save it. The reference run gets this plus twice phase 1's duration.
        exact_check: run phase 3, the uninterrupted reference run, and compare.
        reference_uri: the reference run's checkpoint root (must hold no objects);
            ``None``: a temporary directory for a local ``checkpoint_uri``,
            ``s3://bucket/prefix-drill-reference/<random>`` for ``s3://bucket/prefix``.
        keep_reference: leave the reference run's checkpoints in place (the report names them).
        log_format: ``--log-format`` of every ``spotrun run`` it starts; ``None``: their default.

    Raises:
        ConfigError: no command, an unknown cloud, both or bad triggers, bad durations, a
            bad ``reference_uri`` (also: the same as ``checkpoint_uri``, or given without
            the exact check).
    """

    command: tuple[str, ...]
    cloud: str = "aws"
    after_steps: int | None = None
    after_s: float | None = None
    checkpoint_uri: str = DEFAULT_CHECKPOINT_URI
    s3_endpoint_url: str | None = None
    grace_period_s: float | None = None
    restart_timeout_s: float = 600.0
    exact_check: bool = True
    reference_uri: str | None = None
    keep_reference: bool = False
    log_format: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command or not self.command[0]:
            raise ConfigError("no launch command given: use spotrun drill [options] -- COMMAND...")
        if self.cloud not in clouds():
            raise ConfigError(f"--cloud must be one of {', '.join(clouds())}, got {self.cloud!r}")
        if self.after_steps is not None and self.after_s is not None:
            raise ConfigError("give --after-steps or --after-s, not both")
        if self.after_steps is not None and self.after_steps < 1:
            raise ConfigError(f"--after-steps must be >= 1, got {self.after_steps}")
        for name in ("after_s", "grace_period_s", "restart_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"drill option {name} must be > 0, got {value}")
        parse_location(self.checkpoint_uri, endpoint_url=self.s3_endpoint_url)
        if not self.exact_check and (self.reference_uri is not None or self.keep_reference):
            raise ConfigError("--reference-uri and --keep-reference need the exact check (drop --no-exact-check)")
        if self.reference_uri is not None:
            if not self.reference_uri.strip():
                raise ConfigError("--reference-uri is empty")
            reference = parse_location(self.reference_uri, endpoint_url=self.s3_endpoint_url)
            if reference.uri.rstrip("/") == self.location.uri.rstrip("/"):
                raise ConfigError(f"--reference-uri must differ from --checkpoint-uri, both are {self.reference_uri}")

    @property
    def location(self) -> StorageLocation:
        """The checkpoint root with the drill's endpoint."""
        return parse_location(self.checkpoint_uri, endpoint_url=self.s3_endpoint_url)

    @property
    def lead_s(self) -> float:
        """Seconds between the drill's notice and its deadline."""
        return self.grace_period_s if self.grace_period_s is not None else clouds()[self.cloud].lead_s

"""Options of the node supervisor (``spotrun run``), validated when constructed."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from spotrun import env as spotrun_env
from spotrun.env import DEFAULT_CHECKPOINT_URI, default_safety_margin_s
from spotrun.checkpoint.retention import RetentionPolicy
from spotrun.errors import ConfigError
from spotrun.notices import NoticeOptions, parse_notice_option
from spotrun.notices.signals import DEFAULT_NOTICE_SIGNALS, parse_notice_signals

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
            deadline is ``notice + grace_period_s - safety_margin_s``. ``None`` (the default)
            picks :func:`~spotrun.env.default_safety_margin_s`: 5 s, or half the grace
            period when that is less. A command still running at the save deadline gets
            SIGTERM, and SIGKILL at the latest halfway through the margin.
        stop_timeout_s: most seconds between SIGTERM and SIGKILL when stopping the command
            (after a notice, cut short so that SIGKILL comes halfway through the safety margin
            at the latest).
        max_restarts: crash restarts allowed (a failure without a notice).
        restart_backoff_s: wait before the first restart in seconds; doubles every restart,
            capped at :data:`MAX_RESTART_BACKOFF_S`.
        s3_endpoint_url: S3 endpoint (``http://minio:9000``) for an ``s3://`` checkpoint URI,
            used by the supervisor and passed to the workers as ``AWS_ENDPOINT_URL_S3``;
            ``None`` keeps the standard AWS settings of the environment.
        notice: polling notice sources besides signals: ``auto`` (detect the cloud),
            ``none``, or a comma-separated list of ``aws``, ``gcp``, ``azure``, ``file``.
        notice_options: endpoints, Azure VM name, drill file and timings of those sources.
        notice_signals: the signals that are notices, comma-separated (``"TERM,INT,HUP,USR1,USR2"``,
            the default), or ``"none"``; every other signal that would end the supervisor is
            logged and ignored (see :mod:`spotrun.notices.signals`).
        log_format: ``text`` or ``json``, passed to the launch command as ``$SPOTRUN_LOG_FORMAT``
            (:mod:`spotrun.logs`); ``None``: whatever the environment has.
        keep_last, keep_every: retention for the workers' checkpoints (passed as
            ``SPOTRUN_KEEP_LAST``/``SPOTRUN_KEEP_EVERY``; see
            :class:`~spotrun.checkpoint.retention.RetentionPolicy`); ``None``: not set here.

    Raises:
        ConfigError: an empty command or an out-of-range value.
    """

    command: tuple[str, ...]
    checkpoint_uri: str = DEFAULT_CHECKPOINT_URI
    grace_period_s: float = 30.0
    safety_margin_s: float | None = None
    stop_timeout_s: float = 5.0
    max_restarts: int = 0
    restart_backoff_s: float = 10.0
    s3_endpoint_url: str | None = None
    notice: str = "auto"
    notice_options: NoticeOptions = field(default_factory=NoticeOptions)
    notice_signals: str = DEFAULT_NOTICE_SIGNALS
    log_format: str | None = None
    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command or not self.command[0]:
            raise ConfigError("no launch command given: use spotrun run -- COMMAND...")
        if not self.grace_period_s > 0 or self.grace_period_s == float("inf"):
            raise ConfigError(f"grace period must be > 0 s, got {self.grace_period_s}")
        if self.safety_margin_s is None:
            object.__setattr__(self, "safety_margin_s", default_safety_margin_s(self.grace_period_s))
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
        storage_options(self.checkpoint_uri, s3_endpoint_url=self.s3_endpoint_url)
        parse_notice_option(self.notice)
        parse_notice_signals(self.notice_signals)
        RetentionPolicy(keep_last=self.keep_last, keep_every=self.keep_every)

    def retention_env(self) -> dict[str, str]:
        """The retention variables for the launch command (only those given)."""
        given = {spotrun_env.KEEP_LAST: self.keep_last, spotrun_env.KEEP_EVERY: self.keep_every}
        return {name: str(value) for name, value in given.items() if value is not None}

    @property
    def notice_signal_numbers(self) -> frozenset[int]:
        """The signal numbers of :attr:`notice_signals`."""
        return parse_notice_signals(self.notice_signals)

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments of ``open_storage`` for :attr:`checkpoint_uri`."""
        return storage_options(self.checkpoint_uri, s3_endpoint_url=self.s3_endpoint_url)


def storage_options(uri: str, *, s3_endpoint_url: str | None) -> dict[str, Any]:
    """Keyword arguments of ``open_storage(uri, ...)`` for the command-line storage options.

    The endpoint only applies to ``s3://`` URIs and is ignored for local ones; ``None`` or
    ``""`` means the standard AWS settings.

    Raises:
        ConfigError: the endpoint is not an ``http://`` or ``https://`` URL.
    """
    if not s3_endpoint_url:
        return {}
    parts = urllib.parse.urlsplit(s3_endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--s3-endpoint-url must be an http:// or https:// URL, got {s3_endpoint_url!r}")
    return {"endpoint_url": s3_endpoint_url} if uri.strip().startswith("s3://") else {}

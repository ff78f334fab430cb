"""Where and how often the notice sources look: :class:`NoticeOptions`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from spotrun.errors import ConfigError
from spotrun.notices import azure, gcp
from spotrun.notices.dmi import dmi_root
from spotrun.notices.signals import DEFAULT_NOTICE_SIGNALS, parse_notice_signals


def _default_notice_signals() -> frozenset[int]:
    return parse_notice_signals(DEFAULT_NOTICE_SIGNALS)


@dataclass(frozen=True)
class NoticeOptions:
    """Where and how often the notice sources look.

    Attributes:
        aws_endpoint: IMDS URL; ``None``: ``$AWS_EC2_METADATA_SERVICE_ENDPOINT`` or
            ``http://169.254.169.254``.
        gcp_host: metadata ``host[:port]``; ``None``: ``$GCE_METADATA_HOST`` or
            ``metadata.google.internal``.
        azure_endpoint: IMDS URL; ``None``: ``http://169.254.169.254``.
        azure_vm_name: this VM's name in Azure events; ``None``: asked from IMDS.
        notice_file: path watched by the ``file`` source.
        notice_signals: the signal numbers that are notices (``--notice-signals``; default
            SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2).
        gcp_window_s: deadline of a GCP preemption, seconds after it is seen (30: the
            hard off follows the soft off by 30 s).
        poll_period_s: seconds between polls of every source; ``None``: each source's own
            default (AWS 2, GCP 1 between long polls, Azure 1, file 0.5).
        retry_after_error_s: pause after a failed poll; ``None``: each source's default
            (GCP 5 s, the others their poll period).
        http_timeout_s: bound on each metadata request, in seconds (2, as AWS NTH).
        gcp_wait_timeout_s: ``timeout_sec`` of GCP long polls, whole seconds.
        azure_first_call_timeout_s: bound on the first Scheduled Events request, seconds.
        detect_timeout_s: the longest ``auto`` waits for the cloud probes, in seconds.
        dmi_root: directory of the DMI files ``auto`` reads; ``None``: ``$SPOTRUN_DMI_ROOT``
            or ``/sys/class/dmi/id`` (see :mod:`spotrun.notices.dmi`).

    Raises:
        ConfigError: a negative or zero duration.
    """

    aws_endpoint: str | None = None
    gcp_host: str | None = None
    azure_endpoint: str | None = None
    azure_vm_name: str | None = None
    notice_file: str | None = None
    notice_signals: frozenset[int] = field(default_factory=_default_notice_signals)
    gcp_window_s: float = gcp.DEFAULT_PREEMPT_WINDOW_S
    poll_period_s: float | None = None
    retry_after_error_s: float | None = None
    http_timeout_s: float = 2.0
    gcp_wait_timeout_s: int = gcp.DEFAULT_WAIT_TIMEOUT_S
    azure_first_call_timeout_s: float = azure.DEFAULT_FIRST_CALL_TIMEOUT_S
    detect_timeout_s: float = 2.0
    dmi_root: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "notice_signals", frozenset(self.notice_signals))
        for name in (
            "gcp_window_s",
            "poll_period_s",
            "retry_after_error_s",
            "http_timeout_s",
            "azure_first_call_timeout_s",
            "detect_timeout_s",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"notice option {name} must be > 0, got {value}")

    def poll_timing(self, *, retry: bool = True) -> dict[str, float]:
        """``poll_period_s`` and (with ``retry``) ``retry_after_error_s`` as keyword arguments
        of a polled source, only those set here (the others keep the source's default)."""
        timing = {} if self.poll_period_s is None else {"poll_period_s": self.poll_period_s}
        if retry and self.retry_after_error_s is not None:
            timing["retry_after_error_s"] = self.retry_after_error_s
        return timing

    def dmi_path(self, environ: Mapping[str, str] | None = None) -> str:
        """The DMI directory ``auto`` reads."""
        return self.dmi_root or dmi_root(environ)

"""``--notice auto|none|LIST``: which notice sources to run, and cloud detection for ``auto``.

``LIST`` is a comma-separated subset of ``aws``, ``gcp``, ``azure``, ``signal``, ``file``.
``auto`` means signals, the file source if a notice file is configured, and the cloud found
in two steps:

1. Local facts only (:func:`plan_detection`, no network): the DMI strings under
   ``/sys/class/dmi/id`` (:mod:`spotrun.notices.dmi`) may name AWS, GCP or Azure, and the
   user may have named a metadata endpoint (``AWS_EC2_METADATA_SERVICE_ENDPOINT``,
   ``GCE_METADATA_HOST``, ``--aws-metadata-endpoint``, ``--gcp-metadata-host``,
   ``--azure-metadata-endpoint``). Only those clouds are candidates. Off a cloud, and where
   DMI is hidden (some containers) with no endpoint set, there is no candidate and
   nothing at all is sent: no DNS query, no connection.
2. The candidates' metadata servers get a short probe (in parallel; detection gives up after
   ``detect_timeout_s``, 2 s by default); the first that answers like its cloud is used.

``none`` means no source at all (not even signals). Naming a cloud (``--notice aws``)
polls its metadata server without any detection.

Signals are not a :class:`~spotrun.notices.base.NoticeSource`: the supervisor routes them
itself (:func:`spotrun.supervisor.notices.signal_notices`); :attr:`NoticeChoice.signals`
says whether it should treat them as notices.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from spotrun.errors import ConfigError
from spotrun.notices import aws, azure, gcp
from spotrun.notices.base import NoticeSource
from spotrun.notices.dmi import DmiFacts, cloud_from_dmi, dmi_root, read_dmi
from spotrun.notices.files import FileSource

log = logging.getLogger(__name__)

SOURCE_NAMES = ("aws", "gcp", "azure", "signal", "file")
CLOUDS = ("aws", "gcp", "azure")


@dataclass(frozen=True)
class NoticeChoice:
    """A parsed ``--notice`` value.

    Attributes:
        auto: detect the cloud when the sources are built.
        names: the sources named explicitly (empty for ``auto`` and ``none``).
    """

    auto: bool
    names: frozenset[str]

    @property
    def signals(self) -> bool:
        """Whether SIGTERM, SIGINT and SIGHUP count as notices."""
        return self.auto or "signal" in self.names


def parse_notice_option(value: str) -> NoticeChoice:
    """Parse ``auto``, ``none`` or a comma-separated list such as ``aws,signal``.

    Raises:
        ConfigError: an empty value, an unknown name, or auto/none mixed with names.
    """
    parts = [p.strip().lower() for p in str(value).split(",")]
    if parts == ["auto"]:
        return NoticeChoice(auto=True, names=frozenset())
    if parts == ["none"]:
        return NoticeChoice(auto=False, names=frozenset())
    unknown = [p for p in parts if p not in SOURCE_NAMES]
    if not value.strip() or unknown:
        raise ConfigError(
            f"--notice: expected auto, none or a comma-separated list of {', '.join(SOURCE_NAMES)}; "
            f"got {value!r}"
        )
    return NoticeChoice(auto=False, names=frozenset(parts))


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
    gcp_window_s: float = gcp.DEFAULT_PREEMPT_WINDOW_S
    poll_period_s: float | None = None
    retry_after_error_s: float | None = None
    http_timeout_s: float = 2.0
    gcp_wait_timeout_s: int = gcp.DEFAULT_WAIT_TIMEOUT_S
    azure_first_call_timeout_s: float = azure.DEFAULT_FIRST_CALL_TIMEOUT_S
    detect_timeout_s: float = 2.0
    dmi_root: str | None = None

    def __post_init__(self) -> None:
        for name in ("gcp_window_s", "poll_period_s", "retry_after_error_s", "http_timeout_s",
                     "azure_first_call_timeout_s", "detect_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"notice option {name} must be > 0, got {value}")

    def aws_url(self, environ: Mapping[str, str] | None = None) -> str:
        """The AWS endpoint in use."""
        return self.aws_endpoint or aws.endpoint_from_env(environ)

    def gcp_url(self, environ: Mapping[str, str] | None = None) -> str:
        """The GCP metadata base URL in use (``http://host[:port]``)."""
        return "http://" + self.gcp_host if self.gcp_host else gcp.base_url_from_env(environ)

    def azure_url(self) -> str:
        """The Azure endpoint in use."""
        return self.azure_endpoint or azure.DEFAULT_ENDPOINT

    def dmi_path(self, environ: Mapping[str, str] | None = None) -> str:
        """The DMI directory ``auto`` reads."""
        return self.dmi_root or dmi_root(environ)

    def named_endpoints(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """Clouds whose metadata endpoint the user set -> which setting named it."""
        env = os.environ if environ is None else environ
        named = {}
        if self.aws_endpoint:
            named["aws"] = "--aws-metadata-endpoint is set"
        elif env.get(aws.ENDPOINT_ENV):
            named["aws"] = f"{aws.ENDPOINT_ENV} is set"
        if self.gcp_host:
            named["gcp"] = "--gcp-metadata-host is set"
        elif env.get(gcp.HOST_ENV):
            named["gcp"] = f"{gcp.HOST_ENV} is set"
        if self.azure_endpoint:
            named["azure"] = "--azure-metadata-endpoint is set"
        return named

    def url_of(self, cloud: str, environ: Mapping[str, str] | None = None) -> str:
        """The metadata base URL of ``cloud`` (``aws``, ``gcp`` or ``azure``)."""
        if cloud == "aws":
            return self.aws_url(environ)
        if cloud == "gcp":
            return self.gcp_url(environ)
        return self.azure_url()


#: How a user opts in where ``auto`` finds no cloud (logged with that finding).
OPT_IN_HINT = (f"name the source (--notice aws, gcp or azure) or set its endpoint ({aws.ENDPOINT_ENV}, "
               f"{gcp.HOST_ENV}, --aws-metadata-endpoint, --gcp-metadata-host, --azure-metadata-endpoint)")


@dataclass(frozen=True)
class DetectionPlan:
    """What ``auto`` probes, decided from local facts only (:func:`plan_detection`).

    Attributes:
        dmi: the DMI facts read.
        dmi_cloud: the cloud they name, or ``None``.
        probes: cloud -> (metadata base URL, why it is a candidate), in probing order;
            empty means nothing is sent anywhere.
    """

    dmi: DmiFacts
    dmi_cloud: str | None
    probes: Mapping[str, tuple[str, str]]

    def summary(self) -> str:
        """One log line: what was found and what will be probed."""
        if self.probes:
            listed = ", ".join(f"{cloud} at {url} ({why})" for cloud, (url, why) in self.probes.items())
            return f"--notice auto: probing {listed}"
        if not self.dmi.available:
            found = f"no DMI facts readable under {self.dmi.root} (hidden, as in some containers)"
        else:
            found = f"DMI ({self.dmi.describe()}) names no cloud"
        return (f"--notice auto: {found}: no metadata server probed, no cloud notices (signals still are); "
                f"to poll one, {OPT_IN_HINT}")


def plan_detection(options: NoticeOptions, *, environ: Mapping[str, str] | None = None) -> DetectionPlan:
    """The clouds ``auto`` may probe: the one DMI names, and those whose endpoint is set.

    Reads only local files (the DMI directory); sends nothing anywhere.
    """
    env = os.environ if environ is None else environ
    facts = read_dmi(options.dmi_path(env))
    dmi_cloud = cloud_from_dmi(facts)
    reasons = options.named_endpoints(env)
    if dmi_cloud is not None:
        reasons.setdefault(dmi_cloud, f"DMI names it: {facts.describe()}")
    probes = {cloud: (options.url_of(cloud, env), reasons[cloud]) for cloud in CLOUDS if cloud in reasons}
    return DetectionPlan(dmi=facts, dmi_cloud=dmi_cloud, probes=probes)


def detect_cloud(options: NoticeOptions, *, environ: Mapping[str, str] | None = None,
                 plan: DetectionPlan | None = None) -> str | None:
    """The cloud ``auto`` uses: of the candidates of ``plan`` (default :func:`plan_detection`),
    the first whose metadata server answers like its cloud, or ``None``.

    With no candidate, returns at once and sends nothing. Otherwise it probes only the
    candidates, in parallel, and returns within about ``options.detect_timeout_s`` seconds
    whatever the network does (probes still blocked, e.g. in a DNS lookup, are left to end
    in daemon threads).
    """
    plan = plan_detection(options, environ=environ) if plan is None else plan
    log.info("%s", plan.summary())
    if not plan.probes:
        return None
    timeout_s = options.detect_timeout_s
    probe_of = {"aws": aws.probe, "gcp": gcp.probe, "azure": azure.probe}
    answers: queue.SimpleQueue = queue.SimpleQueue()

    def run(cloud: str, url: str) -> None:
        try:
            answers.put((cloud, probe_of[cloud](url, timeout_s)))
        except Exception:  # a probe must never break start-up
            log.debug("probing %s failed", cloud, exc_info=True)
            answers.put((cloud, False))

    for cloud, (url, _why) in plan.probes.items():
        threading.Thread(target=run, args=(cloud, url), name=f"spotrun-probe-{cloud}", daemon=True).start()
    end = time.monotonic() + timeout_s
    for _ in plan.probes:
        try:
            cloud, found = answers.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            break
        if found:
            log.info("detected %s: its metadata server answered", cloud)
            return cloud
    if plan.dmi_cloud is not None:
        log.warning("DMI says this is %s but its metadata server at %s did not answer within %.1f s (IMDS "
                    "disabled, or on AWS in a container an IMDS hop limit below 2?): no %s notices",
                    plan.dmi_cloud, plan.probes[plan.dmi_cloud][0], timeout_s, plan.dmi_cloud)
    else:
        log.info("no metadata server answered within %.1f s", timeout_s)
    return None


def build_sources(choice: NoticeChoice, options: NoticeOptions, *,
                  environ: Mapping[str, str] | None = None, plan: DetectionPlan | None = None) -> list[NoticeSource]:
    """The polling sources for ``choice`` (signals excluded: see :attr:`NoticeChoice.signals`).

    With ``choice.auto`` this runs :func:`detect_cloud` first (given ``plan``, or a new
    :func:`plan_detection`): immediate and silent on the network when there is no
    candidate, else at most about ``options.detect_timeout_s`` seconds of probing.

    Raises:
        ConfigError: ``file`` chosen without ``options.notice_file``, or a bad URL.
    """
    env = os.environ if environ is None else environ
    names = set(choice.names)
    if choice.auto:
        cloud = detect_cloud(options, environ=env, plan=plan)
        if cloud is not None:
            names.add(cloud)
        if options.notice_file:
            names.add("file")
    timing = {} if options.poll_period_s is None else {"poll_period_s": options.poll_period_s}
    retry = {} if options.retry_after_error_s is None else {"retry_after_error_s": options.retry_after_error_s}
    sources: list[NoticeSource] = []
    if "aws" in names:
        sources.append(aws.AwsSource(options.aws_url(env), timeout_s=options.http_timeout_s, **timing, **retry))
    if "gcp" in names:
        sources.extend(gcp.gcp_sources(
            options.gcp_url(env), window_s=options.gcp_window_s, timeout_s=options.http_timeout_s,
            wait_timeout_s=options.gcp_wait_timeout_s, **timing, **retry,
        ))
    if "azure" in names:
        sources.append(azure.AzureSource(
            options.azure_url(), vm_name=options.azure_vm_name, timeout_s=options.http_timeout_s,
            first_call_timeout_s=options.azure_first_call_timeout_s, **timing, **retry,
        ))
    if "file" in names:
        if not options.notice_file:
            raise ConfigError("--notice file needs a notice file path")
        sources.append(FileSource(options.notice_file, **timing))
    return sources

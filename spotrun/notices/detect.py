"""Which notice sources run: ``--notice auto|none|LIST``, and cloud detection for ``auto``.

The signal source always runs. ``auto`` adds the file source if a notice file is set, and the
cloud found first from local facts only (DMI strings, endpoints the user named: off a cloud
nothing at all is sent), then by a short probe of the candidates' metadata servers, in a
background thread so it never delays the launch. Details: ``docs/design/internals.md`` (Notices).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from spotrun.notices import aws, gcp
from spotrun.notices.base import NoticeSource, NoticeWatch
from spotrun.notices.dmi import DmiFacts, cloud_from_dmi, read_dmi
from spotrun.notices.options import NoticeOptions
from spotrun.notices.registry import CLOUDS, SOURCES, NoticeChoice

log = logging.getLogger(__name__)


#: How a user opts in where ``auto`` finds no cloud (logged with that finding).
OPT_IN_HINT = (
    f"name the source (--notice aws, gcp or azure) or set its endpoint ({aws.ENDPOINT_ENV}, "
    f"{gcp.HOST_ENV}, --aws-metadata-endpoint, --gcp-metadata-host, --azure-metadata-endpoint)"
)


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
        return (
            f"--notice auto: {found}: no metadata server probed, no cloud notices (signals still are); "
            f"to poll one, {OPT_IN_HINT}"
        )


def plan_detection(options: NoticeOptions, *, environ: Mapping[str, str] | None = None) -> DetectionPlan:
    """The clouds ``auto`` may probe: the one DMI names, and those whose endpoint is set.

    Reads only local files (the DMI directory); sends nothing anywhere.
    """
    env = os.environ if environ is None else environ
    facts = read_dmi(options.dmi_path(env))
    dmi_cloud = cloud_from_dmi(facts)
    probes = {}
    for cloud in CLOUDS:
        url, named_by = SOURCES[cloud].endpoint(options, env)
        why = named_by or (f"DMI names it: {facts.describe()}" if cloud == dmi_cloud else None)
        if why is not None:
            probes[cloud] = (url, why)
    return DetectionPlan(dmi=facts, dmi_cloud=dmi_cloud, probes=probes)


def detect_cloud(
    options: NoticeOptions, *, environ: Mapping[str, str] | None = None, plan: DetectionPlan | None = None
) -> str | None:
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
    answers: queue.SimpleQueue = queue.SimpleQueue()

    def run(cloud: str, url: str) -> None:
        try:
            answers.put((cloud, SOURCES[cloud].probe(url, timeout_s)))
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
        log.warning(
            "DMI says this is %s but its metadata server at %s did not answer within %.1f s (IMDS "
            "disabled, or on AWS in a container an IMDS hop limit below 2?): no %s notices",
            plan.dmi_cloud,
            plan.probes[plan.dmi_cloud][0],
            timeout_s,
            plan.dmi_cloud,
        )
    else:
        log.info("no metadata server answered within %.1f s", timeout_s)
    return None


def always_on_sources(options: NoticeOptions, *, environ: Mapping[str, str] | None = None) -> list[NoticeSource]:
    """The sources that run whatever ``--notice`` says (the signal source)."""
    env = os.environ if environ is None else environ
    return [
        source
        for registration in SOURCES.values()
        if registration.always
        for source in registration.build(options, env)
    ]


def build_sources(
    choice: NoticeChoice,
    options: NoticeOptions,
    *,
    environ: Mapping[str, str] | None = None,
    plan: DetectionPlan | None = None,
) -> list[NoticeSource]:
    """The sources ``choice`` adds to :func:`always_on_sources`.

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
        names.update(
            name
            for name, registration in SOURCES.items()
            if registration.in_auto is not None and registration.in_auto(options)
        )
    return [
        source
        for name, registration in SOURCES.items()
        if name in names and not registration.always
        for source in registration.build(options, env)
    ]


def start_sources(
    choice: NoticeChoice, options: NoticeOptions, watch: NoticeWatch, *, environ: Mapping[str, str] | None = None
) -> None:
    """Start on ``watch`` the always-on sources, then those of ``choice``.

    Where ``auto`` has candidate clouds to probe, the sources of ``choice`` are built and
    started in a background thread after the probes, so the launch never waits for them.

    Raises:
        ConfigError: ``file`` without a notice file, or a bad endpoint URL - found here,
            before anything is launched (``auto``'s probes themselves never raise).
        ValueError: not called from the main thread (the signal source).
    """
    env = os.environ if environ is None else environ
    watch.start(always_on_sources(options, environ=env))
    plan = plan_detection(options, environ=env) if choice.auto else None
    if plan is None or not plan.probes:
        watch.start(build_sources(choice, options, environ=env, plan=plan))
        return
    threading.Thread(
        target=_detect_then_start, args=(choice, options, watch, env, plan), name="spotrun-notice-detect", daemon=True
    ).start()


def _detect_then_start(
    choice: NoticeChoice, options: NoticeOptions, watch: NoticeWatch, environ: Mapping[str, str], plan: DetectionPlan
) -> None:
    try:
        sources = build_sources(choice, options, environ=environ, plan=plan)
    except Exception as exc:  # a probe must never take the supervisor down
        log.warning("cloud detection failed (%s): only signals are notices", exc)
        return
    if not sources:
        log.info("no cloud metadata server answered: signals are the only notices")
    watch.start(sources)

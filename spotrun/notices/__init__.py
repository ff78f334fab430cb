"""Preemption notice sources: AWS, GCP, Azure metadata servers and a drill file.

Typical use in the supervisor::

    choice = parse_notice_option(args.notice)               # ConfigError on a bad value
    sources = build_sources(choice, NoticeOptions(...))     # auto: may probe DMI-named clouds (<= ~2 s)
    with NoticePollers(sources, inbox.post):                # one daemon thread per source
        ...                                                 # notices arrive in the inbox

Every notice is a :class:`spotrun.supervisor.notices.Notice`; :func:`is_stop` tells a stop
notice from a rebalance recommendation (kind :data:`REBALANCE`: an ordinary checkpoint).
"""

from spotrun.notices.base import (
    REBALANCE,
    Finding,
    NoticePoller,
    NoticePollers,
    NoticeSource,
    PollProblem,
    is_stop,
)
from spotrun.notices.detect import (
    SOURCE_NAMES,
    DetectionPlan,
    NoticeChoice,
    NoticeOptions,
    build_sources,
    detect_cloud,
    parse_notice_option,
    plan_detection,
)
from spotrun.notices.dmi import DMI_ROOT_ENV, DmiFacts, cloud_from_dmi, read_dmi

__all__ = [
    "DMI_ROOT_ENV",
    "REBALANCE",
    "SOURCE_NAMES",
    "DetectionPlan",
    "DmiFacts",
    "Finding",
    "NoticeChoice",
    "NoticeOptions",
    "NoticePoller",
    "NoticePollers",
    "NoticeSource",
    "PollProblem",
    "build_sources",
    "cloud_from_dmi",
    "detect_cloud",
    "is_stop",
    "parse_notice_option",
    "plan_detection",
    "read_dmi",
]

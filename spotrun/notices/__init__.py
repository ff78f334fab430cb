"""Preemption notices: the supervisor's signals, AWS, GCP, Azure metadata servers, a drill file.

Every source (:mod:`~spotrun.notices.base`) delivers to one :class:`Inbox`
(:mod:`~spotrun.notices.inbox`) that the supervisor's main loop reads;
:mod:`~spotrun.notices.detect` chooses which sources run (``--notice``). The modules and the
typical use: ``docs/design/internals.md`` (Notices).
"""

from spotrun.notices.base import (
    REBALANCE,
    Finding,
    Notice,
    NoticePoller,
    NoticeSource,
    NoticeWatch,
    PolledSource,
    PollProblem,
    is_stop,
)
from spotrun.notices.detect import (
    DetectionPlan,
    always_on_sources,
    build_sources,
    detect_cloud,
    plan_detection,
    start_sources,
)
from spotrun.notices.dmi import DMI_ROOT_ENV, DmiFacts, cloud_from_dmi, read_dmi
from spotrun.notices.inbox import Inbox
from spotrun.notices.options import NoticeOptions
from spotrun.notices.registry import SOURCE_NAMES, SOURCES, NoticeChoice, Registration, parse_notice_option

__all__ = [
    "DMI_ROOT_ENV",
    "REBALANCE",
    "SOURCES",
    "SOURCE_NAMES",
    "DetectionPlan",
    "DmiFacts",
    "Finding",
    "Inbox",
    "Notice",
    "NoticeChoice",
    "NoticeOptions",
    "NoticePoller",
    "NoticeSource",
    "NoticeWatch",
    "PollProblem",
    "PolledSource",
    "Registration",
    "always_on_sources",
    "build_sources",
    "cloud_from_dmi",
    "detect_cloud",
    "is_stop",
    "parse_notice_option",
    "plan_detection",
    "read_dmi",
    "start_sources",
]

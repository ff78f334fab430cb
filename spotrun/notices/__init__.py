"""Preemption notices: the supervisor's signals, AWS, GCP, Azure metadata servers, a drill file.

* :mod:`~spotrun.notices.base`      :class:`Notice`, the :class:`NoticeSource` interface, polled sources;
* :mod:`~spotrun.notices.inbox`     :class:`Inbox`, where every source delivers and the main loop reads;
* :mod:`~spotrun.notices.signals`   the signal source (always on) and ``--notice-signals``;
* :mod:`~spotrun.notices.aws`, :mod:`~spotrun.notices.gcp`, :mod:`~spotrun.notices.azure`,
  :mod:`~spotrun.notices.files`     one source each;
* :mod:`~spotrun.notices.registry`  every source by its ``--notice`` name;
* :mod:`~spotrun.notices.detect`    which sources run (``--notice auto``: DMI facts, probes);
* :mod:`~spotrun.notices.options`   :class:`NoticeOptions`, where and how often the sources look.

Typical use in the supervisor::

    with Inbox() as inbox, NoticeWatch(inbox) as watch:
        start_sources(parse_notice_option("auto"), NoticeOptions(...), watch)  # main thread
        events = inbox.wait(timeout_s)                                          # Notice, ...
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

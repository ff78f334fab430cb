"""Start the cloud notice sources chosen with ``--notice`` for the supervisor.

Signals (SIGTERM, SIGINT, SIGHUP) are always notices: Kubernetes, systemd and GCP's soft
off all send SIGTERM, so turning them off could only lose a save. ``--notice`` picks the
*polling* sources on top of them: ``auto`` (default: detect the cloud), ``none``, or a
list such as ``aws,file``.

``auto`` first decides from local facts (DMI strings, endpoint settings) which clouds are
candidates, here, before the launch, sending nothing; off a cloud there is none and no
metadata server is ever contacted. Candidates' metadata servers are probed for up to about
two seconds in a background thread, so that never delays the launch of the training command.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from spotrun.notices import NoticeOptions, NoticePollers, build_sources, parse_notice_option, plan_detection
from spotrun.supervisor.notices import Notice

log = logging.getLogger(__name__)


class CloudNotices:
    """The polling notice sources of one supervisor run.

    Args:
        notice: the ``--notice`` value.
        options: endpoints and timings of the sources.
        post: where notices go (the supervisor's ``Inbox.post``).

    Raises:
        ConfigError: a bad ``--notice`` value, ``file`` without a notice file, or a bad
            endpoint URL - found here, before anything is launched (``auto``'s probes
            themselves never raise).
    """

    def __init__(self, notice: str, options: NoticeOptions, post: Callable[[Notice], None]) -> None:
        self._choice = parse_notice_option(notice)
        self._options = options
        self._post = post
        self._lock = threading.Lock()
        self._stopped = False
        self._pollers: NoticePollers | None = None
        self._plan = plan_detection(options) if self._choice.auto else None
        needs_probes = self._plan is not None and bool(self._plan.probes)
        self._sources = None if needs_probes else build_sources(self._choice, options, plan=self._plan)

    def start(self) -> None:
        """Start polling (for ``auto`` with candidates: after their probes, in the background)."""
        if self._sources is not None:
            self._start_pollers(self._sources)
        else:
            threading.Thread(target=self._detect_then_start, name="spotrun-notice-detect", daemon=True).start()

    def _detect_then_start(self) -> None:
        try:
            sources = build_sources(self._choice, self._options, plan=self._plan)
        except Exception as exc:  # a probe must never take the supervisor down
            log.warning("cloud detection failed (%s): only signals are notices", exc)
            return
        if not sources:
            log.info("no cloud metadata server answered: signals are the only notices")
        self._start_pollers(sources)

    def _start_pollers(self, sources) -> None:
        with self._lock:
            if self._stopped or not sources:
                return
            self._pollers = NoticePollers(sources, self._post)
            self._pollers.start()

    def stop(self) -> None:
        """Stop polling; no notice is posted after this returns."""
        with self._lock:
            self._stopped = True
            pollers, self._pollers = self._pollers, None
        if pollers is not None:
            pollers.stop(timeout_s=1.0)

"""The preemption notice for scripts that save by their own means (no :class:`~spotrun.Checkpointer`).

Under ``spotrun run`` a notice becomes ``save-request.json`` in ``$SPOTRUN_CONTROL_DIR``;
:func:`preemption_notice` reads it (a few microseconds: cheap enough for every step) and returns
the reason and deadline, or ``None``. Every rank must act on the same step: turn the answers
into one decision with a single all-reduce at the step boundary, as in the example in
``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from spotrun.control import files as control
from spotrun.control import listeners
from spotrun.control.env import CONTROL_DIR
from spotrun.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreemptionNotice:
    """A pending notice: save (if ``save``) at the next step boundary, then exit.

    Attributes:
        reason: what the supervisor saw (``"SIGTERM"``, ``"aws spot instance-action"``, ...).
        deadline_unix_s: when the checkpoint must be written by (seconds since the epoch; the
            supervisor's safety margin already taken off); ``None``: no known deadline.
        requested_unix_s: when the supervisor wrote the request (seconds since the epoch).
        save: ``False`` when the supervisor found no time left for a save: stop without one.
    """

    reason: str
    deadline_unix_s: float | None
    requested_unix_s: float
    save: bool = True

    def seconds_left(self, now_unix_s: float | None = None) -> float | None:
        """Seconds until the deadline (0.0 once it passed), or ``None`` without a deadline."""
        if self.deadline_unix_s is None:
            return None
        return max(0.0, self.deadline_unix_s - (time.time() if now_unix_s is None else now_unix_s))


def preemption_notice(env: Mapping[str, str] = os.environ) -> PreemptionNotice | None:
    """The pending preemption notice of this node, or ``None``.

    Cheap enough for every step: without a notice, one failed ``open`` of the request file
    (and nothing at all outside ``spotrun run``). Once a notice came, every later call returns
    it too. A request file that cannot be parsed is taken as a notice without a deadline
    (logged): saving is the safe reading.

    Args:
        env: where ``$SPOTRUN_CONTROL_DIR`` is read (the process environment by default).
    """
    control_dir = env.get(CONTROL_DIR)
    if not control_dir:
        return None
    listeners.announce("poll", env)
    try:
        request = control.read_save_request(control_dir)
    except ConfigError as exc:
        log.warning("%s; taking it as a preemption notice", exc)
        return PreemptionNotice(reason="unreadable save request", deadline_unix_s=None, requested_unix_s=time.time())
    if request is None:
        return None
    return PreemptionNotice(
        reason=request.reason,
        deadline_unix_s=request.deadline_unix_s,
        requested_unix_s=request.requested_unix_s,
        save=request.save,
    )


class NoticeWatch:
    """A daemon thread that calls a callback once when a notice comes (:func:`on_preemption_notice`).

    Attributes:
        notice: the notice passed to the callback, ``None`` before.
    """

    def __init__(
        self, callback: Callable[[PreemptionNotice], object], poll_interval_s: float, env: Mapping[str, str]
    ) -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self.notice: PreemptionNotice | None = None
        self._callback = callback
        self._poll_interval_s = poll_interval_s
        self._env = env
        self._cancelled = threading.Event()
        self._thread: threading.Thread | None = None
        if env.get(CONTROL_DIR):
            listeners.announce("poll", env)  # at once, not only at the thread's first look
            self._thread = threading.Thread(target=self._run, name="spotrun-notice-watch", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        """Whether the thread still watches (False without ``spotrun run``, after the
        callback ran, or after :meth:`cancel`)."""
        return self._thread is not None and self._thread.is_alive()

    def cancel(self, timeout_s: float | None = None) -> None:
        """Stop watching; the callback is not called after this returns (unless it is running
        now, in which case this waits up to ``timeout_s`` for it). Idempotent."""
        self._cancelled.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._cancelled.is_set():
            notice = preemption_notice(self._env)
            if notice is not None and not self._cancelled.is_set():
                self.notice = notice
                try:
                    self._callback(notice)
                except Exception:  # a daemon thread: nobody else would see it
                    log.exception("the preemption notice callback failed")
                return
            self._cancelled.wait(self._poll_interval_s)


def on_preemption_notice(
    callback: Callable[[PreemptionNotice], object], poll_interval_s: float = 0.5, env: Mapping[str, str] = os.environ
) -> NoticeWatch:
    """Call ``callback(notice)`` once, from a daemon thread, when a preemption notice comes.

    The thread looks every ``poll_interval_s`` seconds. The callback runs in that thread, not
    at a step boundary: let it set a flag that the training loop reads (and agree on the step
    with the all-reduce shown in this module's docstring); do not run collectives from it.
    Without ``spotrun run`` no thread starts and the callback is never called.

    Returns:
        The watch; :meth:`NoticeWatch.cancel` stops it.

    Raises:
        ValueError: ``poll_interval_s`` is not > 0.
    """
    return NoticeWatch(callback, poll_interval_s, env)

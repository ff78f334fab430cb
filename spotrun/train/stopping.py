"""Stopping the job: the emergency checkpoint at an agreed step, or a stop without one, and
what happens to a background save in flight then (:meth:`spotrun.train.saving.Saves.settle`).

Both are collectives, called through :func:`stop` by :meth:`spotrun.train.checkpointer.Checkpointer.end_of_step`
on every rank at the same step; the caller then records the stop (:func:`report_stop`).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from spotrun.control import files as control
from spotrun.tools import dist
from spotrun.train.decision import Action, Decision
from spotrun.train.events import TrainingEvents
from spotrun.train.requests import Asked, StopRequests
from spotrun.train.saving import Saves

log = logging.getLogger("spotrun.checkpointer")  # the Checkpointer's log lines, as they always were


def emergency_save(saves: Saves, requests: StopRequests, step: int, asked: Asked, why: str | None = None) -> bool:
    """Save ``step`` before the job stops; return whether it was saved (False: a background
    save in flight took the time, and it is the resume point). ``asked``: this rank's requests
    as read at this step (they bound the save's time), ``why``: who asked when they do not say."""
    if dist.rank() == 0:
        log.warning("save requested (%s): emergency checkpoint of step %d", why or asked.describe(), step)
    # A dying DataLoader worker sends SIGCHLD, whose torch handler raises in this
    # thread; keep it from aborting the save. The process exits right after.
    previous_mask = None
    if threading.current_thread() is threading.main_thread():
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        save = True
        timeout_s = requests.emergency_timeout_s(asked, saves.options.save_timeout_s)
        if saves.options.background_saves:
            save, timeout_s = saves.settle(step, timeout_s, may_save=True)
        if save and saves.last_saved_step != step:
            saves.save_now(step, "emergency", timeout_s=timeout_s)
    except BaseException:
        if previous_mask is not None:  # the process goes on (or unwinds): give SIGCHLD back
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        raise
    return save


def stop_without_save(saves: Saves, requests: StopRequests, step: int, asked: Asked) -> None:
    """Stop after ``step`` without saving it: a save in flight is finished or abandoned, and the
    newest complete checkpoint stays the resume point."""
    if saves.options.background_saves:
        saves.settle(step, requests.emergency_timeout_s(asked, saves.options.save_timeout_s), may_save=False)
    if dist.rank() == 0:
        log.warning(
            "stop requested without a save (%s): stopping after step %d; the newest complete "
            "checkpoint (step %s here) stays the resume point",
            asked.describe(),
            step,
            saves.last_saved_step,
        )


def save_to_memory(tier: Any, saves: Saves, requests: StopRequests, step: int, asked: Asked) -> bool:
    """Save ``step`` into the fast tier before the job stops, a save to storage not fitting before the
    deadline (a save in flight to storage is finished or abandoned first); return whether it committed.
    The supervisors copy it to another node, and a node that stays writes it to storage."""
    timeout_s = requests.emergency_timeout_s(asked, saves.options.save_timeout_s)
    if saves.options.background_saves:
        saves.settle(step, timeout_s, may_save=False)
    if dist.rank() == 0:
        log.warning("save requested (%s): emergency checkpoint of step %d to the fast tier", asked.describe(), step)
    saved = tier is not None and tier.save_emergency(step, requests.emergency_timeout_s(asked, timeout_s))
    if not saved and dist.rank() == 0:
        log.error("the emergency checkpoint of step %d to the fast tier failed: stopping without one", step)
    return saved


def report_stop(
    events: TrainingEvents, control_dir: str | None, step: int, *, saved: bool, tier: str | None = None
) -> None:
    """Record the stop after ``step``: in the event log, and (local rank 0, under ``spotrun run``)
    to the supervisor as a commit report (``saved``, to ``tier``: storage by default) or a stop report
    (this step is lost; a save that was in flight, if it committed, is the resume point)."""
    events.stopped(step, saved=saved)
    if control_dir and dist.local_rank() == 0:
        if saved:
            control.write_commit_report(control_dir, step, tier or "storage")
        else:
            control.write_stop_report(control_dir, step)


def stop(
    decision: Decision, saves: Saves, requests: StopRequests, step: int, asked: Asked | None, tier: Any = None
) -> bool:
    """The stop ``decision`` asks for at ``step``: an emergency save (to storage, or to the fast
    ``tier``), or a stop without one; return whether ``step`` was saved. ``asked``: this rank's
    requests if read at this step."""
    if decision.action is Action.STOP_WITHOUT_SAVE:
        stop_without_save(saves, requests, step, asked)
        return False
    if decision.action is Action.SAVE_TO_MEMORY_AND_STOP:
        return save_to_memory(tier, saves, requests, step, asked or requests.read())
    # $SPOTRUN_STOP_AT_STEP needs no look at the requests: read once here
    return emergency_save(saves, requests, step, asked or requests.read(), decision.why)

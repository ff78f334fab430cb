"""What the workers reported when a launch ended, and which checkpoint the job resumes from.

Helpers of :mod:`spotrun.supervisor.run` that read the control channel's reports
(:mod:`spotrun.control.files`) and the checkpoint catalog after the launch command exited; they
log what they find, for the supervisor to choose its exit code.
"""

from __future__ import annotations

import logging
import os

from spotrun.checkpoint import catalog, fencing
from spotrun.control import files as control
from spotrun.control.env import STOP_AT_STEP
from spotrun.errors import SpotrunError
from spotrun.storage import Storage

log = logging.getLogger("spotrun.supervisor.run")  # the supervisor's own log lines


def check_resume_point(storage: Storage, *, declined: bool = False) -> None:
    """Without an emergency checkpoint: make sure (and say) which complete checkpoint the job
    resumes from. ``declined``: the supervisor found no time for one (else none committed)."""
    try:
        newest = catalog.newest_complete(storage)
    except SpotrunError as exc:
        log.error("cannot list the checkpoints to confirm the resume point: %s", exc)
        return
    why = "no time for one" if declined else "none committed"
    if newest is None:
        log.warning(
            "no emergency checkpoint (%s) and no complete checkpoint on storage: the job restarts from step 0", why
        )
    else:
        log.warning(
            "no emergency checkpoint (%s): the newest complete checkpoint is step %d "
            "(%s; manifest and every file present with its recorded size): the job resumes from it",
            why,
            newest.step,
            newest.reason,
        )


def trained_on_after(control_dir: str, step: int) -> int | None:
    """The newest step this launch's workers saved, or are saving, after ``step``; ``None`` if none.

    A step after the one the workers stopped at means torchrun started them again within this
    launch: an elastic job's node joined or left (torchrun stops the workers with SIGTERM, on
    which they take an emergency checkpoint, and starts them on the new node count), or its own
    ``--max-restarts`` restarted a failed group. Read from ``saves.json``, which only this launch's
    workers on this node write.
    """
    try:
        stats = control.read_save_stats(control_dir)
    except SpotrunError:
        return None
    if stats is None:
        return None
    later = [r.step for r in stats.recent if r.step > step]
    if stats.in_progress is not None and stats.in_progress.step > step:
        later.append(stats.in_progress.step)
    return max(later) if later else None


def commit_report(control_dir: str) -> control.CommitReport | None:
    """The workers' emergency commit report, unless the workers trained on after it in this launch
    (:func:`trained_on_after`: logged, and ``None`` returned, since that checkpoint did not end it).

    Raises:
        ConfigError: the report is unreadable.
    """
    report = control.read_commit_report(control_dir)
    if report is None:
        return None
    later = trained_on_after(control_dir, report.step)
    if later is None:
        return report
    log.info(
        "the workers took an emergency checkpoint of step %d, then torchrun started them again in this "
        "launch (an elastic node change, or its --max-restarts) and they saved step %d: that "
        "checkpoint did not end the launch",
        report.step,
        later,
    )
    return None


def workers_saved_on_their_own(control_dir: str) -> bool:
    """Whether the workers reported an emergency checkpoint that ended this launch. Workers can be
    told to stop without the supervisor (a SIGTERM to their process groups, systemd's control-group
    kill): their emergency checkpoint means "preempted". True too when the report is unreadable
    (the caller reads it again and logs why)."""
    try:
        report = commit_report(control_dir)
    except SpotrunError:
        return True
    if report is not None and os.environ.get(STOP_AT_STEP):
        log.info(
            "the workers took the checkpoint of step %d and stopped, as %s=%s asked",
            report.step,
            STOP_AT_STEP,
            os.environ[STOP_AT_STEP],
        )
    elif report is not None:
        log.warning(
            "the workers took an emergency checkpoint of step %d without a notice here "
            "(another node got the notice, or a signal reached them directly)",
            report.step,
        )
    return report is not None


def workers_stopped_without_save(control_dir: str) -> bool:
    """Whether the workers stopped without saving: this node's or another node's supervisor found
    no time for an emergency checkpoint."""
    try:
        step = control.read_stop_report(control_dir)
    except SpotrunError as exc:
        log.error("%s", exc)
        return False
    if step is not None and trained_on_after(control_dir, step) is not None:
        return False  # torchrun started them again in this launch (see trained_on_after)
    if step is not None:
        log.warning("the workers stopped after step %d without saving (no time for an emergency checkpoint)", step)
    return step is not None


def fenced(control_dir: str) -> str | None:
    """What the workers' fence report says (:mod:`spotrun.train.fence_report`), as the supervisor's
    log line; ``None`` when they were not fenced. An unreadable report still means fenced."""
    try:
        report = control.read_fence_report(control_dir)
    except SpotrunError as exc:
        return f"this launch was fenced by a newer start of the job ({exc})"
    if report is None:
        return None
    newer = (
        fencing.Claim(
            report.newer_incarnation, report.newer_host, report.newer_pid, report.newer_supervisor_pid
        ).describe()
        if report.newer_incarnation is not None
        else "a newer incarnation"
    )
    mine = "" if report.incarnation is None else f" (incarnation {report.incarnation})"
    return (
        f"this copy of the job{mine} was fenced: {newer} of this job started on the same checkpoint root "
        "and owns it now (the same job started twice?); not restarting this one, so that the newer one "
        "finishes"
    )


def step_status(storage: Storage, step: int) -> tuple[str, str | None]:
    """``(status, problem)`` of ``step`` on storage: a catalog status, ``"missing"`` or ``"unreadable"``."""
    try:
        infos = [s for s in catalog.list_steps(storage) if s.step == step]
    except SpotrunError as exc:
        return "unreadable", str(exc)
    if not infos:
        return "missing", "no such step directory"
    return infos[0].status, infos[0].problem

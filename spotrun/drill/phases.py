"""``spotrun drill``'s three phases (:func:`run_drill`).

1. Notice: the job runs under ``spotrun run`` listening to the chosen cloud's fake metadata
   server (:mod:`spotrun.drill.clouds`). At the trigger (``after_s`` seconds after the launch,
   or a complete checkpoint of step >= ``after_steps``) the cloud serves its notice; the
   supervisor must save and exit 143 within the lead.
2. Restart: the same command, no notice, with ``SPOTRUN_STOP_AT_STEP=E+1`` (E: the emergency
   step): it must resume from E, save step E + 1 and exit 143; SIGTERM after
   ``restart_timeout_s``. The job is left resumable, one step further.
3. Reference (unless ``exact_check`` is false): the same command, uninterrupted, from R0 (the
   newest complete step before phase 1, copied first; or a fresh start) to step E + 1 into a
   scratch root (:mod:`spotrun.drill.scratch`), within ``restart_timeout_s`` plus twice phase
   1's duration; step E + 1 of both roots must be bit-identical on every rank
   (:mod:`spotrun.drill.compare`), else the report names the likeliest cause
   (:mod:`spotrun.drill.cause`). The scratch root is deleted unless ``keep_reference``.
"""

from __future__ import annotations

import logging
import subprocess
import time

from spotrun.checkpoint import catalog
from spotrun.checkpoint.catalog import StepInfo
from spotrun.control.env import STOP_AT_STEP
from spotrun.drill import child
from spotrun.drill.cause import likely_cause
from spotrun.drill.clouds import clouds
from spotrun.drill.clouds.base import DrillCloud
from spotrun.drill.compare import compare_steps
from spotrun.drill.config import DEFAULT_AFTER_S, DrillConfig
from spotrun.drill.report import MAX_REPORTED_DIFFERENCES, DrillReport
from spotrun.drill.scratch import ScratchRoot, copy_step, open_scratch_root
from spotrun.errors import SpotrunError
from spotrun.storage import Storage
from spotrun.supervisor.exit_codes import EXIT_PREEMPTED_NOT_SAVED, EXIT_PREEMPTED_SAVED
from spotrun.supervisor.launch import find_resume_point

log = logging.getLogger(__name__)

#: How often the catalog and the processes are looked at, in seconds.
_POLL_S = 0.5


def run_drill(config: DrillConfig) -> DrillReport:
    """Rehearse one preemption and one restart of ``config.command``, then (unless
    ``config.exact_check`` is false) compare with an uninterrupted run; see the module docstring.

    Returns:
        The report (``report.passed`` says whether every check held).

    Raises:
        ConfigError: a bad URI.
        StorageError: the checkpoints cannot be listed before phase 1.
    """
    location = config.location
    storage = location.open()
    if config.exact_check and config.reference_uri is not None:  # refused before the job is touched
        open_scratch_root(location, config.reference_uri)
    report = DrillReport(cloud=config.cloud)
    start = catalog.newest_complete(storage)
    report.start_step = None if start is None else start.step
    with clouds()[config.cloud]() as cloud:
        _phase_notice(config, storage, cloud, report)
    if report.first_exit_code == EXIT_PREEMPTED_SAVED:
        _phase_restart(config, storage, report)
    if (
        config.exact_check
        and report.emergency_step is not None
        and report.first_step_after_restart == report.emergency_step + 1
    ):
        _phase_reference(config, storage, report)
    return report


# --- phase 1: notice ---------------------------------------------------------------


def _phase_notice(config: DrillConfig, storage: Storage, cloud: DrillCloud, report: DrillReport) -> None:
    launched_s = time.monotonic()
    report.launch_unix_s = time.time()
    proc = child.start_supervisor(config, cloud.run_options(), config.lead_s)
    try:
        while not _trigger_reached(config, storage, launched_s, cloud, proc):
            code = child.wait_exit(proc, _POLL_S)
            if code is not None:
                report.first_exit_code = code
                if code == 0:
                    report.problems.append(
                        "the job finished before the notice; use a smaller --after-steps or --after-s"
                    )
                else:
                    report.problems.append(
                        f"the job (or spotrun run) failed with exit code {code} before the "
                        "notice; its error is in the output above"
                    )
                return
        report.newest_step_at_notice = _newest_complete_step(storage)
        report.notice_unix_s = time.time()
        cloud.serve(proc.pid, deadline_unix_s=time.time() + config.lead_s)
        log.warning("drill: %s notice served (deadline in %.0f s)", config.cloud, config.lead_s)
        code = child.wait_exit(proc, config.lead_s + child.SLACK_S)
        report.exit_unix_s = time.time()
        if code is None:
            report.problems.append(
                f"spotrun run did not exit within {config.lead_s + child.SLACK_S:.0f} s of the notice"
            )
            return
        report.first_exit_code = code
    finally:
        child.stop(proc)
    if code != EXIT_PREEMPTED_SAVED:
        hint = ""
        if code == EXIT_PREEMPTED_NOT_SAVED:
            hint = (
                "; no emergency checkpoint committed before the deadline (the supervisor's log above says "
                "whether it estimated the save would not fit and why): give it more time "
                "(--grace-period-s) or make saves faster"
            )
        report.problems.append(
            f"spotrun run exited {code} after the notice, not {EXIT_PREEMPTED_SAVED} (preempted and saved){hint}"
        )
        return
    newest = _newest_complete(storage)
    if newest is None or (report.newest_step_at_notice is not None and newest.step < report.newest_step_at_notice):
        report.problems.append("no emergency checkpoint is complete on storage")
        return
    report.emergency_step, report.emergency_reason = newest.step, newest.reason
    report.commit_unix_s = newest.created_unix_s
    if report.commit_unix_s > report.notice_unix_s + config.lead_s:
        report.problems.append(
            f"the emergency checkpoint committed after the deadline "
            f"({report.commit_unix_s - report.notice_unix_s:.1f} s after the notice)"
        )
    cloud.check(report)


def _trigger_reached(
    config: DrillConfig, storage: Storage, launched_s: float, cloud: DrillCloud, proc: subprocess.Popen
) -> bool:
    if not cloud.ready(proc.pid):
        return False
    if config.after_steps is not None:
        newest = _newest_complete_step(storage)
        return newest is not None and newest >= config.after_steps
    after_s = DEFAULT_AFTER_S if config.after_s is None else config.after_s
    return time.monotonic() - launched_s >= after_s


# --- phase 2: restart ----------------------------------------------------------------


def _phase_restart(config: DrillConfig, storage: Storage, report: DrillReport) -> None:
    resume = find_resume_point(storage)
    report.resume_step = None if resume is None else resume.step
    if report.resume_step != report.emergency_step:
        report.problems.append(
            f"the restart resumes from step {report.resume_step}, not from the emergency step {report.emergency_step}"
        )
    stop_at_step = (report.emergency_step or 0) + 1
    report.restart_unix_s = time.time()
    proc = child.start_supervisor(config, ["--notice", "none"], config.restart_timeout_s, stop_at_step=stop_at_step)
    try:
        code = child.wait_exit(proc, config.restart_timeout_s)
        if code is None:
            report.problems.append(
                f"the restart did not stop at step {stop_at_step} ({STOP_AT_STEP}) within "
                f"{config.restart_timeout_s:.0f} s; does the job call Checkpointer.end_of_step "
                "after every step?"
            )
            child.stop(proc)  # SIGTERM: the workers save at their next step boundary
            code = proc.returncode
        report.restart_exit_code = code
    finally:
        child.stop(proc)
    if code != EXIT_PREEMPTED_SAVED:
        report.problems.append(f"the restart exited {code}, not {EXIT_PREEMPTED_SAVED}: it did not save its first step")
        return
    newest = _newest_complete(storage)
    if newest is None or newest.step <= (report.emergency_step or 0):
        report.problems.append(
            f"the restart's first checkpoint (step {newest and newest.step}) does not come "
            f"after the emergency step {report.emergency_step}: it did not go on from it"
        )
        return
    report.first_step_after_restart, report.first_save_unix_s = newest.step, newest.created_unix_s
    if newest.step != stop_at_step:
        report.problems.append(
            f"the restart saved step {newest.step}, not step {stop_at_step} where {STOP_AT_STEP} asked it to stop"
        )


# --- phase 3: reference --------------------------------------------------------------


def _phase_reference(config: DrillConfig, storage: Storage, report: DrillReport) -> None:
    try:
        scratch = open_scratch_root(config.location, config.reference_uri)
    except SpotrunError as exc:
        report.problems.append(f"no reference run: {exc}")
        return
    report.reference_uri = scratch.uri
    try:
        _run_reference(config, storage, scratch, report)
    finally:
        if config.keep_reference:
            report.reference_kept = True
            log.warning("drill: the reference run's checkpoints are kept under %s", scratch.uri)
        else:
            try:
                count = scratch.delete()
                log.info("drill: deleted the reference run's %d object(s) under %s", count, scratch.uri)
            except (SpotrunError, OSError) as exc:
                log.warning("drill: could not delete the reference run's checkpoints under %s: %s", scratch.uri, exc)


def _run_reference(config: DrillConfig, storage: Storage, scratch: ScratchRoot, report: DrillReport) -> None:
    """Run from step R0 (or a fresh start) to step E + 1 into ``scratch`` and compare step E + 1."""
    target = report.emergency_step + 1
    if report.start_step is not None:
        try:
            copied = copy_step(storage, scratch.storage, report.start_step)
        except SpotrunError as exc:
            report.problems.append(f"no reference run: cannot copy step {report.start_step} to {scratch.uri}: {exc}")
            return
        log.info("drill: copied step %d (%d objects) to %s", report.start_step, copied, scratch.uri)
    timeout_s = config.restart_timeout_s + 2 * max(0.0, (report.exit_unix_s or 0.0) - (report.launch_unix_s or 0.0))
    log.warning(
        "drill: reference run from %s to step %d under %s",
        "a fresh start" if report.start_step is None else f"step {report.start_step}",
        target,
        scratch.uri,
    )
    report.reference_unix_s = time.time()
    proc = child.start_supervisor(config, ["--notice", "none"], config.lead_s, uri=scratch.uri, stop_at_step=target)
    try:
        code = child.wait_exit(proc, timeout_s)
        if code is None:
            report.problems.append(
                f"the reference run did not stop at step {target} ({STOP_AT_STEP}) within {timeout_s:.0f} s"
            )
            child.stop(proc)
            code = proc.returncode
    finally:
        child.stop(proc)
    report.reference_exit_unix_s = time.time()
    report.reference_exit_code = code
    try:
        saved = catalog.inspect_step(scratch.storage, target)
    except SpotrunError as exc:
        report.problems.append(f"cannot list the reference run's checkpoints under {scratch.uri}: {exc}")
        return
    if saved is None or saved.status != catalog.COMPLETE:
        report.problems.append(
            f"the reference run (exit code {code}) saved no complete step {target} under "
            f"{scratch.uri}: does the job write its checkpoints to $SPOTRUN_CHECKPOINT_URI?"
        )
        return
    newest = _newest_complete_step(storage)
    if newest != target:
        report.problems.append(
            f"the reference run changed {config.checkpoint_uri} (newest complete step {newest}, "
            f"not {target}): does the job write its checkpoints to $SPOTRUN_CHECKPOINT_URI?"
        )
    try:
        differences = compare_steps(storage, scratch.storage, target)
    except SpotrunError as exc:
        report.problems.append(f"cannot compare step {target} with the reference run: {exc}")
        return
    report.exact = not differences
    report.difference_count = len(differences)
    report.differences = [d.to_json() for d in differences[:MAX_REPORTED_DIFFERENCES]]
    if differences:
        report.problems.append(
            f"step {target} after the resume is not bit-identical to an uninterrupted run: {len(differences)} "
            f"value(s) differ, first {differences[0]}; " + likely_cause(differences, report.start_step)
        )


# --- helpers -----------------------------------------------------------------------


def _newest_complete(storage: Storage) -> StepInfo | None:
    try:
        return catalog.newest_complete(storage)
    except SpotrunError as exc:
        log.warning("drill: cannot list the checkpoints: %s", exc)
        return None


def _newest_complete_step(storage: Storage) -> int | None:
    newest = _newest_complete(storage)
    return None if newest is None else newest.step

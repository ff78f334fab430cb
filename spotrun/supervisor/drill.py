"""``spotrun drill``: rehearse a preemption on the user's own job, restart it, report.

    spotrun drill --cloud aws --after-steps 200 -- torchrun --nproc-per-node 8 train.py

Phase 1 runs the job under ``spotrun run`` (a child process) with the notice source of the
chosen cloud pointed at a fake metadata server on 127.0.0.1 (:mod:`spotrun.drill_fakes`).
Once the trigger is reached (``after_s`` seconds after the launch, or a complete checkpoint
of step >= ``after_steps``: the catalog is the only view of the trainer's progress spotrun
has) the fake serves a real-looking notice: an AWS spot instance-action, GCP
``instance/preempted`` TRUE or an Azure Preempt event (``signal``: SIGTERM to the
supervisor instead). The supervisor must save and exit 143.

Phase 2 restarts the same command (no cloud notice: a new VM) with
``SPOTRUN_STOP_AT_STEP=E+1`` in its environment (``spotrun run`` and torchrun pass it on to
the workers), E being the emergency step: the workers resume from E, run step E + 1, take an
emergency checkpoint of it and stop, and the supervisor exits 143. Should the restart not
exit within ``restart_timeout_s``, the drill stops it with a SIGTERM (a save at the next step
boundary) and says so. The job is left resumable, one step further.

Phase 3 (the exact check; on unless ``exact_check`` is false) runs the same command once
more, uninterrupted, from where phase 1 started (R0, the newest complete step before the
drill, or a fresh start) to step E + 1, under ``spotrun run --notice none`` with
``SPOTRUN_STOP_AT_STEP=E+1``, into a scratch checkpoint root: a temporary directory for a
local root, ``s3://bucket/prefix-drill-reference/<random>`` for ``s3://bucket/prefix``, or
``reference_uri``. Step R0 is first copied there through the storage interface (manifest
last). Then step E + 1 of the real root and of the scratch root are compared bit for bit
for every rank (:mod:`spotrun.supervisor.drill_reference`): the replicated state and each
rank's own state, every RNG included. Any difference means the job does not resume exactly
(state spotrun does not save, settings that differ between the runs, or nondeterminism) and
fails the drill; the report names the likeliest of these (:mod:`spotrun.supervisor.drill_cause`). The scratch root is
deleted afterwards unless ``keep_reference``. The reference run may take ``restart_timeout_s``
plus twice phase 1's duration. It is the same command, so whatever else the job writes (a
metrics log, say) gets the reference run's steps as well.

The report says whether the emergency checkpoint committed before the deadline, whether
the restart resumed from it and went on from it (its first saved step is E + 1), whether
Azure's event was acknowledged only after the commit, whether step E + 1 is bit-identical to
the uninterrupted run's (and if not, which values differ), and how long each phase took
(notice -> commit, commit -> exit, restart -> first step saved, reference run).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from spotrun.checkpoint import catalog
from spotrun.checkpoint.catalog import StepInfo
from spotrun.drill_fakes import FakeAws, FakeAzure, FakeGcp, FakeServer
from spotrun.env import STOP_AT_STEP
from spotrun.errors import ConfigError, SpotrunError
from spotrun.storage import Storage, open_storage
from spotrun.supervisor import drill_cause, drill_reference, process
from spotrun.supervisor.config import storage_options
from spotrun.supervisor.drill_options import (  # noqa: F401  (re-exported: the drill's public names)
    CLOUD_LEAD_S,
    CLOUDS,
    DEFAULT_AFTER_S,
    DRILL_VM_NAME,
    MAX_REPORTED_DIFFERENCES,
    DrillConfig,
    DrillReport,
)
from spotrun.supervisor.drill_reference import ScratchRoot
from spotrun.supervisor.launch import find_resume_point
from spotrun.supervisor.run import EXIT_PREEMPTED_NOT_SAVED, EXIT_PREEMPTED_SAVED

log = logging.getLogger(__name__)

#: How often the catalog and the processes are looked at, in seconds.
_POLL_S = 0.5
#: Extra time allowed past a phase's deadline before the drill stops the job itself, in seconds.
_SLACK_S = 60.0

def run_drill(config: DrillConfig) -> DrillReport:
    """Rehearse one preemption and one restart of ``config.command``, then (unless
    ``config.exact_check`` is false) compare with an uninterrupted run; see the module docstring.

    Returns:
        The report (``report.passed`` says whether every check held).

    Raises:
        ConfigError: a bad URI.
        StorageError: the checkpoints cannot be listed before phase 1.
    """
    storage = open_storage(config.checkpoint_uri, **storage_options(config.checkpoint_uri,
                                                                    s3_endpoint_url=config.s3_endpoint_url))
    if config.exact_check and config.reference_uri is not None:  # refused before the job is touched
        drill_reference.open_scratch_root(storage, config.reference_uri, s3_endpoint_url=config.s3_endpoint_url)
    report = DrillReport(cloud=config.cloud)
    start = catalog.newest_complete(storage)
    report.start_step = None if start is None else start.step
    fake = _start_fake(config.cloud)
    try:
        _phase_notice(config, storage, fake, report)
    finally:
        if fake is not None:
            fake.close()
    if report.first_exit_code == EXIT_PREEMPTED_SAVED:
        _phase_restart(config, storage, report)
    if (config.exact_check and report.emergency_step is not None
            and report.first_step_after_restart == report.emergency_step + 1):
        _phase_reference(config, storage, report)
    return report


# --- phase 1: notice ---------------------------------------------------------------


def _start_fake(cloud: str) -> FakeServer | None:
    if cloud == "aws":
        return FakeAws()
    if cloud == "gcp":
        return FakeGcp()
    if cloud == "azure":
        return FakeAzure(vm_name=DRILL_VM_NAME)
    return None


def _notice_options(cloud: str, fake: FakeServer | None) -> list[str]:
    if cloud == "aws":
        return ["--notice", "aws", "--aws-metadata-endpoint", fake.url]
    if cloud == "gcp":
        return ["--notice", "gcp", "--gcp-metadata-host", fake.host_port]
    if cloud == "azure":
        return ["--notice", "azure", "--azure-metadata-endpoint", fake.url, "--azure-vm-name", DRILL_VM_NAME]
    return ["--notice", "none"]  # signals are always notices


def _phase_notice(config: DrillConfig, storage: Storage, fake: FakeServer | None, report: DrillReport) -> None:
    launched_s = time.monotonic()
    report.launch_unix_s = time.time()
    proc = _start_supervisor(config, _notice_options(config.cloud, fake), config.lead_s)
    event_id = None
    try:
        while not _trigger_reached(config, storage, launched_s, proc):
            code = _wait_exit(proc, _POLL_S)
            if code is not None:
                report.first_exit_code = code
                if code == 0:
                    report.problems.append("the job finished before the notice; "
                                           "use a smaller --after-steps or --after-s")
                else:
                    report.problems.append(f"the job (or spotrun run) failed with exit code {code} before the "
                                           "notice; its error is in the output above")
                return
        report.newest_step_at_notice = _newest_complete_step(storage)
        report.notice_unix_s = time.time()
        event_id = _serve_notice(config, fake, proc)
        log.warning("drill: %s notice served (deadline in %.0f s)", config.cloud, config.lead_s)
        code = _wait_exit(proc, config.lead_s + _SLACK_S)
        report.exit_unix_s = time.time()
        if code is None:
            report.problems.append(f"spotrun run did not exit within {config.lead_s + _SLACK_S:.0f} s of the notice")
            return
        report.first_exit_code = code
    finally:
        _stop(proc)
    if code != EXIT_PREEMPTED_SAVED:
        hint = ""
        if code == EXIT_PREEMPTED_NOT_SAVED:
            hint = ("; no emergency checkpoint committed before the deadline (the supervisor's log above says "
                    "whether it estimated the save would not fit and why): give it more time "
                    "(--grace-period-s) or make saves faster")
        report.problems.append(f"spotrun run exited {code} after the notice, not {EXIT_PREEMPTED_SAVED} "
                               f"(preempted and saved){hint}")
        return
    newest = _newest_complete(storage)
    if newest is None or (report.newest_step_at_notice is not None and newest.step < report.newest_step_at_notice):
        report.problems.append("no emergency checkpoint is complete on storage")
        return
    report.emergency_step, report.emergency_reason = newest.step, newest.reason
    report.commit_unix_s = newest.created_unix_s
    if report.commit_unix_s > report.notice_unix_s + config.lead_s:
        report.problems.append(f"the emergency checkpoint committed after the deadline "
                               f"({report.commit_unix_s - report.notice_unix_s:.1f} s after the notice)")
    if config.cloud == "azure":
        _check_acknowledgement(fake, event_id, report)


def _trigger_reached(config: DrillConfig, storage: Storage, launched_s: float, proc: subprocess.Popen) -> bool:
    if config.cloud == "signal" and not process.catches_signal(proc.pid, signal.SIGTERM):
        return False  # still starting up: a SIGTERM now would kill it instead of being a notice
    if config.after_steps is not None:
        newest = _newest_complete_step(storage)
        return newest is not None and newest >= config.after_steps
    after_s = DEFAULT_AFTER_S if config.after_s is None else config.after_s
    return time.monotonic() - launched_s >= after_s


def _serve_notice(config: DrillConfig, fake: FakeServer | None, proc: subprocess.Popen) -> str | None:
    """Announce the preemption; returns Azure's event id."""
    deadline_unix_s = time.time() + config.lead_s
    if isinstance(fake, FakeAws):
        fake.set_instance_action("terminate", deadline_unix_s)
    elif isinstance(fake, FakeGcp):
        fake.set_preempted()
    elif isinstance(fake, FakeAzure):
        return fake.add_event("Preempt", not_before_unix_s=deadline_unix_s)["EventId"]
    else:
        os.kill(proc.pid, signal.SIGTERM)
    return None


def _check_acknowledgement(fake: FakeAzure, event_id: str | None, report: DrillReport) -> None:
    posts = fake.requests_to(FakeAzure.EVENTS_PATH, "POST")
    if not posts:
        report.problems.append("the azure event was never acknowledged")
        return
    expected = [{"StartRequests": [{"EventId": event_id}]}]
    if fake.start_requests != expected:
        report.problems.append(f"the azure acknowledgements are {fake.start_requests}, expected {expected}")
    report.acknowledged_unix_s = posts[0].received_unix_s
    if report.acknowledged_unix_s < report.commit_unix_s:
        report.problems.append("the azure event was acknowledged before the emergency checkpoint committed")


# --- phase 2: restart ----------------------------------------------------------------


def _phase_restart(config: DrillConfig, storage: Storage, report: DrillReport) -> None:
    resume = find_resume_point(storage)
    report.resume_step = None if resume is None else resume.step
    if report.resume_step != report.emergency_step:
        report.problems.append(f"the restart resumes from step {report.resume_step}, "
                               f"not from the emergency step {report.emergency_step}")
    stop_at_step = (report.emergency_step or 0) + 1
    report.restart_unix_s = time.time()
    proc = _start_supervisor(config, ["--notice", "none"], config.restart_timeout_s, stop_at_step=stop_at_step)
    try:
        code = _wait_exit(proc, config.restart_timeout_s)
        if code is None:
            report.problems.append(f"the restart did not stop at step {stop_at_step} ({STOP_AT_STEP}) within "
                                   f"{config.restart_timeout_s:.0f} s; does the job call Checkpointer.end_of_step "
                                   "after every step?")
            _stop(proc)  # SIGTERM: the workers save at their next step boundary
            code = proc.returncode
        report.restart_exit_code = code
    finally:
        _stop(proc)
    if code != EXIT_PREEMPTED_SAVED:
        report.problems.append(f"the restart exited {code}, not {EXIT_PREEMPTED_SAVED}: it did not save its first step")
        return
    newest = _newest_complete(storage)
    if newest is None or newest.step <= (report.emergency_step or 0):
        report.problems.append(f"the restart's first checkpoint (step {newest and newest.step}) does not come "
                               f"after the emergency step {report.emergency_step}: it did not go on from it")
        return
    report.first_step_after_restart, report.first_save_unix_s = newest.step, newest.created_unix_s
    if newest.step != stop_at_step:
        report.problems.append(f"the restart saved step {newest.step}, not step {stop_at_step} where "
                               f"{STOP_AT_STEP} asked it to stop")


# --- phase 3: reference --------------------------------------------------------------


def _phase_reference(config: DrillConfig, storage: Storage, report: DrillReport) -> None:
    try:
        scratch = drill_reference.open_scratch_root(storage, config.reference_uri,
                                                    s3_endpoint_url=config.s3_endpoint_url)
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
            copied = drill_reference.copy_step(storage, scratch.storage, report.start_step)
        except SpotrunError as exc:
            report.problems.append(f"no reference run: cannot copy step {report.start_step} to {scratch.uri}: {exc}")
            return
        log.info("drill: copied step %d (%d objects) to %s", report.start_step, copied, scratch.uri)
    timeout_s = config.restart_timeout_s + 2 * max(0.0, (report.exit_unix_s or 0.0) - (report.launch_unix_s or 0.0))
    log.warning("drill: reference run from %s to step %d under %s",
                "a fresh start" if report.start_step is None else f"step {report.start_step}", target, scratch.uri)
    report.reference_unix_s = time.time()
    proc = _start_supervisor(config, ["--notice", "none"], config.lead_s, uri=scratch.uri, stop_at_step=target)
    try:
        code = _wait_exit(proc, timeout_s)
        if code is None:
            report.problems.append(f"the reference run did not stop at step {target} ({STOP_AT_STEP}) "
                                   f"within {timeout_s:.0f} s")
            _stop(proc)
            code = proc.returncode
    finally:
        _stop(proc)
    report.reference_exit_unix_s = time.time()
    report.reference_exit_code = code
    try:
        saved = catalog.inspect_step(scratch.storage, target)
    except SpotrunError as exc:
        report.problems.append(f"cannot list the reference run's checkpoints under {scratch.uri}: {exc}")
        return
    if saved is None or saved.status != catalog.COMPLETE:
        report.problems.append(f"the reference run (exit code {code}) saved no complete step {target} under "
                               f"{scratch.uri}: does the job write its checkpoints to $SPOTRUN_CHECKPOINT_URI?")
        return
    newest = _newest_complete_step(storage)
    if newest != target:
        report.problems.append(f"the reference run changed {config.checkpoint_uri} (newest complete step {newest}, "
                               f"not {target}): does the job write its checkpoints to $SPOTRUN_CHECKPOINT_URI?")
    try:
        differences = drill_reference.compare_steps(storage, scratch.storage, target)
    except SpotrunError as exc:
        report.problems.append(f"cannot compare step {target} with the reference run: {exc}")
        return
    report.exact = not differences
    report.difference_count = len(differences)
    report.differences = [d.to_json() for d in differences[:MAX_REPORTED_DIFFERENCES]]
    if differences:
        report.problems.append(
            f"step {target} after the resume is not bit-identical to an uninterrupted run: {len(differences)} "
            f"value(s) differ, first {differences[0]}; " + drill_cause.likely_cause(differences, report.start_step)
        )


# --- helpers -----------------------------------------------------------------------


def _start_supervisor(config: DrillConfig, notice_options: list[str], grace_period_s: float, *,
                      uri: str | None = None, stop_at_step: int | None = None) -> subprocess.Popen:
    """Start ``spotrun run`` on ``uri`` (default: the job's root); ``stop_at_step`` goes to
    the workers as ``$SPOTRUN_STOP_AT_STEP`` (never inherited from the drill's own environment)."""
    command = [sys.executable, "-m", "spotrun", "run", "--checkpoint-uri", uri or config.checkpoint_uri,
               "--grace-period-s", str(grace_period_s), *notice_options]
    if config.s3_endpoint_url:
        command += ["--s3-endpoint-url", config.s3_endpoint_url]
    if config.log_format:
        command += ["--log-format", config.log_format]
    env = {k: v for k, v in os.environ.items() if k != STOP_AT_STEP}
    if stop_at_step is not None:
        env[STOP_AT_STEP] = str(stop_at_step)
    log.info("drill: starting %s%s", " ".join(command[2:6] + ["..."]),
             "" if stop_at_step is None else f" with {STOP_AT_STEP}={stop_at_step}")
    try:
        return subprocess.Popen([*command, "--", *config.command], start_new_session=True, env=env)
    except OSError as exc:
        raise ConfigError(f"cannot start spotrun run: {exc.strerror or exc}") from exc


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout=max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
        return None


def _stop(proc: subprocess.Popen) -> None:
    """Leave nothing running: a supervisor still alive (drill interrupted, timed out) is asked to
    save and stop (SIGTERM), then killed with its process tree."""
    if proc.poll() is not None:
        return
    log.warning("drill: stopping spotrun run (pid %d)", proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    if _wait_exit(proc, _SLACK_S) is None:
        process.kill_tree(proc.pid, proc.pid)
        proc.kill()
        proc.wait()


def _newest_complete(storage: Storage) -> StepInfo | None:
    try:
        return catalog.newest_complete(storage)
    except SpotrunError as exc:
        log.warning("drill: cannot list the checkpoints: %s", exc)
        return None


def _newest_complete_step(storage: Storage) -> int | None:
    newest = _newest_complete(storage)
    return None if newest is None else newest.step

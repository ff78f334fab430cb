"""What one launch of the training command starts from: the resume point and its environment.

Before every launch (the first one and each crash restart) the supervisor lists the
checkpoints again, picks the newest complete step and tells the workers about it through
the environment variables of :mod:`spotrun.control.env`.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from dataclasses import dataclass

from spotrun.checkpoint import catalog, fencing, rank_layout
from spotrun.checkpoint.catalog import StepInfo
from spotrun.checkpoint.tier_steps import tier_candidates
from spotrun.control import env as spotrun_env
from spotrun.errors import SpotrunError
from spotrun.storage import Storage, StorageLocation
from spotrun.supervisor.torchrun_command import TorchrunLaunch

log = logging.getLogger(__name__)

#: torchrun's variable for its --shutdown-timeout (seconds between its SIGTERM and SIGKILL).
TORCH_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one launch needs.

    Attributes:
        resume: the newest complete step, or ``None`` for a fresh start.
        run_id: the job's identifier (from the resumed manifest, else the supervisor's own).
        incarnation: start count of the job (0 = first start).
        env: the complete environment of the launch command.
        resume_tier: where ``resume`` is: ``"memory"`` (the fast tier) or ``"storage"``; ``None``: fresh start.
    """

    resume: StepInfo | None
    run_id: str
    incarnation: int
    env: dict[str, str]
    resume_tier: str | None = None


def choose_resume_point(
    storage: Storage, fast_tier: Storage | None, run_id: str | None
) -> tuple[StepInfo | None, str | None]:
    """(the newest complete step of storage or, when newer, of this run's fast tier; its tier).

    Raises:
        As :func:`find_resume_point`.
    """
    resume = find_resume_point(storage, say_choice=False)
    in_memory = newest_in_fast_tier(fast_tier, storage, run_id) if fast_tier is not None else None
    if in_memory is None or (resume is not None and in_memory.step <= resume.step):
        say_resume_point(storage, resume)
        return resume, "storage" if resume is not None else None
    log.info(
        "resuming from step %d in the fast tier (a %s checkpoint; the newest on storage: %s)",
        in_memory.step,
        in_memory.reason,
        resume.step if resume is not None else "none",
    )
    return in_memory, "memory"


def _run_of_previous_launch(storage: Storage, previous: LaunchPlan | None) -> str | None:
    """The run id the previous launch's workers recorded when they claimed their incarnation (on
    several nodes, that of rank 0's node, whichever supervisor chose it), else the one it was given."""
    if previous is None:
        return None
    try:
        claim = fencing.newest_claim(storage)
    except (OSError, SpotrunError):
        claim = None
    if claim is not None and claim.run_id and claim.incarnation >= previous.incarnation:
        return claim.run_id
    return previous.run_id


def newest_in_fast_tier(fast_tier: Storage, storage: Storage, run_id: str | None) -> StepInfo | None:
    """The newest step of the fast tier a restart may use (:mod:`spotrun.checkpoint.tier_steps`);
    ``None`` when it has none (a listing that fails is logged: the tier is only ever a shortcut)."""
    try:
        found = tier_candidates(fast_tier, fencing.read_fences(storage), run_id)
    except (OSError, SpotrunError) as exc:
        log.warning("cannot list the fast tier %s (%s): resuming from storage", fast_tier.uri, exc)
        return None
    for step, why in found.ignored:
        log.warning("fast tier step %d ignored: %s", step, why)
    return found.usable[0] if found.usable else None


def find_resume_point(storage: Storage, *, say_choice: bool = True) -> StepInfo | None:
    """The newest complete step under ``storage`` (logged), or ``None`` for a fresh start.

    Steps newer than it that are incomplete or corrupt are logged as ignored; the choice too,
    unless ``say_choice`` is false (the caller says it).

    Raises:
        StorageError: listing the checkpoints failed.
        NoCheckpointError: steps exist but every one failed verification (no fresh start).
    """
    steps = catalog.list_steps(storage)
    catalog.refuse_start_over(storage, steps)
    complete = [s for s in steps if s.status == catalog.COMPLETE]
    resume = complete[-1] if complete else None
    floor = resume.step if resume else -1
    for info in steps:
        if info.step > floor:
            log.warning("ignoring %s step %d: %s", info.status, info.step, info.problem)
    if say_choice:
        say_resume_point(storage, resume)
    return resume


def say_resume_point(storage: Storage, resume: StepInfo | None) -> None:
    """Log the resume point chosen on ``storage``."""
    if resume is None:
        log.info("no complete checkpoint under %s: fresh start", storage.uri)
    else:
        log.info("resuming from step %d under %s (%s checkpoint)", resume.step, storage.uri, resume.reason)


def describe_start(resume: StepInfo | None, launch: TorchrunLaunch | None) -> str:
    """The start log's line on ranks: the resumed step, how many ranks saved it (and their
    meshes), how many are launched now.

    ``"step 200 (saved by 4 ranks, mesh 2x2) resumes on 1 to 2 nodes x 1 process = 1 to 2 ranks
    (torchrun --nnodes 1:2: the count is known after the rendezvous, ...)"``; for a fixed count
    that differs from the saved one the line says the workers reshard; ``launch`` ``None`` (not
    a torchrun command) leaves the count to the workers.
    """
    if launch is None:
        now = "as many ranks as the launch command starts (not a torchrun command: the workers log the count)"
    else:
        now = launch.describe()
    if resume is None or resume.manifest is None:
        return f"fresh start on {now}"
    manifest = resume.manifest
    text = (
        f"step {resume.step} (saved by {rank_layout.describe_layout(manifest.world_size, manifest.meshes)}) "
        f"resumes on {now}"
    )
    if launch is not None and not launch.elastic and launch.min_ranks not in (None, manifest.world_size):
        text += f"; another world size than the checkpoint's {manifest.world_size}: the workers reshard it"
    return text


def plan_launch(
    storage: Storage,
    location: StorageLocation,
    *,
    control_dir: str,
    grace_period_s: float,
    previous: LaunchPlan | None = None,
    base_env: dict[str, str] | None = None,
    supervisor_pid: int | None = None,
    log_format: str | None = None,
    option_env: dict[str, str] | None = None,
    fast_tier: Storage | None = None,
    fast_tier_env: dict[str, str] | None = None,
) -> LaunchPlan:
    """Choose the resume point and build the launch command's environment.

    Args:
        storage: the checkpoint storage.
        location: where ``storage`` is; the workers get its
            :meth:`~spotrun.storage.StorageLocation.worker_env` (the checkpoint URI, a local
            directory as an absolute path so workers agree whatever their working directory;
            an S3 endpoint given to spotrun), so that they open the same root.
        control_dir: this launch's node-local control directory.
        grace_period_s: seconds between a notice and the hard kill; torchrun's shutdown
            timeout defaults to it (rounded up) unless the user set one.
        previous: the plan of the previous launch by this supervisor (after a crash):
            keeps the run id and makes the incarnation grow even without a new checkpoint.
        base_env: environment to extend; default ``os.environ``.
        supervisor_pid: the supervisor's process id, passed as ``SPOTRUN_SUPERVISOR_PID`` with
            ``SPOTRUN_GRACE_PERIOD_S``: the workers stop when it is gone
            (:mod:`spotrun.train.supervisor_watch`); ``None`` leaves both out.
        log_format: passed as ``SPOTRUN_LOG_FORMAT`` (:mod:`spotrun.tools.logs`); ``None``: as in
            ``base_env``.
        option_env: ``SPOTRUN_KEEP_LAST``/``SPOTRUN_KEEP_EVERY``/``SPOTRUN_KEY_LAYOUT`` for the workers
            (:meth:`~spotrun.supervisor.config.SupervisorConfig.option_env`); a variable
            not in it passes on from ``base_env`` unchanged.
        fast_tier, fast_tier_env: this node's fast tier (its steps of this run are resume points
            too, chosen when newer than storage's) and its variables for the workers.

    Raises:
        StorageError: listing the checkpoints failed.
    """
    known_run = _run_of_previous_launch(storage, previous)
    resume, resume_tier = choose_resume_point(storage, fast_tier, known_run)
    manifest = resume.manifest if resume else None
    run_id = (manifest.run_id if manifest else "") or known_run or ""
    run_id = run_id or uuid.uuid4().hex
    newest = fencing.read_fences(storage).newest
    incarnation = max(  # the workers claim this number, or the next free one
        manifest.incarnation + 1 if manifest else 0,
        previous.incarnation + 1 if previous else 0,
        newest + 1 if newest is not None else 0,
    )

    env = dict(os.environ if base_env is None else base_env)
    env.update(location.worker_env())
    env[spotrun_env.CONTROL_DIR] = control_dir
    env[spotrun_env.RUN_ID] = run_id
    env[spotrun_env.INCARNATION] = str(incarnation)
    if resume is None:
        env.pop(spotrun_env.RESUME_STEP, None)
    else:
        env[spotrun_env.RESUME_STEP] = str(resume.step)
    if log_format is not None:
        env[spotrun_env.LOG_FORMAT] = log_format
    env.setdefault(TORCH_SHUTDOWN_TIMEOUT, str(math.ceil(grace_period_s)))
    for name in (spotrun_env.SUPERVISOR_PID, spotrun_env.GRACE_PERIOD_S):
        env.pop(name, None)  # never a stale one from this process's own environment
    if supervisor_pid is not None:
        env[spotrun_env.SUPERVISOR_PID] = str(supervisor_pid)
        env[spotrun_env.GRACE_PERIOD_S] = repr(float(grace_period_s))
    env.update(option_env or {})
    for name in (spotrun_env.MEMORY_DIR, spotrun_env.MEMORY_INTERVAL_STEPS, spotrun_env.MEMORY_BUDGET_BYTES):
        env.pop(name, None)  # never a tier from this process's own environment
    env.update(fast_tier_env or {})
    return LaunchPlan(resume=resume, run_id=run_id, incarnation=incarnation, env=env, resume_tier=resume_tier)

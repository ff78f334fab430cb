"""Environment variables through which the supervisor talks to the training workers.

The supervisor (``spotrun run``) sets these for the launch command; torchrun passes
them on to every worker unchanged. A training script started without the
supervisor simply sees none of them and runs with the defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from spotrun.tools import logs

#: Root URI of the checkpoints (a local directory or ``s3://bucket/prefix``).
CHECKPOINT_URI = "SPOTRUN_CHECKPOINT_URI"
#: Step of the newest complete checkpoint the supervisor found; unset for a fresh start.
RESUME_STEP = "SPOTRUN_RESUME_STEP"
#: Directory (local to this node) of the control channel: save requests and commit reports.
CONTROL_DIR = "SPOTRUN_CONTROL_DIR"
#: Identifier shared by every incarnation of one training job.
RUN_ID = "SPOTRUN_RUN_ID"
#: 0 for the first start of a job, +1 for every later start that resumes it.
INCARNATION = "SPOTRUN_INCARNATION"
#: Step at which :meth:`spotrun.Checkpointer.end_of_step` takes an emergency checkpoint and
#: tells the loop to stop, as if a save request had arrived; unset: no such stop. Not set by
#: ``spotrun run`` itself (it passes it on when its own environment has it); ``spotrun drill``
#: sets it to end its restart and its reference run at an exact step.
STOP_AT_STEP = "SPOTRUN_STOP_AT_STEP"
#: Process id of the ``spotrun run`` supervisor that launched this job on this node. A worker
#: watches it (:mod:`spotrun.train.supervisor_watch`): when it is gone, the worker stops as on a
#: notice, and ends itself after :data:`GRACE_PERIOD_S` at the latest.
SUPERVISOR_PID = "SPOTRUN_SUPERVISOR_PID"
#: The supervisor's grace period in seconds (``--grace-period-s``).
GRACE_PERIOD_S = "SPOTRUN_GRACE_PERIOD_S"
#: Log line format, ``text`` or ``json`` (``--log-format``): ``spotrun run`` sets it for the launch
#: command to its own format; :func:`spotrun.tools.logs.configure_logging` reads it. Read by every
#: ``spotrun`` subcommand too when ``--log-format`` is not given.
LOG_FORMAT = logs.LOG_FORMAT  # the log set-up reads it too, and tools sit below control

#: Retention of the workers' checkpoints (``spotrun run --keep-last N``): keep the N newest
#: complete steps; unset: keep every step. A ``Checkpointer(keep_last=...)`` argument wins.
KEEP_LAST = "SPOTRUN_KEEP_LAST"
#: ``spotrun run --keep-every M``: also keep every step divisible by M (with ``KEEP_LAST``).
KEEP_EVERY = "SPOTRUN_KEEP_EVERY"
#: The fast tier (``spotrun run --memory-interval-steps K``): the job's tier directory in host
#: memory on this node (a checkpoint root under it, :mod:`spotrun.storage.tier_dir`), created and
#: removed by the supervisor; unset: no fast tier.
MEMORY_DIR = "SPOTRUN_MEMORY_DIR"
#: Save to the fast tier every this many steps (with :data:`MEMORY_DIR`).
MEMORY_INTERVAL_STEPS = "SPOTRUN_MEMORY_INTERVAL_STEPS"
#: Most bytes the fast tier of this node may hold (``--memory-budget-bytes``); unset: two steps.
MEMORY_BUDGET_BYTES = "SPOTRUN_MEMORY_BUDGET_BYTES"
#: The fast tier on several nodes: this node's name (its tier directory's), where its supervisor
#: serves the tier to the job's other nodes (``HOST:PORT``), the file with the secret the servers
#: prove, how many other nodes hold a replica (``--memory-replicas``; unset: 1 on several nodes),
#: the bound of a request to a peer in seconds, and this node's failure domain (``--memory-failure-domain``).
MEMORY_NODE = "SPOTRUN_MEMORY_NODE"
MEMORY_PEER_ADDRESS = "SPOTRUN_MEMORY_PEER_ADDRESS"
MEMORY_SECRET_FILE = "SPOTRUN_MEMORY_SECRET_FILE"
MEMORY_REPLICAS = "SPOTRUN_MEMORY_REPLICAS"
MEMORY_PEER_TIMEOUT_S = "SPOTRUN_MEMORY_PEER_TIMEOUT_S"
MEMORY_FAILURE_DOMAIN = "SPOTRUN_MEMORY_FAILURE_DOMAIN"

#: Bound of each collective of a restore (``Checkpointer(restore_timeout_s=...)`` wins), seconds:
#: how long every rank waits for the slowest to list, read and verify a step.
RESTORE_TIMEOUT_S = "SPOTRUN_RESTORE_TIMEOUT_S"
#: Bound of the per-step agreement (``Checkpointer(agreement_timeout_s=...)`` wins), seconds.
AGREEMENT_TIMEOUT_S = "SPOTRUN_AGREEMENT_TIMEOUT_S"
#: The per-step agreement: ``immediate``, ``pipelined`` or ``auto`` (``Checkpointer(agreement=...)`` wins).
AGREEMENT = "SPOTRUN_AGREEMENT"
#: Where a checkpoint's ranks put their files on an object store: ``auto``, ``spread`` or ``step``
#: (``open_storage(uri, key_layout=...)`` wins; ``spotrun run --key-layout`` sets it for the workers).
KEY_LAYOUT = "SPOTRUN_KEY_LAYOUT"

DEFAULT_CHECKPOINT_URI = "./checkpoints"
#: Default bound of one save's storage operations (``Checkpointer(save_timeout_s=...)``), in
#: seconds; ``spotrun gc`` relies on it to tell a running save from a dead one.
DEFAULT_SAVE_TIMEOUT_S = 300.0
#: Default bound of each collective of a restore, in seconds: reading a 1 TB step takes minutes,
#: and the ranks also start at different times (loading the model, compiling).
DEFAULT_RESTORE_TIMEOUT_S = 1800.0
#: Default bound of the per-step agreement, in seconds: the ranks are at most a step apart (a
#: first step that compiles takes minutes), so a rank that stopped is named within 5 minutes.
DEFAULT_AGREEMENT_TIMEOUT_S = 300.0
#: The safety margin when the grace period is long enough for it, in seconds.
DEFAULT_SAFETY_MARGIN_S = 5.0


def default_safety_margin_s(grace_period_s: float) -> float:
    """The safety margin kept before the end of a grace period when none is given, in seconds.

    :data:`DEFAULT_SAFETY_MARGIN_S` (5 s), or half the grace period when that is less
    (30 s -> 5 s, 10 s -> 5 s, 6 s -> 3 s, 2 s -> 1 s): a grace period of 5 s or less is not
    refused, and one of 10 s or more keeps the 5 s.
    """
    return min(DEFAULT_SAFETY_MARGIN_S, grace_period_s / 2)


@dataclass(frozen=True)
class WorkerEnv:
    """What the supervisor told this worker, read from the environment.

    Attributes:
        checkpoint_uri: root URI of the checkpoints; ``None`` if unset.
        resume_step: step the supervisor chose to resume from; ``None`` for "find it yourself".
        control_dir: local control-channel directory; ``None`` when no supervisor runs.
        run_id: job identifier; ``None`` if unset.
        incarnation: start count of this job (0 = first start).
        stop_at_step: stop with an emergency checkpoint at the first step boundary whose
            step is >= this; ``None``: no such stop.
        supervisor_pid: process id of the supervisor of this node; ``None`` without one.
        grace_period_s: the supervisor's grace period in seconds; ``None`` if unset.
        keep_last, keep_every: the retention the supervisor was given; ``None`` if unset.
        memory_dir, memory_interval_steps, memory_budget_bytes: the fast tier's directory, interval
            and budget; ``None`` if unset.
        memory_node, memory_peer_address, memory_secret_file, memory_replicas, memory_peer_timeout_s,
            memory_failure_domain: the fast tier's server on this node, its replicas and this node's
            failure domain (several nodes); ``None`` if unset.
        restore_timeout_s, agreement_timeout_s: bounds of the restore's collectives and of the
            per-step agreement (``docs/reference/timeouts.md``); ``None`` if unset.
        agreement: the per-step agreement (``immediate``, ``pipelined``, ``auto``); ``None`` if unset.
    """

    checkpoint_uri: str | None
    resume_step: int | None
    control_dir: str | None
    run_id: str | None
    incarnation: int
    stop_at_step: int | None = None
    supervisor_pid: int | None = None
    grace_period_s: float | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    memory_dir: str | None = None
    memory_interval_steps: int | None = None
    memory_budget_bytes: int | None = None
    memory_node: str | None = None
    memory_peer_address: str | None = None
    memory_secret_file: str | None = None
    memory_replicas: int | None = None
    memory_peer_timeout_s: float | None = None
    memory_failure_domain: str | None = None
    restore_timeout_s: float | None = None
    agreement_timeout_s: float | None = None
    agreement: str | None = None

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> WorkerEnv:
        """Read the variables; raises :class:`~spotrun.errors.ConfigError` on a malformed number."""
        from spotrun.errors import ConfigError

        env = os.environ if environ is None else environ

        def _int(name: str) -> int | None:
            raw = env.get(name, "").strip()
            if not raw:
                return None
            try:
                return int(raw)
            except ValueError as exc:
                raise ConfigError(f"{name}={raw!r} is not an integer") from exc

        def _seconds(name: str) -> float | None:
            raw = env.get(name, "").strip()
            if not raw:
                return None
            try:
                value = float(raw)
            except ValueError:
                value = float("nan")
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"{name}={raw!r} is not a number of seconds > 0")
            return value

        return cls(
            checkpoint_uri=env.get(CHECKPOINT_URI) or None,
            resume_step=_int(RESUME_STEP),
            control_dir=env.get(CONTROL_DIR) or None,
            run_id=env.get(RUN_ID) or None,
            incarnation=_int(INCARNATION) or 0,
            stop_at_step=_int(STOP_AT_STEP),
            supervisor_pid=_int(SUPERVISOR_PID),
            grace_period_s=_seconds(GRACE_PERIOD_S),
            keep_last=_int(KEEP_LAST),
            keep_every=_int(KEEP_EVERY),
            memory_dir=env.get(MEMORY_DIR) or None,
            memory_interval_steps=_int(MEMORY_INTERVAL_STEPS),
            memory_budget_bytes=_int(MEMORY_BUDGET_BYTES),
            memory_node=env.get(MEMORY_NODE) or None,
            memory_peer_address=env.get(MEMORY_PEER_ADDRESS) or None,
            memory_secret_file=env.get(MEMORY_SECRET_FILE) or None,
            memory_replicas=_int(MEMORY_REPLICAS),
            memory_peer_timeout_s=_seconds(MEMORY_PEER_TIMEOUT_S),
            memory_failure_domain=env.get(MEMORY_FAILURE_DOMAIN) or None,
            restore_timeout_s=_seconds(RESTORE_TIMEOUT_S),
            agreement_timeout_s=_seconds(AGREEMENT_TIMEOUT_S),
            agreement=env.get(AGREEMENT, "").strip() or None,
        )

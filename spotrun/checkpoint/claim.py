"""Claiming this start's incarnation on the root, a collective (:mod:`spotrun.checkpoint.fencing`).

Every rank calls :func:`claim_incarnation`; rank 0 writes, every rank learns the outcome,
and a failure is told to all of them, so none waits alone at a collective. A launch whose
workers were fenced (``fenced.json`` in the control directory, :mod:`spotrun.train.fence_report`)
claims nothing more: torchrun restarting its workers must not fence the newer copy in turn.
"""

from __future__ import annotations

from spotrun.checkpoint import catalog, fencing
from spotrun.control import files as control
from spotrun.control.env import DEFAULT_RESTORE_TIMEOUT_S, WorkerEnv
from spotrun.errors import CheckpointSaveError, CommitUnsupportedError, FencedError, SpotrunError, StorageError
from spotrun.storage.base import Storage
from spotrun.tools import dist


def claim_incarnation(
    storage: Storage,
    *,
    resumed_step: int | None,
    at_least: int,
    run_id: str,
    after_newest: bool = False,
    saving_step: int | None = None,
    worker_env: WorkerEnv | None = None,
    timeout_s: float = DEFAULT_RESTORE_TIMEOUT_S,
) -> int:
    """Rank 0 claims the next incarnation on the root (fencing older writers); every rank
    gets the number.

    Args:
        resumed_step: the step this start resumed from; ``None`` for a fresh start.
        at_least: the smallest acceptable number.
        after_newest: this start restored nothing (a save without ``restore()``); it counts
            as resumed from the newest complete step, so the steps already committed stay
            valid and only later commits of older incarnations are fenced.
        saving_step: the step being saved, when a save claims (a failure is then that
            save's :class:`CheckpointSaveError`).
        worker_env: under ``spotrun run``: its control directory (a fenced launch claims
            nothing) and process id (recorded).
        timeout_s: bound of the broadcast of rank 0's claim, seconds (the other ranks wait in it
            while rank 0 lists and writes).

    Raises:
        FencedError: this launch was fenced before (nothing claimed).
        CheckpointSaveError: with ``saving_step``: the claim failed (``retryable`` false when
            the store cannot commit at all).
        StorageError: without it: the claim failed.
        CollectiveTimeoutError: a rank did not arrive at the claim's broadcast in time.
    """
    claimed: dict = {}
    if dist.rank() == 0:
        try:
            control_dir = worker_env.control_dir if worker_env is not None else None
            fenced = control.read_fence_report(control_dir) if control_dir else None
            if fenced is not None:
                raise FencedError(
                    f"this launch was fenced by incarnation {fenced.newer_incarnation} "
                    f"({fenced.message}); it claims no incarnation again"
                )
            if after_newest:
                newest = catalog.newest_complete(storage)
                resumed_step = newest.step if newest else None
                at_least = max(at_least, newest.manifest.incarnation + 1 if newest else 0)
            claimed = {
                "incarnation": fencing.claim(
                    storage,
                    resumed_step=resumed_step,
                    run_id=run_id,
                    at_least=at_least,
                    supervisor_pid=worker_env.supervisor_pid if worker_env else None,
                ).incarnation
            }
        except (SpotrunError, OSError) as exc:  # told to every rank, so none waits alone
            claimed = {
                "error": f"{type(exc).__name__}: {exc}",
                "fenced": isinstance(exc, FencedError),
                "retryable": not isinstance(exc, (CommitUnsupportedError, FencedError)),
            }
    claimed = dist.broadcast_json(claimed, timeout_s=timeout_s, what="the claim of this start's incarnation")
    if claimed.get("fenced"):
        raise FencedError(f"this start claims no incarnation under {storage.uri}: {claimed['error']}")
    if "error" in claimed:
        problem = f"cannot record this start under {storage.uri}: {claimed['error']}"
        if saving_step is not None:
            raise CheckpointSaveError(
                f"save of step {saving_step} failed on rank 0: {problem} - nothing was committed",
                retryable=claimed["retryable"],
            )
        raise StorageError(5, problem)
    return claimed["incarnation"]

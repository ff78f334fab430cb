"""The collective steps of a start: find and load the newest loadable complete step (falling
back past bad ones together), and claim this start's incarnation.

Every rank calls these functions; rank 0 lists and writes, every rank learns the outcome,
and a failure on any rank is told to all of them, so none waits alone at a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from spotrun import dist
from spotrun.checkpoint import catalog, fencing
from spotrun.checkpoint.restore import LoadedStep, load_step, reject_step
from spotrun.errors import (
    CheckpointSaveError,
    CommitUnsupportedError,
    CorruptShardError,
    ManifestError,
    NoCheckpointError,
    SpotrunError,
    StateMismatchError,
    StorageError,
)
from spotrun.manifest import Manifest
from spotrun.storage.base import Storage

log = logging.getLogger(__name__)


def load_newest(storage: Storage, *, supervisor_step: int | None,
                destinations: Callable[[], dict[str, torch.Tensor]] | dict[str, torch.Tensor] | None = None,
                ) -> LoadedStep | None:
    """Load the newest complete step that every rank can verify, or ``None`` when there is none.

    Lists the steps again (so a step committed since the supervisor chose ``supervisor_step``
    is newer and used). A step that fails verification on any rank is skipped by every rank,
    logged (``checkpoint step S failed verification (...); falling back to step R``) and,
    when a file or manifest is corrupt, un-committed. ``destinations`` (name -> live
    tensor, or a function returning them, called only once there is a step to load) are
    filled in place where they fit (:func:`~spotrun.checkpoint.restore.load_step`).

    Raises:
        StorageError: the listing failed.
        NoCheckpointError: complete steps exist but none of them loads.
    """
    listing: dict = {}
    listed: dict[int, Manifest] = {}
    if dist.rank() == 0:
        try:
            complete = _complete_newest_first(storage, supervisor_step)
            listing = {"steps": [(s.step, s.manifest_key) for s in complete]}
            listed = {s.step: s.manifest for s in complete[:1]}  # parsed already: not parsed again
        except NoCheckpointError as exc:
            listing = {"refused": str(exc)}
        except (SpotrunError, OSError) as exc:
            listing = {"error": f"{type(exc).__name__}: {exc}"}
    listing = dist.broadcast_json(listing)
    if "refused" in listing:
        raise NoCheckpointError(listing["refused"])
    if "error" in listing:
        raise StorageError(5, f"cannot list checkpoints under {storage.uri}: {listing['error']}")
    candidates = [step for step, _key in listing["steps"]]
    if callable(destinations) and candidates:
        destinations = destinations()
    for index, (step, key) in enumerate(listing["steps"]):
        loaded, problem = _try_load(storage, step, key, listed.pop(step, None), destinations)
        problems = dist.all_gather_json(problem)
        failed = {r: p["message"] for r, p in enumerate(problems) if p is not None}
        if not failed:
            return loaded
        mismatched = [p["message"] for p in problems if p is not None and p.get("mismatch")]
        if mismatched:
            raise StateMismatchError(f"checkpoint step {step} does not fit this job: {mismatched[0]}")
        older = candidates[index + 1] if index + 1 < len(candidates) else None
        if dist.rank() == 0:
            log.warning(
                "checkpoint step %d failed verification (%s); falling back to %s",
                step,
                "; ".join(f"rank {r}: {p}" for r, p in sorted(failed.items())),
                f"step {older}" if older is not None else "nothing older",
            )
            if any(p["corrupt"] for p in problems if p is not None):
                reject_step(storage, key, "; ".join(failed.values()))
    if candidates:
        raise NoCheckpointError(
            f"no complete checkpoint under {storage.uri} could be loaded "
            f"(tried steps {candidates}); see the log for each failure"
        )
    return None


def _complete_newest_first(storage: Storage, supervisor_step: int | None) -> list[catalog.StepInfo]:
    steps = catalog.list_steps(storage)
    catalog.refuse_start_over(storage, steps)
    complete = [s for s in steps if s.status == catalog.COMPLETE]
    complete.sort(key=lambda s: s.step, reverse=True)
    if supervisor_step is not None and complete and complete[0].step != supervisor_step:
        log.info("the supervisor chose step %d; the newest complete step is now %d",
                 supervisor_step, complete[0].step)
    return complete


def _try_load(storage: Storage, step: int, key: str, manifest: Manifest | None,
              destinations: Any) -> tuple[LoadedStep | None, dict | None]:
    try:
        return load_step(storage, step, key, dist.rank(), dist.world_size(), manifest, destinations), None
    except (CorruptShardError, ManifestError) as exc:
        return None, {"corrupt": True, "message": str(exc)}
    except StateMismatchError as exc:  # not a bad step: every rank refuses it together
        return None, {"corrupt": False, "mismatch": True, "message": str(exc)}
    except StorageError as exc:  # missing object, or the store failed after retries
        return None, {"corrupt": False, "message": f"{type(exc).__name__}: {exc}"}


def claim_incarnation(storage: Storage, *, resumed_step: int | None, at_least: int, run_id: str,
                      after_newest: bool = False, saving_step: int | None = None) -> int:
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

    Raises:
        CheckpointSaveError: with ``saving_step``: the claim failed (``retryable`` false when
            the store cannot commit at all).
        StorageError: without it: the claim failed.
    """
    claimed: dict = {}
    if dist.rank() == 0:
        try:
            if after_newest:
                newest = catalog.newest_complete(storage)
                resumed_step = newest.step if newest else None
                at_least = max(at_least, newest.manifest.incarnation + 1 if newest else 0)
            claimed = {"incarnation": fencing.claim(storage, resumed_step=resumed_step, run_id=run_id,
                                                    at_least=at_least).incarnation}
        except (SpotrunError, OSError) as exc:  # told to every rank, so none waits alone
            claimed = {"error": f"{type(exc).__name__}: {exc}",
                       "retryable": not isinstance(exc, CommitUnsupportedError)}
    claimed = dist.broadcast_json(claimed)
    if "error" in claimed:
        problem = f"cannot record this start under {storage.uri}: {claimed['error']}"
        if saving_step is not None:
            raise CheckpointSaveError(f"save of step {saving_step} failed on rank 0: {problem} - nothing was committed",
                                      retryable=claimed["retryable"])
        raise StorageError(5, problem)
    return claimed["incarnation"]

"""Which steps of a fast tier (:mod:`spotrun.train.fast_tier`) a restart may resume from: the
same answer for the supervisor's choice and the workers' restore.

A fast-tier step is a candidate only when it is complete, of this run, and written by an
incarnation that the checkpoint root itself recorded and has not fenced since: the tier is a
shortcut to the root's history, never a history of its own (a root that was deleted to start
over, or a newer start that resumed from an older step, leaves the tier's steps unused).
"""

from __future__ import annotations

from dataclasses import dataclass

from spotrun.checkpoint import catalog
from spotrun.checkpoint.fencing import Fences
from spotrun.storage.base import Storage


@dataclass(frozen=True)
class TierCandidates:
    """The fast tier's steps, sorted out.

    Attributes:
        usable: complete steps a restart may resume from, newest first.
        ignored: (step, why) of the others newer than the newest usable one, for the log.
    """

    usable: list[catalog.StepInfo]
    ignored: list[tuple[int, str]]


def tier_candidates(fast_tier: Storage, fences: Fences, run_id: str | None) -> TierCandidates:
    """Sort the fast tier's steps against the root's incarnation table ``fences`` and ``run_id``
    (``None``: any run).

    Raises:
        StorageError, OSError: listing the tier failed.
    """
    usable, ignored = [], []
    for info in sorted(catalog.list_steps(fast_tier), key=lambda s: s.step, reverse=True):
        manifest = info.manifest
        if info.status != catalog.COMPLETE or manifest is None:
            ignored.append((info.step, f"{info.status}: {info.problem}"))
        elif run_id is not None and manifest.run_id not in (run_id, ""):
            ignored.append((info.step, f"it belongs to another run ({manifest.run_id})"))
        elif manifest.incarnation not in fences.resumed:
            ignored.append(
                (info.step, f"the checkpoint root does not know its incarnation {manifest.incarnation} (started over?)")
            )
        elif (newer := fences.fenced_by(manifest.incarnation, info.step)) is not None:
            ignored.append((info.step, f"incarnation {newer} fenced it on the checkpoint root"))
        else:
            usable.append(info)
    newest_usable = usable[0].step if usable else -1
    return TierCandidates(usable, [(step, why) for step, why in ignored if step > newest_usable])

"""Retention: which complete steps to keep, and deleting a step so that every state on the
way is valid.

:func:`plan_retention` (pure) keeps the ``keep_last`` newest complete steps, those whose number
divides by ``keep_every``, the newest one and the steps the caller protects; only complete steps
are ever planned for deletion. :func:`delete_step` goes marker, manifests, files, marker, so a
kill leaves a complete step or one no start resumes from. :class:`Retainer` applies the rule in
a training job. Details: ``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from spotrun.checkpoint import catalog, fencing
from spotrun.checkpoint.layout import DELETION_MARKER_NAME, parse_manifest_name, step_dir
from spotrun.errors import ConfigError, FencedError, SpotrunError
from spotrun.storage.base import ObjectInfo, Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which complete steps a job keeps.

    Attributes:
        keep_last: keep this many newest complete steps (at least 1); ``None`` or 0: keep
            every step (no retention).
        keep_every: also keep every step divisible by this (at least 1); needs ``keep_last``.

    Raises:
        ConfigError: a value below its minimum, or ``keep_every`` without ``keep_last``.
    """

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        if self.keep_last is not None and self.keep_last < 0:
            raise ConfigError(f"keep_last must be >= 0 (0: keep every step), got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"keep_every must be >= 1, got {self.keep_every}")
        if self.keep_every is not None and self.keep_last is None:
            raise ConfigError(
                f"keep_every={self.keep_every} needs keep_last: it says which steps to keep "
                "besides the newest ones (keep_last=0 keeps every step)"
            )

    @property
    def active(self) -> bool:
        """Whether some complete steps may be deleted (``keep_last`` >= 1)."""
        return bool(self.keep_last)

    def describe(self) -> str:
        """``"keep_last=2, keep_every=50"``, or ``"keep every step"``."""
        if not self.active:
            return "keep every step"
        return f"keep_last={self.keep_last}" + (f", keep_every={self.keep_every}" if self.keep_every else "")

    @classmethod
    def for_worker(
        cls, keep_last: int | None, keep_every: int | None, env_keep_last: int | None, env_keep_every: int | None
    ) -> RetentionPolicy:
        """The policy of a Checkpointer: each argument given wins over its environment variable
        (``$SPOTRUN_KEEP_LAST``, ``$SPOTRUN_KEEP_EVERY``, set by ``spotrun run``)."""
        return cls(
            keep_last=env_keep_last if keep_last is None else keep_last,
            keep_every=env_keep_every if keep_every is None else keep_every,
        )


@dataclass(frozen=True)
class Decision:
    """What retention or gc does with one step.

    Attributes:
        step: the step number.
        status: its catalog status (``complete``, ``incomplete``, ``corrupt``, ``fenced``).
        delete: whether it is deleted.
        reason: why, in words (``"one of the 2 newest"``).
    """

    step: int
    status: str
    delete: bool
    reason: str


def plan_retention(
    complete: Sequence[int], policy: RetentionPolicy, *, protected: Mapping[int, str] | None = None
) -> list[Decision]:
    """Decide, for each complete step, whether the policy keeps it (oldest first).

    Args:
        complete: the numbers of the complete steps.
        policy: the rule.
        protected: step -> why it must be kept whatever the rule says (the resume source).

    Returns:
        One decision per step of ``complete``; the newest is always kept.
    """
    steps = sorted(set(complete))
    protected = protected or {}
    if not policy.active:
        return [Decision(s, catalog.COMPLETE, False, "no keep_last: every complete step is kept") for s in steps]
    newest = set(steps[-policy.keep_last :])
    among = "the newest" if policy.keep_last == 1 else f"one of the {policy.keep_last} newest"
    decisions = []
    for step in steps:
        reasons = []
        if steps and step == steps[-1]:
            reasons.append("the newest complete step")
        elif step in newest:
            reasons.append(among)
        if policy.keep_every and step % policy.keep_every == 0:
            reasons.append(f"divisible by {policy.keep_every}")
        if step in protected:
            reasons.append(protected[step])
        if reasons:
            decisions.append(Decision(step, catalog.COMPLETE, False, "; ".join(reasons)))
        else:
            why = f"not {among}" + (f", not divisible by {policy.keep_every}" if policy.keep_every else "")
            decisions.append(Decision(step, catalog.COMPLETE, True, why))
    return decisions


def plan_gc(
    steps: Sequence[catalog.StepInfo],
    policy: RetentionPolicy,
    *,
    protected: Mapping[int, str],
    now_unix_s: float,
    older_than_s: float,
) -> list[Decision]:
    """Decide, for each step of a root, what ``spotrun gc`` does (oldest first).

    Complete steps follow :func:`plan_retention`. An incomplete or fenced step is deleted
    when its newest object is at least ``older_than_s`` seconds old (no save can still be
    writing it: a save's storage operations end within the job's ``save_timeout_s``), or at
    once when it is an interrupted deletion (:attr:`~spotrun.checkpoint.catalog.StepInfo.being_deleted`).
    A corrupt step is kept and reported: what is wrong with it is for a person to look at.
    """
    complete = [s.step for s in steps if s.status == catalog.COMPLETE]
    decisions = {d.step: d for d in plan_retention(complete, policy, protected=protected)}
    for info in steps:
        if info.status == catalog.COMPLETE:
            continue
        if info.status == catalog.CORRUPT:
            decisions[info.step] = Decision(
                info.step, info.status, False, f"{info.problem}; reported, never deleted by gc"
            )
            continue
        age_s = now_unix_s - info.newest_object_unix_s
        if info.being_deleted:
            decisions[info.step] = Decision(
                info.step,
                info.status,
                True,
                "an interrupted deletion (deleting.json is its newest object): finishing it",
            )
        elif age_s >= older_than_s:
            decisions[info.step] = Decision(
                info.step,
                info.status,
                True,
                f"{info.problem}; newest object {age_s:.0f} s old (threshold {older_than_s:g} s)",
            )
        else:
            decisions[info.step] = Decision(
                info.step,
                info.status,
                False,
                f"newest object {max(age_s, 0.0):.0f} s old, under the {older_than_s:g} s threshold: a save may still "
                "be writing it",
            )
    return [decisions[step] for step in sorted(decisions)]


@dataclass(frozen=True)
class DeletedStep:
    """What :func:`delete_step` removed: the step, its objects and their bytes."""

    step: int
    objects: int
    size_bytes: int


def delete_step(
    storage: Storage,
    step: int,
    *,
    why: str,
    timeout_s: float | None = None,
    on_deleted: Callable[[int], None] | None = None,
    objects: Sequence[ObjectInfo] | None = None,
) -> DeletedStep:
    """Delete every object of ``step``: marker, manifests, the other objects, the marker
    (see the module docstring for why in this order).

    Objects written into the step after it was listed are left alone.

    Args:
        why: recorded in the marker (``"retention: keep_last=2"``).
        objects: the step's objects as the caller listed them
            (:attr:`~spotrun.checkpoint.catalog.StepInfo.objects`: its spread prefixes too, even
            once its manifests are gone); ``None``: listed here, where its manifest says
            (:func:`~spotrun.checkpoint.catalog.inspect_step`).
        timeout_s: bound of the storage operations of the deletion, in seconds (``None``:
            each operation's own bound).
        on_deleted: called with 1 after each object deleted (progress).

    Raises:
        StorageError: a listing, write or deletion failed; what was deleted before stays
            deleted, and the step lists as incomplete (being deleted) once its manifests are gone.
    """
    prefix = f"{step_dir(step)}/"
    if objects is None:
        info = catalog.inspect_step(storage, step)
        objects = info.objects if info is not None else ()
    marker = prefix + DELETION_MARKER_NAME
    if not objects:
        return DeletedStep(step, 0, 0)
    end_s = None if timeout_s is None else time.monotonic() + timeout_s
    storage.put(
        marker,
        json.dumps(
            {
                "format": "spotrun-deletion",
                "step": step,
                "why": why,
                "started_unix_s": time.time(),
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
            },
            indent=1,
        ).encode("utf-8"),
    )
    manifests = [o.key for o in objects if o.key.startswith(prefix) and parse_manifest_name(o.key[len(prefix) :])[0]]
    rest = [o.key for o in objects if o.key != marker and o.key not in manifests]

    def delete(key: str) -> None:
        bound = contextlib.nullcontext() if end_s is None else storage.deadline(max(end_s - time.monotonic(), 0.001))
        with bound:  # deadlines are per thread: entered on the thread that deletes
            storage.delete(key)
        if on_deleted is not None:
            on_deleted(1)

    for key in manifests:  # first: from here on the step is not complete
        delete(key)
    workers = min(storage.read_concurrency, len(rest))
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spotrun-delete") as pool:
            list(pool.map(delete, rest))  # raises the first failure, after the others ended
    else:
        for key in rest:
            delete(key)
    delete(marker)
    return DeletedStep(
        step, len([o for o in objects if o.key != marker]), sum(o.size_bytes for o in objects if o.key != marker)
    )


class Retainer:
    """Applies a :class:`RetentionPolicy` in a training job after each commit (call it on
    global rank 0 only, on the thread that committed).

    Args:
        storage: the checkpoint root.
        policy: the rule; an inactive one makes :meth:`after_commit` do nothing.
        timeout_s: bound of one pass's storage operations, in seconds.
    """

    def __init__(self, storage: Storage, policy: RetentionPolicy, *, timeout_s: float) -> None:
        self.storage = storage
        self.policy = policy
        self.timeout_s = timeout_s

    def after_commit(self, step: int, incarnation: int | None) -> list[int]:
        """Delete the complete steps the policy no longer keeps, after ``step`` committed;
        returns the steps deleted.

        Keeps the newest complete step, ``step`` itself, and the step ``incarnation``
        resumed from (as its incarnation record says). Does nothing when a newer
        incarnation has started (this process is an orphaned copy of the job). Never
        raises for a storage failure: it is logged, the steps stay, and the next commit
        tries again.
        """
        if not self.policy.active or incarnation is None:
            return []
        deleted: list[int] = []
        try:
            with self.storage.deadline(self.timeout_s):
                self._apply(step, incarnation, deleted, time.monotonic() + self.timeout_s)
        except FencedError as exc:
            log.warning("retention not applied after the commit of step %d: %s", step, exc)
        except (SpotrunError, OSError) as exc:
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning(
                "retention (%s) after the commit of step %d failed: %s: %s; the steps it did not "
                "delete stay, and the next commit tries again",
                self.policy.describe(),
                step,
                type(exc).__name__,
                text,
            )
        return deleted

    def _apply(self, step: int, incarnation: int, deleted: list[int], end_s: float) -> None:
        steps, fences = catalog.list_root(self.storage)
        fencing.check_not_fenced(self.storage, incarnation, fences)
        protected = {step: "just committed"}
        resumed = fences.resumed.get(incarnation)
        if resumed is not None:
            protected[resumed] = f"the step incarnation {incarnation} resumed from"
        complete = [s.step for s in steps if s.status == catalog.COMPLETE]
        listed = {s.step: s.objects for s in steps}
        for decision in plan_retention(complete, self.policy, protected=protected):
            if not decision.delete:
                continue
            fencing.check_not_fenced(self.storage, incarnation)  # a newer start may have begun meanwhile
            done = delete_step(
                self.storage,
                decision.step,
                why=f"retention ({self.policy.describe()}) after "
                f"step {step}, incarnation {incarnation}: {decision.reason}",
                timeout_s=end_s - time.monotonic(),
                objects=listed[decision.step],
            )
            deleted.append(decision.step)
            log.info(
                "retention (%s): deleted step %d (%s; %d objects, %.1f MiB)",
                self.policy.describe(),
                decision.step,
                decision.reason,
                done.objects,
                done.size_bytes / 2**20,
            )

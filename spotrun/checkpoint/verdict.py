"""What every rank does with a step that they all tried to load: load it, fall back (un-committing
it when it is corrupt), or refuse it as not fitting the job (:func:`judge`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepVerdict:
    """What every rank does with a step that they all tried to load (:func:`judge`).

    Attributes:
        failures: rank -> why it could not load the step; empty: every rank loaded it.
        mismatch: why the step does not fit this job (a rank's :class:`StateMismatchError`):
            every rank refuses it rather than falling back; ``None`` otherwise.
        corrupt: a file or manifest of the step is corrupt on some rank: rank 0 un-commits
            the step (:func:`spotrun.checkpoint.restore.reject_step`) before every rank falls
            back to the next older one.
    """

    failures: dict[int, str]
    mismatch: str | None = None
    corrupt: bool = False

    @property
    def loads(self) -> bool:
        """Whether every rank loaded the step."""
        return not self.failures


def judge(problems: list[dict | None]) -> StepVerdict:
    """The verdict on one step from every rank's problem with it, indexed by rank: ``None``
    where that rank loaded it, else ``{"message": str, "corrupt": bool}``, with
    ``"mismatch": True`` when the step does not fit the job."""
    failed = {rank: p for rank, p in enumerate(problems) if p is not None}
    mismatched = [p["message"] for p in failed.values() if p.get("mismatch")]
    return StepVerdict(
        failures={rank: p["message"] for rank, p in failed.items()},
        mismatch=mismatched[0] if mismatched else None,
        corrupt=any(p["corrupt"] for p in failed.values()),
    )

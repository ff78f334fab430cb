"""How long an emergency save would take, and whether it fits before the deadline.

The supervisor decides this when a stop notice arrives. An emergency save commits after:

1. the save in progress, if any (a periodic save), has finished: its measured duration
   minus the time it has already run;
2. the workers reached the next step boundary where they look at the request: at most
   ``check_interval_steps`` training steps;
3. the save itself: the bytes of the last save divided by the *slowest* throughput
   (bytes per second, start of the save to its commit) among the recent saves.

The measurements come from this launch's workers (``saves.json`` in the control directory,
:mod:`spotrun.control`) or, before this launch saved anything, from the ``timing`` of the
checkpoint it resumed from (:class:`spotrun.manifest.SaveTiming`: that save's slowest
shard write, plus :data:`COMMIT_ALLOWANCE_S` for the collectives and the manifest). With
neither there is no estimate and the supervisor asks for the save anyway (bounded by the
deadline, as always).
"""

from __future__ import annotations

from dataclasses import dataclass

from spotrun.control import SaveStats
from spotrun.manifest import Manifest

#: Seconds added to a manifest's recorded shard-write time for the rest of a save (the
#: collectives, the manifest's conditional put), when no whole save was measured yet.
COMMIT_ALLOWANCE_S = 1.0
#: Seconds assumed for reaching the next step boundary when the step time is unknown.
UNKNOWN_STEP_TIME_S = 0.0


@dataclass(frozen=True)
class SaveEstimate:
    """An estimate of the time from "now" to the commit of an emergency checkpoint.

    Attributes:
        in_flight_s: seconds until the save now in progress finishes (0 if none).
        in_flight_step: the step being saved now, if any.
        boundary_s: seconds until the workers reach the step boundary where they look at
            the request (``check_interval_steps`` steps).
        save_s: seconds the emergency save itself takes.
        size_bytes: bytes the save writes (all ranks).
        throughput_bytes_per_s: the slowest measured save throughput.
        basis: where the figures come from, for the log (``"3 saves of this launch"``).
        allowance_s: seconds of ``save_s`` that are :data:`COMMIT_ALLOWANCE_S` rather than
            measured (an estimate from a manifest's shard-write time); 0 otherwise.
    """

    in_flight_s: float
    in_flight_step: int | None
    boundary_s: float
    save_s: float
    size_bytes: int
    throughput_bytes_per_s: float
    basis: str
    allowance_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Seconds from now to the emergency checkpoint's commit."""
        return self.in_flight_s + self.boundary_s + self.save_s

    def describe(self) -> str:
        """One line for the log: the total and how it is made up."""
        parts = []
        if self.in_flight_step is not None:
            parts.append(f"{self.in_flight_s:.1f} s to finish the save of step {self.in_flight_step} in progress")
        parts.append(f"{self.boundary_s:.1f} s to the next step boundary")
        if self.allowance_s:
            parts.append(f"{self.save_s:.1f} s to save {_amount(self.size_bytes)}: the recorded shard write of "
                         f"{self.save_s - self.allowance_s:.1f} s + {self.allowance_s:.1f} s allowed for the commit")
        else:
            parts.append(f"{self.save_s:.1f} s to save {_amount(self.size_bytes)} at "
                         f"{_amount(self.throughput_bytes_per_s)}/s")
        return f"{self.total_s:.1f} s ({', '.join(parts)}; from {self.basis})"


def estimate_emergency_save(
    stats: SaveStats | None, resumed: Manifest | None, now_unix_s: float
) -> SaveEstimate | None:
    """Estimate the emergency save from the measurements at hand (see the module docstring).

    Args:
        stats: this launch's measurements (``saves.json``), or ``None``.
        resumed: the manifest of the checkpoint this launch resumed from, or ``None``.
        now_unix_s: the current time, seconds since the epoch.

    Returns:
        The estimate, or ``None`` when nothing was measured yet.
    """
    step_time_s = stats.step_time_s if stats is not None else None
    check_interval_steps = stats.check_interval_steps if stats is not None else 1
    if stats is not None and stats.recent:
        size_bytes = stats.recent[-1].size_bytes
        throughput = min(_throughput(r.size_bytes, r.duration_s) for r in stats.recent)
        save_s = _duration(size_bytes, throughput)
        n = len(stats.recent)
        basis = f"{n} save{'s' if n > 1 else ''} of this launch"
    elif resumed is not None and resumed.timing is not None:
        size_bytes = resumed.size_bytes
        save_s = resumed.timing.write_s + COMMIT_ALLOWANCE_S
        throughput = _throughput(size_bytes, save_s)
        basis = f"the manifest of step {resumed.step}"
        if step_time_s is None:
            step_time_s = resumed.timing.step_time_s
    else:
        return None
    allowance_s = 0.0 if stats is not None and stats.recent else COMMIT_ALLOWANCE_S
    in_flight_s, in_flight_step = 0.0, None
    if stats is not None and stats.in_progress is not None:
        in_flight_step = stats.in_progress.step
        in_flight_s = max(0.0, save_s - max(0.0, now_unix_s - stats.in_progress.started_unix_s))
    step_s = UNKNOWN_STEP_TIME_S if step_time_s is None else step_time_s
    return SaveEstimate(
        in_flight_s=in_flight_s,
        in_flight_step=in_flight_step,
        boundary_s=step_s * check_interval_steps,
        save_s=save_s,
        size_bytes=size_bytes,
        throughput_bytes_per_s=throughput,
        basis=basis,
        allowance_s=allowance_s,
    )


def _throughput(size_bytes: int, duration_s: float) -> float:
    return max(size_bytes, 1) / max(duration_s, 1e-6)


def _duration(size_bytes: int, throughput_bytes_per_s: float) -> float:
    return max(size_bytes, 1) / throughput_bytes_per_s


def _amount(size_bytes: float) -> str:
    """``"512 KiB"``, ``"3.2 MiB"``, ``"1.5 GiB"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes / 2**10:.0f} KiB"

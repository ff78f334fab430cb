"""Goodput accounting from the event log (:mod:`spotrun.eventlog.records`): pure computation, no I/O.

Joins rank 0's records of each incarnation (one start of the training job) with the
supervisor launch that started it, and counts wall time, steps trained, kept and lost,
training, start-up, restore and save-stall time, and goodput (useful time / wall time), every
figure from the records, none guessed. The definitions: ``docs/design/internals.md``
(Event log and goodput).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spotrun.eventlog.records import key_host

#: How an incarnation ended, as shown; from the supervisor's exit when it wrote one.
SAVED_ENDINGS = ("preempted_saved", "stopped_saved")
_PERIODIC = ("periodic", "requested")
#: A save record's ``tier`` (none in logs from before the fast tier: storage).
MEMORY_TIER = "memory"
STORAGE_TIER = "storage"


@dataclass(frozen=True)
class Launch:
    """One supervisor launch: its records and the wall-time span it owns."""

    host: str
    incarnation: int
    records: tuple[dict[str, Any], ...]
    began_unix_s: float
    ended_unix_s: float


@dataclass(frozen=True)
class Incarnation:
    """One start of the job, accounted (seconds; steps are optimizer steps).

    ``number`` is rank 0's incarnation, ``None`` for a launch that never started training.
    ``ended``: ``finished``, ``preempted_saved``, ``preempted_not_saved``, ``fenced``, ``failed``,
    ``restarted`` (the command failed and the supervisor launched it again), ``error``,
    ``stopped_saved`` / ``stopped_not_saved`` (told to stop, no supervisor exit recorded),
    ``exited`` (``close()`` without a stop), or ``no_exit_recorded`` (killed without notice,
    or still running). Figures that cannot be known are ``None``. ``end_recorded`` is False
    when rank 0 recorded no stop or exit of its own (killed without notice, a rank that
    crashed - the supervisor may still have recorded the command's exit - or still running):
    the log stops up to ``event_interval_s`` before the end, so its
    wall time, last step, steps trained and steps lost are lower bounds.
    ``restore_tier``: where its start read the resumed step, ``"memory"`` (the fast tier) or
    ``"storage"`` (``None``: a fresh start, or a log from before tiers). ``saves`` counts its saves
    to storage, ``memory_saves`` those to the fast tier; ``newest_saved_step`` is the newest step
    committed in any tier by its end (its resumed step when none was), in ``newest_saved_tier``:
    the step the next start can resume from at best (its steps lost count against the step it
    did resume from: a fast-tier step lost with its node or failing verification is not resumed).
    """

    number: int | None
    host: str | None
    began_unix_s: float
    ended_unix_s: float
    wall_s: float
    resumed_step: int
    last_step: int
    steps_trained: int
    steps_kept: int
    steps_lost: int
    startup_s: float | None
    restore_s: float
    save_stall_s: float
    saves: int
    training_s: float
    step_time_s: float | None
    useful_s: float
    lost_s: float
    notice_to_exit_s: float | None
    ended: str
    interval_steps: int | None
    event_interval_s: float | None = None
    end_recorded: bool = True
    restore_tier: str | None = None
    memory_saves: int = 0
    newest_saved_step: int | None = None
    newest_saved_tier: str | None = None


@dataclass(frozen=True)
class Totals:
    """Sums over every incarnation (seconds, steps) and the goodput (0..1; ``None`` when no
    wall time was recorded). ``startup_s`` / ``notice_to_exit_s`` are ``None`` when no
    incarnation had one."""

    incarnations: int
    wall_s: float
    elapsed_s: float
    steps_trained: int
    steps_lost: int
    useful_s: float
    lost_s: float
    startup_s: float | None
    restore_s: float
    save_stall_s: float
    notice_to_exit_s: float | None
    training_s: float
    goodput: float | None
    interruptions: int
    unsaved_interruptions: int


@dataclass(frozen=True)
class Accounting:
    """The whole account: each incarnation in order, and the totals."""

    incarnations: tuple[Incarnation, ...]
    totals: Totals
    saves: tuple[dict[str, Any], ...] = field(default=())  # every periodic save record, for the interval


def _first(records: Iterable[dict[str, Any]], event: str) -> dict[str, Any] | None:
    return next((r for r in records if r["event"] == event), None)


def _last_time(records: Sequence[dict[str, Any]]) -> float:
    return max(r["time_unix_s"] for r in records)


def launches(supervisor_objects: Iterable[tuple[str, int, Sequence[dict[str, Any]]]]) -> list[Launch]:
    """Launches with their wall-time spans, from ``(writer, planned incarnation, records)``
    of each supervisor object; ``writer`` (``supervisor-<host>-<id>``) names one supervisor
    process, whose launches split its lifetime between them."""
    by_writer: dict[str, list[tuple[float, int, Sequence[dict[str, Any]]]]] = {}
    for writer, incarnation, records in supervisor_objects:
        launch = _first(records, "launch")
        if launch is None:
            continue
        by_writer.setdefault(writer, []).append((launch["time_unix_s"], incarnation, records))
    found = []
    for writer, objects in by_writer.items():
        host = writer.removeprefix("supervisor-").rpartition("-")[0]  # supervisor-<host>-<id>
        objects.sort(key=lambda item: item[0])
        begins = []
        for launch_s, _, records in objects:
            start = _first(records, "start")
            begin = launch_s
            if start is not None:
                # spotrun's own start (earlier logs: the process's, which counted a shell's work before an exec)
                started = start.get("spotrun_started_unix_s") or start.get("process_started_unix_s")
                begin = min(begin, started or start["time_unix_s"], start["time_unix_s"])
            begins.append(begin)
        for k, (_, incarnation, records) in enumerate(objects):
            end = begins[k + 1] if k + 1 < len(objects) else _last_time(records)
            found.append(Launch(host, incarnation, tuple(records), begins[k], max(end, begins[k])))
    return sorted(found, key=lambda launch: launch.began_unix_s)


def _match(start: dict[str, Any], candidates: list[Launch]) -> Launch | None:
    """The launch that started the training start ``start`` (rank 0's start record)."""
    began = start["time_unix_s"] - start.get("restore_s", 0.0)
    fitting = [
        launch
        for launch in candidates
        if launch.host == key_host(str(start.get("host")))
        and launch.incarnation == start.get("launch_incarnation")
        and launch.began_unix_s <= began
    ]
    return max(fitting, key=lambda launch: launch.began_unix_s) if fitting else None


def _ending(launch: Launch | None, rank: Sequence[dict[str, Any]], is_last_of_launch: bool) -> str:
    if launch is not None and is_last_of_launch:
        exit_record = _first(launch.records, "exit")
        if exit_record is not None:
            return str(exit_record.get("reason") or "error")
        if _first(launch.records, "restart") is not None:
            return "restarted"
    stop = _first(rank, "stop")
    if stop is not None:
        return "stopped_saved" if stop.get("saved") else "stopped_not_saved"
    return "exited" if _first(rank, "exit") is not None else "no_exit_recorded"


def _notice_to_exit_s(launch: Launch | None) -> float | None:
    if launch is None:
        return None
    notice = next((r for r in launch.records if r["event"] == "notice" and r.get("stop", True)), None)
    end = _first(launch.records, "exit") or _first(launch.records, "command_exit")
    if notice is None or end is None:
        return None
    return max(0.0, end["time_unix_s"] - notice["time_unix_s"])


def _reached(rank: Sequence[dict[str, Any]], resumed: int) -> tuple[int, float | None]:
    """``(L, t_L)``: the newest step reached and when it ended (``None``: no step recorded).

    The progress record holds both (it is rewritten with every write, so no other record
    names a newer step); a save of a step never passed to ``end_of_step`` counts from the
    save's start, a stop or exit record from its own time.
    """
    stepped = [r for r in rank if r["event"] in ("progress", "save", "stop", "exit") and isinstance(r.get("step"), int)]
    last = max([resumed] + [r["step"] for r in stepped])
    at = [
        r["time_unix_s"] - (float(r.get("duration_s") or 0.0) if r["event"] == "save" else 0.0)
        for r in sorted(stepped, key=lambda r: r["event"] != "progress")
        if r["step"] == last
    ]
    return last, (at[0] if at else None)


def account(
    rank_objects: Mapping[int, Sequence[dict[str, Any]]],
    supervisor_launches: Sequence[Launch],
    resumed_steps: Mapping[int, int | None] | None = None,
) -> Accounting:
    """Account every incarnation (see the module docstring).

    Args:
        rank_objects: rank 0's records per incarnation number.
        supervisor_launches: :func:`launches` of the supervisors' objects.
        resumed_steps: incarnation -> the step it resumed from, ``None`` for a fresh start
            (:attr:`spotrun.checkpoint.fencing.Fences.resumed`); overrides the start records.
    """
    resumed_steps = resumed_steps or {}
    starts = {n: _first(records, "start") for n, records in rank_objects.items()}
    numbers = sorted(n for n, start in starts.items() if start is not None)

    def resumed_of(n: int) -> int:
        value = resumed_steps.get(n, starts[n].get("resumed_step"))
        return value if isinstance(value, int) else 0

    owners = {n: _match(starts[n], list(supervisor_launches)) for n in numbers}
    rows: list[Incarnation] = []
    for index, n in enumerate(numbers):
        launch = owners[n]
        sharing = [m for m in numbers if owners[m] is launch] if launch is not None else [n]
        position = sharing.index(n)
        next_start = starts[sharing[position + 1]] if position + 1 < len(sharing) else None
        following = resumed_of(numbers[index + 1]) if index + 1 < len(numbers) else None
        rows.append(
            _incarnation_row(
                n,
                rank_objects[n],
                starts[n],
                launch,
                first_of_launch=position == 0,
                next_start=next_start,
                resumed=resumed_of(n),
                following=following,
            )
        )
    periodic = [
        r
        for n in numbers
        for r in rank_objects[n]
        if r["event"] == "save" and r.get("reason") in _PERIODIC and r.get("committed") and r.get("tier") != MEMORY_TIER
    ]
    owned = {id(launch) for launch in owners.values() if launch is not None}
    for launch in supervisor_launches:  # launches that never started training
        if id(launch) in owned or _overlaps_training(launch, rows):
            continue
        rows.append(_idle_launch_row(launch))
    rows.sort(key=lambda row: row.began_unix_s)
    return Accounting(tuple(rows), _totals(rows), tuple(periodic))


def _incarnation_row(
    n: int,
    records: Sequence[dict[str, Any]],
    start: dict[str, Any],
    launch: Launch | None,
    *,
    first_of_launch: bool,
    next_start: dict[str, Any] | None,
    resumed: int,
    following: int | None,
) -> Incarnation:
    """The row of incarnation ``n`` (rank 0's ``records``, its ``start`` record, the launch
    that started it). ``next_start``: the start record of the next incarnation of the same
    launch, where this one ends; ``following``: the step the next incarnation resumed."""
    restore_s = float(start.get("restore_s") or 0.0)
    restore_began = start["time_unix_s"] - restore_s
    began = launch.began_unix_s if launch is not None and first_of_launch else restore_began
    if next_start is not None:
        ended = next_start["time_unix_s"] - (next_start.get("restore_s") or 0.0)
    else:
        ended = max([_last_time(records)] + ([launch.ended_unix_s] if launch is not None else []))
    last, last_s = _reached(records, resumed)
    lost = max(0, last - following) if following is not None else 0
    kept = max(0, (min(last, following) if following is not None else last) - resumed)
    saves = [r for r in records if r["event"] == "save"]
    # a fast-tier save's staging copy blocks training as a storage save's does
    stall_s = sum(float(r.get("stall_s") or 0.0) for r in saves if r.get("step", last) < last)
    in_memory = [r for r in saves if r.get("tier") == MEMORY_TIER]
    newest_saved = _newest_saved(saves, resumed, start.get("restore_tier"))
    trained = last - resumed
    training_s = max(0.0, (last_s or start["time_unix_s"]) - start["time_unix_s"] - stall_s)
    step_time_s = training_s / trained if trained > 0 and training_s > 0 else None
    return Incarnation(
        number=n,
        host=start.get("host"),
        began_unix_s=began,
        ended_unix_s=max(ended, began),
        wall_s=max(0.0, ended - began),
        resumed_step=resumed,
        last_step=last,
        steps_trained=trained,
        steps_kept=kept,
        steps_lost=lost,
        startup_s=max(0.0, restore_began - began) if first_of_launch and launch is not None else None,
        restore_s=restore_s,
        save_stall_s=stall_s,
        saves=len(saves) - len(in_memory),
        training_s=training_s,
        step_time_s=step_time_s,
        useful_s=kept * (step_time_s or 0.0),
        lost_s=lost * (step_time_s or 0.0),
        notice_to_exit_s=_notice_to_exit_s(launch) if next_start is None else None,
        ended=_ending(launch, records, next_start is None),
        interval_steps=start.get("interval_steps"),
        event_interval_s=start.get("event_interval_s"),
        end_recorded=_first(records, "exit") is not None or _first(records, "stop") is not None,
        restore_tier=start.get("restore_tier"),
        memory_saves=len(in_memory),
        newest_saved_step=newest_saved[0],
        newest_saved_tier=newest_saved[1],
    )


def _newest_saved(
    saves: Sequence[dict[str, Any]], resumed: int, restore_tier: str | None
) -> tuple[int | None, str | None]:
    """``(step, tier)``: the newest step committed by ``saves`` in any tier, else the resumed
    one (``(None, None)`` for a fresh start that committed none); storage first at one step."""
    committed = [(r["step"], r.get("tier") or STORAGE_TIER) for r in saves if r.get("committed")]
    if resumed:
        committed.append((resumed, restore_tier or STORAGE_TIER))
    if not committed:
        return None, None
    return max(committed, key=lambda saved: (saved[0], saved[1] == STORAGE_TIER))


def _idle_launch_row(launch: Launch) -> Incarnation:
    """The row of a launch that never started training: wall time, no steps."""
    return Incarnation(
        number=None,
        host=launch.host,
        began_unix_s=launch.began_unix_s,
        ended_unix_s=launch.ended_unix_s,
        wall_s=launch.ended_unix_s - launch.began_unix_s,
        resumed_step=0,
        last_step=0,
        steps_trained=0,
        steps_kept=0,
        steps_lost=0,
        startup_s=None,
        restore_s=0.0,
        save_stall_s=0.0,
        saves=0,
        training_s=0.0,
        step_time_s=None,
        useful_s=0.0,
        lost_s=0.0,
        notice_to_exit_s=_notice_to_exit_s(launch),
        ended=_ending(launch, (), True),
        interval_steps=None,
    )


def _overlaps_training(launch: Launch, rows: Sequence[Incarnation]) -> bool:
    """Whether ``launch`` ran while a counted incarnation did (another node's supervisor of
    a multi-node job: its time is that incarnation's, not counted twice)."""
    return any(
        row.number is not None and launch.began_unix_s < row.ended_unix_s and row.began_unix_s < launch.ended_unix_s
        for row in rows
    )


def _totals(rows: Sequence[Incarnation]) -> Totals:
    wall_s = sum(row.wall_s for row in rows)
    useful_s = sum(row.useful_s for row in rows)
    trained = [row for row in rows if row.number is not None]
    # every start but the newest was followed by another; one that had finished was not cut short
    interrupted = [row for row in trained[:-1] if row.ended not in ("finished", "exited")]
    return Totals(
        incarnations=len(rows),
        wall_s=wall_s,
        elapsed_s=(max(r.ended_unix_s for r in rows) - min(r.began_unix_s for r in rows)) if rows else 0.0,
        steps_trained=sum(r.steps_trained for r in rows),
        steps_lost=sum(r.steps_lost for r in rows),
        useful_s=useful_s,
        lost_s=sum(r.lost_s for r in rows),
        startup_s=_sum_known(r.startup_s for r in rows),
        restore_s=sum(r.restore_s for r in rows),
        save_stall_s=sum(r.save_stall_s for r in rows),
        notice_to_exit_s=_sum_known(r.notice_to_exit_s for r in rows),
        training_s=sum(r.training_s for r in rows),
        goodput=useful_s / wall_s if wall_s > 0 else None,
        interruptions=len(interrupted),
        unsaved_interruptions=sum(1 for r in interrupted if r.ended not in SAVED_ENDINGS),
    )


def _sum_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None

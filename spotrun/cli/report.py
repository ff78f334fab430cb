"""``spotrun report URI [--json]``: where a run's time went, from its event log.

Reads the event log under the checkpoint root (:mod:`spotrun.eventlog.records`) and the incarnation
records (:mod:`spotrun.checkpoint.fencing`), accounts every incarnation
(:mod:`spotrun.eventlog.goodput`: wall time, steps trained and lost, start-up, restore, save stalls,
notice to exit, goodput) and suggests a checkpoint interval (:mod:`spotrun.eventlog.advice`).
Exit 0; 2 (spotrun's error) when the root has no event log or cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import time

from spotrun.cli._shared import URI_HELP, add_storage_options, location_of
from spotrun.control.env import DEFAULT_CHECKPOINT_URI


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``report`` to ``sub``."""
    parser = sub.add_parser(
        "report",
        parents=[common],
        help="goodput of a run: time and steps lost to preemptions",
        description="Per incarnation (one start of the job) and in total: wall time, steps trained, "
        "steps lost (trained, then trained again after a preemption: counted from the step the next start "
        "resumed, in memory or on storage), start-up, restore (and, when a start read the fast tier, where "
        "from), time "
        "training was blocked by saves, time from a notice to the exit, and goodput (time training "
        "the steps that were kept / wall time); then a checkpoint interval from the measured save "
        "cost and the observed rate of interruptions that lost work (Young/Daly), with the goodput "
        "it would have given.",
    )
    parser.add_argument("uri", metavar="URI", nargs="?", default=DEFAULT_CHECKPOINT_URI, help=URI_HELP)
    add_storage_options(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=run, default_log_level="warning")


def run(args: argparse.Namespace) -> int:
    """The handler: print the report of ``args.uri``; returns the exit code.

    Raises:
        ObjectNotFoundError: no such root, or no event log under it.
        StorageError: reading failed.
    """
    from spotrun.checkpoint.fencing import read_fences
    from spotrun.errors import ObjectNotFoundError
    from spotrun.eventlog.advice import advise
    from spotrun.eventlog.goodput import account, launches
    from spotrun.eventlog.records import EVENTS_DIR, read_events

    storage = location_of(args.uri, args).open_existing()
    objects = read_events(storage)
    if not objects:
        raise ObjectNotFoundError(
            errno.ENOENT,
            f"no event log under {storage.uri} (nothing in {EVENTS_DIR}/: "
            f"spotrun run and the Checkpointer's rank 0 write it)",
        )
    accounting = account(
        {o.incarnation: o.records for o in objects if o.rank == 0},
        launches((o.writer, o.incarnation, o.records) for o in objects if o.rank is None),
        read_fences(storage).resumed,
    )
    advice = advise(accounting)
    if args.json:
        print(
            json.dumps(
                {
                    "uri": storage.uri,
                    "incarnations": [dataclasses.asdict(r) for r in accounting.incarnations],
                    "totals": dataclasses.asdict(accounting.totals),
                    "interval": dataclasses.asdict(advice),
                },
                indent=1,
            )
        )
    else:
        print(render(storage.uri, accounting, advice))
    return 0


def duration(seconds: float | None) -> str:
    """``9.4 s``, ``12m 05s``, ``3h 02m``; ``-`` for ``None``."""
    if seconds is None:
        return "-"
    if seconds < 100:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 100:
        return f"{minutes}m {int(seconds % 60):02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f} %"


def _table(accounting) -> list[tuple[str, ...]]:
    """The rows of the table of incarnations, header and totals included."""
    totals = accounting.totals
    # where each start restored from, when some start read the fast tier (else as it always was)
    tiers = any(r.restore_tier == "memory" for r in accounting.incarnations)

    def tier(cell: str) -> tuple[str, ...]:
        return (cell,) if tiers else ()

    rows = [
        (
            "INC",
            "BEGAN (UTC)",
            "WALL",
            "STEPS",
            "TRAINED",
            "LOST",
            "START-UP",
            "RESTORE",
            *tier("FROM"),
            "SAVE STALL",
            "NOTICE->EXIT",
            "ENDED",
        )
    ]
    unended = [r for r in accounting.incarnations if not r.end_recorded]
    for r in accounting.incarnations:
        more = "" if r.end_recorded else "+"  # a lower bound: the log stops before the end
        rows.append(
            (
                "-" if r.number is None else str(r.number),
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.began_unix_s)),
                duration(r.wall_s) + more,
                f"{r.resumed_step}->{r.last_step}{more}",
                f"{r.steps_trained}{more}",
                f"{r.steps_lost}{more}",
                duration(r.startup_s),
                duration(r.restore_s),
                *tier(r.restore_tier or "-"),
                duration(r.save_stall_s),
                duration(r.notice_to_exit_s),
                r.ended,
            )
        )
    more = "+" if unended else ""
    rows.append(
        (
            "total",
            "",
            duration(totals.wall_s) + more,
            "",
            f"{totals.steps_trained}{more}",
            f"{totals.steps_lost}{more}",
            duration(totals.startup_s),
            duration(totals.restore_s),
            *tier(""),
            duration(totals.save_stall_s),
            duration(totals.notice_to_exit_s),
            "",
        )
    )
    return rows


def render(uri: str, accounting, advice) -> str:
    """The report as text: a table of incarnations, the totals, the interval suggestion."""
    totals = accounting.totals
    unended = [r for r in accounting.incarnations if not r.end_recorded]
    rows = _table(accounting)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"event log of {uri}: {totals.incarnations} incarnation(s)", ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    between_s = totals.elapsed_s - totals.wall_s
    lines += [
        "",
        f"goodput {_percent(totals.goodput)}: {duration(totals.useful_s)} training steps that were kept "
        f"(steps kept x each incarnation's step time) in {duration(totals.wall_s)} of wall time"
        + (f" ({duration(between_s)} more between incarnations, not counted)" if between_s > 0.005 else ""),
        f"lost: {'at least ' if unended else ''}{totals.steps_lost} step(s) trained again after an "
        f"interruption ({duration(totals.lost_s)})",
        f"interruptions: {totals.interruptions}, {totals.unsaved_interruptions} of them without a saved stop"
        + (
            f"; {advice.interruptions_per_hour:.3g} per hour of wall time"
            if advice.interruptions_per_hour is not None
            else ""
        ),
    ]
    if unended:
        lines.append(
            f"+ rank 0 recorded no end of its own (killed without notice, a crashed rank, or still "
            f"running): up to "
            f"{duration(max(r.event_interval_s or 0.0 for r in unended))} of the end is not in the log "
            f"(the interval of the progress record, $SPOTRUN_EVENT_INTERVAL_S): wall time, steps trained "
            f"and steps lost may be more than shown, goodput less"
        )
    lines.append(_advice_text(advice))
    return "\n".join(lines)


def _advice_text(advice) -> str:
    cost = (
        (
            f"save stall C = {duration(advice.save_stall_s)} (mean of the periodic saves; whole save "
            f"{duration(advice.save_duration_s)})"
        )
        if advice.save_stall_s is not None
        else None
    )
    if advice.interval_steps is None:
        return f"checkpoint interval: no suggestion - {advice.reason}" + (f"; measured {cost}" if cost else "")
    current = f"every {advice.current_interval_steps} steps" if advice.current_interval_steps else "no periodic saves"
    return "\n".join(
        [
            f"checkpoint interval (Young/Daly): save every {advice.interval_steps} steps "
            f"(~{duration(advice.interval_s)} of training; now {current})",
            f"  from {cost}, step time {duration(advice.step_time_s)}, mean time between interruptions that "
            f"lost work M = {duration(advice.mtbf_s)} ({advice.unsaved_interruptions}); Young sqrt(2CM) = "
            f"{duration(advice.young_interval_s)}, Daly = {duration(advice.daly_interval_s)}",
            f"  modelled goodput: {_percent(advice.goodput_model_suggested)} at the suggested interval, "
            f"{_percent(advice.goodput_model_current)} at the current one "
            f"(observed {_percent(advice.goodput_observed)})",
        ]
    )

"""``spotrun ls [URI] [--json] [--memory-dir DIR]``: the steps of a checkpoint root, on storage and
in this machine's fast tier, each with its status (:mod:`spotrun.checkpoint.catalog`).

The fast tier's steps are those of the tiers under ``--memory-dir`` whose owner file names this
root (:func:`spotrun.storage.tier_dir.tiers_of`) and whose ``spotrun run`` still runs. A tier whose
owner is gone is stale: it is never resumed from (the next ``spotrun run`` in that directory removes
it), so its steps are not listed; a warning names it. The table gets a ``TIER`` column only when the
fast tier holds steps of the root, so the output of a root without one is as it always was;
``--json`` gives every step a ``"tier"``: ``"memory"`` or ``"storage"``.
"""

from __future__ import annotations

import argparse
import json
import logging

from spotrun.checkpoint.catalog import StepInfo, list_steps
from spotrun.checkpoint.layout import step_dir
from spotrun.cli._shared import URI_HELP, add_storage_options, human_size, location_of
from spotrun.control.env import DEFAULT_CHECKPOINT_URI
from spotrun.errors import SpotrunError
from spotrun.storage.tier_dir import DEFAULT_MEMORY_DIR, tiers_of
from spotrun.storage.tier_peers import job_tier_of

log = logging.getLogger(__name__)

MEMORY = "memory"
STORAGE = "storage"


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``ls`` to ``sub``."""
    ls = sub.add_parser("ls", parents=[common], help="list checkpoints and whether they are complete")
    ls.add_argument("uri", metavar="URI", nargs="?", default=DEFAULT_CHECKPOINT_URI, help=URI_HELP)
    add_storage_options(ls)
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.add_argument(
        "--memory-dir",
        metavar="DIR",
        default=DEFAULT_MEMORY_DIR,
        help="where this machine's fast tiers are, as spotrun run --memory-dir (default %(default)s): the "
        "steps of the root held there by a running spotrun run are listed too, with their tier",
    )
    ls.set_defaults(handler=run, default_log_level="warning")


def run(args: argparse.Namespace) -> int:
    """The handler: print the steps of ``args.uri``; returns the exit code.

    Raises:
        SpotrunError: a bad URI, no such root, or listing storage failed.
    """
    location = location_of(args.uri, args)
    storage = location.open_existing(check_objects=False)
    steps = list_steps(storage)
    if not steps:  # the one listing found no step: is anything stored there at all?
        location.check_objects_exist(storage)
    holders: dict[int, list[str]] = {}  # id(a fast-tier step) -> the nodes holding its files
    rows = sorted(
        [(s, STORAGE) for s in steps] + [(s, MEMORY) for s in memory_steps(location.uri, args.memory_dir, holders)],
        key=lambda row: (row[0].step, row[1] == MEMORY),  # at one step, memory last: a resume tries it first
    )
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **s.to_json(),
                        "meshes": s.manifest.meshes if s.manifest else None,
                        "layout": _layout(s),
                        "tier": tier,
                        **({"holders": holders.get(id(s), [])} if tier == MEMORY else {}),
                    }
                    for s, tier in rows
                ],
                indent=1,
            )
        )
        return 0
    if not rows:
        print(f"no checkpoints under {storage.uri}")
        return 0
    print(table(rows))
    return 0


def memory_steps(root_uri: str, memory_dir: str, holders: dict[int, list[str]] | None = None) -> list[StepInfo]:
    """The steps that live fast tiers under ``memory_dir`` hold of the root ``root_uri`` (one
    spelling: :attr:`spotrun.storage.StorageLocation.uri`); stale tiers are named, not listed. A
    tier of a job on several nodes is listed with the other nodes' (``holders``, filled for each
    step: the nodes holding its files)."""
    live, stale = tiers_of(memory_dir, root_uri)
    for tier in stale:
        log.warning(
            "the fast tier %s of this root is stale (its spotrun run, pid %d, is gone): never resumed from, "
            "not listed; the next spotrun run with --memory-dir %s removes it",
            tier.path,
            tier.pid,
            memory_dir,
        )
    steps = []
    for tier in live:
        try:
            job = job_tier_of(tier.path)
            found = list_steps(job)
            job.close()
        except (SpotrunError, OSError, ValueError, KeyError, TypeError) as exc:  # released while listed
            log.warning("cannot list the fast tier %s: %s", tier.path, exc)
            continue
        for info in found:
            if holders is not None:
                holders[id(info)] = job.step_holders(step_dir(info.step))
        steps += found
    return steps


def table(rows: list[tuple[StepInfo, str]]) -> str:
    """The text table; a ``TIER`` column only when a row is in memory."""
    tiers = any(tier == MEMORY for _, tier in rows)
    lines = [("STEP", *(("TIER",) if tiers else ()), "STATUS", "LAYOUT", "SIZE", "TIME (UTC)", "REASON", "PROBLEM")]
    for s, tier in rows:
        lines.append(
            (
                str(s.step),
                *((tier,) if tiers else ()),
                s.status,
                _layout(s) or "-",
                human_size(s.size_bytes),
                utc_iso(s.created_unix_s),
                s.reason or "-",
                s.problem or "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1] for line in lines)


def _layout(step: StepInfo) -> str | None:
    """A listed step's layout (``"4 ranks, mesh 2x2"``); ``None`` without a readable manifest."""
    from spotrun.checkpoint.rank_layout import describe_layout

    return None if step.manifest is None else describe_layout(step.manifest.world_size, step.manifest.meshes)


def utc_iso(unix_s: float) -> str:
    """Seconds since the epoch as ``2025-11-30T06:04:00Z``."""
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))

"""``spotrun verify URI [--step N | --all] [--json]``: re-read a checkpoint's files and check
them against the manifest (sizes, digests, every tensor's dtype and shape) without loading it.

By default the newest complete step and any newer corrupt one; exit 0 when every step checked
is sound, 1 when anything is wrong (one line per problem), 2 on an error of spotrun itself. A
step deleted while it is read is told from a damaged one. Which steps count as problems:
``docs/design/internals.md`` (CLI and configuration).
"""

from __future__ import annotations

import argparse
import errno
import json

from spotrun.cli._shared import URI_HELP, add_storage_options, location_of
from spotrun.control.env import DEFAULT_CHECKPOINT_URI


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``verify`` to ``sub``."""
    parser = sub.add_parser(
        "verify",
        parents=[common],
        help="check a checkpoint's bytes and tensors against its manifest",
        description="Re-read every file of a step and check its size and digest (the algorithm its "
        "manifest records: blake3-chunks since format 3, sha256 before, and for rank index files) and "
        "that every tensor the manifest lists is in its file with the recorded dtype and shape. "
        "Default: the newest complete step, and any newer committed step that is corrupt. "
        "Exit code 0 if all is well, 1 with one line per problem, "
        "2 on a spotrun error.",
    )
    parser.add_argument("uri", metavar="URI", nargs="?", default=DEFAULT_CHECKPOINT_URI, help=URI_HELP)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, metavar="N", help="check step N")
    which.add_argument(
        "--all", action="store_true", help="check every step (incomplete and fenced ones are listed, not checked)"
    )
    add_storage_options(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON report instead of lines")
    parser.set_defaults(handler=run, default_log_level="warning")


#: By default, how many times the newest complete step is chosen again when the one being
#: verified was deleted meanwhile (a live job with ``--keep-last`` saving faster than it is read).
DEFAULT_MODE_ROUNDS = 3


def run(args: argparse.Namespace) -> int:
    """Verify the chosen steps and print the report; returns the exit code (0 or 1)."""
    from spotrun.checkpoint.verify import steps_to_verify
    from spotrun.errors import ConfigError
    from spotrun.tools.progress import progress_bar

    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step must be >= 0, got {args.step}")
    storage = location_of(args.uri, args).open_existing()
    steps = steps_to_verify(storage, step=args.step, every=args.all)
    reports = []
    with progress_bar(sum(_size(s) for s in steps), "verify") as bar:
        for _round in range(1 if args.all or args.step is not None else DEFAULT_MODE_ROUNDS):
            reports += _verify_each(storage, steps, args, bar)
            if not any(r.deleted for r in reports[-len(steps) :]):
                break
            # by default: the newest complete step was deleted under us (a newer one committed
            # since): check the one a restart would now resume from
            done = {r.step for r in reports}
            steps = [s for s in steps_to_verify(storage) if s.step not in done]
            if not steps:
                break
            bar.total += sum(_size(s) for s in steps)
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"uri": storage.uri, "ok": ok, "steps": [r.to_json() for r in reports]}, indent=1))
    elif not reports:
        print(f"no checkpoints under {storage.uri}")
    elif len(reports) > 1:
        print(_summary(reports))
    return 0 if ok else 1


def _size(info) -> int:
    return info.manifest.size_bytes if info.manifest is not None else 0


def _verify_each(storage, steps, args: argparse.Namespace, bar) -> list:
    """Verify ``steps``, printing each step's lines as it is done (not with ``--json``).

    Raises:
        StepDeletedError: the step named with ``--step`` is deleted, or being deleted: there is
            no such step to give a verdict on (exit 2, as for a step that is absent).
    """
    from spotrun.checkpoint.verify import verify_step
    from spotrun.errors import StepDeletedError

    reports = []
    for info in steps:
        bar.set_description(f"verify step {info.step}")
        report = verify_step(storage, info, explicit=args.step is not None, on_bytes=bar.update)
        if args.step is not None and (report.deleted or info.being_deleted):
            raise StepDeletedError(
                errno.ENOENT,
                f"step {info.step} under {storage.uri} was deleted while verifying it "
                "(the job's retention, --keep-last, or spotrun gc removed it)",
            )
        reports.append(report)
        if not args.json:
            bar.clear()
            _print_step(report)
    return reports


def _print_step(report) -> None:
    from spotrun.cli._shared import human_size

    for problem in report.problems:
        print(problem, flush=True)
    if not report.verified:
        if report.deleted:
            print(f"step {report.step}: {report.note}", flush=True)
        elif report.ok:
            print(f"step {report.step}: {report.status}, not verified ({report.note})", flush=True)
        return
    what = (
        f"{_count(report.files, 'file')}, {human_size(report.size_bytes)}, {_count(report.tensors, 'tensor')}; "
        f"{', '.join(report.algorithms)}"
    )
    verdict = "ok" if report.ok else _count(len(report.problems), "problem")
    print(f"step {report.step}: {verdict} ({what})", flush=True)


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _summary(reports) -> str:
    verified = [r for r in reports if r.verified]
    bad = sum(1 for r in reports if not r.ok)
    skipped = sum(1 for r in reports if not r.verified and r.ok and not r.deleted)
    deleted = sum(1 for r in reports if r.deleted)
    text = f"{len(reports)} steps: {len(verified) - sum(1 for r in verified if not r.ok)} ok, {bad} with problems"
    return (
        text
        + (f", {skipped} not verified (incomplete or fenced)" if skipped else "")
        + (f", {deleted} deleted while verifying (not a problem)" if deleted else "")
    )

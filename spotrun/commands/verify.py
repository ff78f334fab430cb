"""``spotrun verify URI [--step N | --all] [--json]``: re-read a checkpoint's files and check
them against the manifest (sizes, digests, every tensor's dtype and shape) without loading it.

Which steps: by default the newest complete step (the one a restart resumes from) and any newer
step that committed but is corrupt (which a restart skips); ``--step N`` that step; ``--all``
every step directory. Exit code 0 when every step checked is sound, 1 when
anything is wrong (one line per problem: step, file, reason), 2 on an error of spotrun itself
(a bad URI, storage that cannot be read, no such step, by default no committed step at all).

Under ``--all`` an incomplete step (a save that never committed) and a fenced one (an older
incarnation's orphaned commit) are listed as not verified and are no problem: neither was ever
a checkpoint a restart would use. A corrupt step is a problem (a committed checkpoint whose
files are wrong, or one a restore already rejected). A step named with ``--step`` must be a
committed checkpoint: an incomplete or fenced one is a problem there.
"""

from __future__ import annotations

import argparse
import json

from spotrun.commands._shared import URI_HELP, add_storage_options, location_of
from spotrun.env import DEFAULT_CHECKPOINT_URI


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``verify`` to ``sub``."""
    parser = sub.add_parser(
        "verify", parents=[common], help="check a checkpoint's bytes and tensors against its manifest",
        description="Re-read every file of a step and check its size and digest (the algorithm its "
        "manifest records: blake3-chunks since format 3, sha256 before, and for rank index files) and "
        "that every tensor the manifest lists is in its file with the recorded dtype and shape. "
        "Default: the newest complete step, and any newer committed step that is corrupt. Exit code 0 if all is well, 1 with one line per problem, "
        "2 on a spotrun error.",
    )
    parser.add_argument("uri", metavar="URI", nargs="?", default=DEFAULT_CHECKPOINT_URI, help=URI_HELP)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, metavar="N", help="check step N")
    which.add_argument("--all", action="store_true",
                       help="check every step (incomplete and fenced ones are listed, not checked)")
    add_storage_options(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON report instead of lines")
    parser.set_defaults(handler=run, default_log_level="warning")


def run(args: argparse.Namespace) -> int:
    """Verify the chosen steps and print the report; returns the exit code (0 or 1)."""
    from spotrun.checkpoint.verify import steps_to_verify, verify_step
    from spotrun.errors import ConfigError
    from spotrun.progress import progress_bar

    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step must be >= 0, got {args.step}")
    storage = location_of(args.uri, args).open_existing()
    steps = steps_to_verify(storage, step=args.step, every=args.all)
    total_bytes = sum(s.manifest.size_bytes for s in steps if s.manifest is not None)
    reports = []
    with progress_bar(total_bytes, "verify") as bar:
        for info in steps:
            bar.set_description(f"verify step {info.step}")
            report = verify_step(storage, info, explicit=args.step is not None, on_bytes=bar.update)
            reports.append(report)
            if not args.json:
                bar.clear()
                _print_step(report)
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"uri": storage.uri, "ok": ok, "steps": [r.to_json() for r in reports]}, indent=1))
    elif not reports:
        print(f"no checkpoints under {storage.uri}")
    elif len(reports) > 1:
        print(_summary(reports))
    return 0 if ok else 1


def _print_step(report) -> None:
    from spotrun.cli import human_size

    for problem in report.problems:
        print(problem, flush=True)
    if not report.verified:
        if report.ok:
            print(f"step {report.step}: {report.status}, not verified ({report.note})", flush=True)
        return
    what = (f"{_count(report.files, 'file')}, {human_size(report.size_bytes)}, {_count(report.tensors, 'tensor')}; "
            f"{', '.join(report.algorithms)}")
    verdict = "ok" if report.ok else _count(len(report.problems), "problem")
    print(f"step {report.step}: {verdict} ({what})", flush=True)


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _summary(reports) -> str:
    verified = [r for r in reports if r.verified]
    bad = sum(1 for r in reports if not r.ok)
    skipped = sum(1 for r in reports if not r.verified and r.ok)
    text = f"{len(reports)} steps: {len(verified) - sum(1 for r in verified if not r.ok)} ok, {bad} with problems"
    return text + (f", {skipped} not verified (incomplete or fenced)" if skipped else "")

"""``spotrun drill [options] -- LAUNCH_COMMAND...``: the command line of :mod:`spotrun.drill`."""

from __future__ import annotations

import argparse
import itertools
import json

from spotrun.cli._shared import URI_HELP, add_storage_options, launch_command
from spotrun.control.env import DEFAULT_CHECKPOINT_URI
from spotrun.drill.clouds import clouds


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``spotrun drill`` to ``sub``."""
    drill = sub.add_parser(
        "drill",
        parents=[common],
        help="rehearse a preemption on your own job and restart it",
        description="Run LAUNCH_COMMAND under spotrun run, serve a fake preemption notice of the "
        "chosen cloud from a metadata server on 127.0.0.1 (signal: SIGTERM), check that it saves "
        "and exits 143, restart it until its first step is saved, run it once more uninterrupted "
        "to the same step into a scratch checkpoint root, and report whether it went on from the "
        "emergency checkpoint, whether that step is bit-identical to the uninterrupted run's on "
        "every rank, and how long each phase took. Exit code 0 if every check held, 1 if not, 2 on "
        "a spotrun error. The job is left resumable.",
    )
    drill.add_argument(
        "--cloud", choices=tuple(clouds()), default="aws", help="whose notice to rehearse (default %(default)s)"
    )
    trigger = drill.add_mutually_exclusive_group()
    trigger.add_argument(
        "--after-steps",
        type=int,
        default=None,
        metavar="N",
        help="serve the notice once a checkpoint of step >= N is complete",
    )
    trigger.add_argument(
        "--after-s",
        type=float,
        default=None,
        metavar="S",
        help="serve the notice S seconds after the launch (default 60)",
    )
    drill.add_argument("--checkpoint-uri", default=DEFAULT_CHECKPOINT_URI, metavar="URI", help=URI_HELP)
    add_storage_options(drill)
    drill.add_argument(
        "--grace-period-s",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds from the notice to its deadline (default: the cloud's own lead, {_leads()}; "
        "a GCP notice always gets the supervisor's 30 s window)",
    )
    drill.add_argument(
        "--restart-timeout-s",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds the restart may take to start, restore and save its first step (default %(default)s)",
    )
    drill.add_argument(
        "--no-exact-check",
        dest="exact_check",
        action="store_false",
        help="skip the uninterrupted reference run and the bit-for-bit comparison",
    )
    drill.add_argument(
        "--reference-uri",
        default=None,
        metavar="URI",
        help="checkpoint root of the reference run; must hold no objects (default: a "
        "temporary directory for a local root, s3://bucket/prefix-drill-reference/<random> "
        "for s3://bucket/prefix)",
    )
    drill.add_argument(
        "--keep-reference", action="store_true", help="keep the reference run's checkpoints instead of deleting them"
    )
    drill.add_argument("--json", action="store_true", help="print the report as JSON")
    drill.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- LAUNCH_COMMAND...",
        help="the job's launch command, as given to spotrun run",
    )
    drill.set_defaults(handler=_cmd_drill, default_log_level="info")


def _leads() -> str:
    """Each cloud's lead in seconds, clouds of the same lead together: ``aws 120, gcp/azure/signal 30``."""
    by_lead = itertools.groupby(clouds().values(), key=lambda cloud: cloud.lead_s)
    return ", ".join("/".join(cloud.name for cloud in group) + f" {lead:g}" for lead, group in by_lead)


def _cmd_drill(args: argparse.Namespace) -> int:
    from spotrun.drill.config import DrillConfig
    from spotrun.drill.phases import run_drill

    command = launch_command(args)
    report = run_drill(
        DrillConfig(
            command=tuple(command),
            cloud=args.cloud,
            after_steps=args.after_steps,
            after_s=args.after_s,
            checkpoint_uri=args.checkpoint_uri,
            s3_endpoint_url=args.s3_endpoint_url,
            grace_period_s=args.grace_period_s,
            restart_timeout_s=args.restart_timeout_s,
            exact_check=args.exact_check,
            reference_uri=args.reference_uri,
            keep_reference=args.keep_reference,
            log_format=args.effective_log_format,
        )
    )
    print(json.dumps(report.to_json(), indent=1) if args.json else report.summary())
    if report.notice_unix_s is None and report.first_exit_code == 2:
        return 2  # spotrun run refused to start (bad option, unreadable storage, command not found)
    return 0 if report.passed else 1

"""The ``spotrun`` command line: ``run`` and ``preflight`` here, ``ls`` in :mod:`.ls`, ``drill``, ``gc``,
``verify``, ``export`` and ``report`` in a module each (:mod:`.subcommands`); the reference is
generated from these parsers (docs/reference/cli.md).

A :class:`~spotrun.errors.SpotrunError` (a bad option, URI or storage failure) prints one line
``spotrun: error: ...`` (a JSON record with ``--log-format json``) and exits 2. Logging is set
up here only, never at import time (:mod:`spotrun.tools.logs`).

The top room: may import every room but the package's public names; imports no torch.
"""

from __future__ import annotations

import time

#: When spotrun's command line began, in seconds since the epoch: this module is the first the
#: console script (and ``python -m spotrun``) imports after the small ``spotrun`` package. The
#: event log's clock starts here (``spotrun report``'s wall time and start-up), not at the
#: process's start time in ``/proc``: a shell that execs spotrun (``bash -c "pip install ...
#: && exec spotrun run ..."``, a container's ``sh -c`` entrypoint) hands on its pid and with it
#: its start time, install included. Python's own start-up before this (tens of ms) is not counted.
STARTED_UNIX_S = time.time()

import argparse  # noqa: E402 (after the clock above)
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from spotrun.cli._shared import (  # noqa: E402
    add_storage_options,
    human_size,  # noqa: E402,F401 (spotrun.cli.human_size, as before)
    launch_command,
    location_of,
)
from spotrun.cli.ls import add_parser as add_ls_parser  # noqa: E402
from spotrun.cli.ls import utc_iso  # noqa: E402,F401 (spotrun.cli.utc_iso, as before)
from spotrun.cli.subcommands import register_all  # noqa: E402
from spotrun.errors import SpotrunError  # noqa: E402
from spotrun.supervisor.config import add_options  # noqa: E402
from spotrun.tools.logs import configure_logging, log_format_from_env  # noqa: E402

EXIT_USAGE = 2


def _build_parser(run_defaults: dict[str, object] | None = None) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_options(common, every_command=True)
    parser = argparse.ArgumentParser(
        prog="spotrun",
        description="Keep torchrun training alive on spot machines.",
    )
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        parents=[common],
        help="supervise a launch command (usually torchrun)",
        description="Run LAUNCH_COMMAND, resume it from the newest complete checkpoint, turn "
        "preemption notices into emergency checkpoints. The checkpoint storage is checked "
        "first (as spotrun preflight). Exit codes: 0 finished, 143 preempted "
        "and saved, 142 preempted without a new checkpoint, 2 spotrun error, else the "
        "command's own code.",
    )
    add_options(run, every_command=False)
    run.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of defaults for the options above, keys in snake_case "
        "(grace_period_s: 110); options given here override it (see configs/)",
    )
    run.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- LAUNCH_COMMAND...",
        help="the command to supervise, e.g. torchrun --nproc-per-node 8 train.py",
    )
    run.set_defaults(handler=_cmd_run, default_log_level="info")
    if run_defaults:
        run.set_defaults(**run_defaults)

    add_ls_parser(sub, common)

    check = sub.add_parser(
        "preflight",
        parents=[common],
        help="check that the checkpoint storage can be written, read, listed and deleted",
    )
    check.add_argument(
        "uri", metavar="URI", help="checkpoint root: local dir, file://, s3://, gs:// or az://bucket/prefix"
    )
    add_storage_options(check)
    check.set_defaults(handler=_cmd_preflight, default_log_level="warning")
    register_all(sub, common)
    return parser


def _configure_logging(level_name: str, log_format: str) -> None:
    configure_logging(level_name, log_format=log_format, logger="spotrun", prefix="spotrun:")


def _cmd_run(args: argparse.Namespace) -> int:
    from spotrun.supervisor import SupervisorConfig, supervise

    command = launch_command(args)
    config = SupervisorConfig.from_args(args, command, log_format=args.effective_log_format)
    from spotrun.supervisor.event_log import EventLogObserver
    from spotrun.supervisor.metrics_export import metrics_observers
    from spotrun.supervisor.observers import Observers

    observers = Observers(
        [
            EventLogObserver.for_config(config, started_unix_s=STARTED_UNIX_S),
            *metrics_observers(config.metrics_port, config.metrics_address, config.metrics_textfile),
        ]
    )
    return supervise(config, observers)


def _cmd_preflight(args: argparse.Namespace) -> int:
    from spotrun.supervisor.preflight import check_storage

    result = check_storage(location_of(args.uri, args))
    print(
        f"ok: {result.uri} can be written, read, listed and deleted, and commits without "
        f"overwriting ({result.commit_primitive}) ({result.elapsed_s:.2f} s)"
    )
    return 0


def _error_text(exc: SpotrunError) -> str:
    if isinstance(exc, OSError) and exc.strerror:  # storage errors: drop the "[Errno N]" prefix
        return exc.strerror
    return str(exc)


def _report_error(exc: SpotrunError, log_format: str) -> int:
    """Say ``spotrun: error: ...`` (a JSON record in the json format); the exit code."""
    if log_format == "json":
        logging.getLogger("spotrun").error("%s", _error_text(exc), extra={"error": type(exc).__name__})
    else:
        print(f"spotrun: error: {_error_text(exc)}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``spotrun`` console script; returns the exit code."""
    args = _build_parser().parse_args(argv)
    log_format = "text"
    try:
        log_format = args.log_format or log_format_from_env() or log_format
        _configure_logging(args.log_level or args.default_log_level, log_format)
        if getattr(args, "config", None) is not None:
            from spotrun.supervisor.config_file import load_run_config

            args = _build_parser(run_defaults=load_run_config(args.config)).parse_args(argv)
            log_format = args.log_format or log_format  # the command line, else the file, else as before
            _configure_logging(args.log_level or args.default_log_level, log_format)
    except SpotrunError as exc:
        return _report_error(exc, log_format)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    args.effective_log_format = log_format
    try:
        return args.handler(args)
    except SpotrunError as exc:
        return _report_error(exc, log_format)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `spotrun ls | head`: the reader left; say nothing more, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        return 128 + signal.SIGPIPE

"""What several subcommands share: the storage options, the root they name, and the launch
command after ``--``."""

from __future__ import annotations

import argparse

from spotrun.control.env import DEFAULT_CHECKPOINT_URI
from spotrun.errors import ConfigError
from spotrun.storage import StorageLocation, parse_location
from spotrun.supervisor.config import add_option

URI_HELP = f"checkpoint root: local dir, file://, s3://, gs:// or az://bucket/prefix (default {DEFAULT_CHECKPOINT_URI})"


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """``--s3-endpoint-url URL``, as ``spotrun run`` has it."""
    add_option(parser, "s3_endpoint_url")


def location_of(uri: str, args: argparse.Namespace) -> StorageLocation:
    """The root ``uri`` with the storage options of ``args`` (open a root that must exist with
    :meth:`~spotrun.storage.StorageLocation.open_existing`).

    Raises:
        ConfigError: a bad URI or endpoint.
    """
    return parse_location(uri, endpoint_url=args.s3_endpoint_url)


def launch_command(args: argparse.Namespace) -> list[str]:
    """The words after ``--``: the launch command of ``run`` and ``drill``.

    Raises:
        ConfigError: words that are not options of spotrun come before any ``--`` (a command
            given without ``--``, or a misspelt option): the message says where ``--`` goes.
    """
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    argv = args.raw_argv
    given_after_dashes = argv[argv.index("--") + 1 :] if "--" in argv else None
    if command and command != given_after_dashes:
        raise ConfigError(
            f"{command[0]!r} is not an option of spotrun {args.subcommand}: put the launch command after "
            f"'--', as in spotrun {args.subcommand} [options] -- torchrun --nproc-per-node 8 train.py"
        )
    return command


def human_size(size_bytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units; bytes shown exactly below 1 KiB)."""
    if size_bytes < 1024:
        return f"{size_bytes} B"
    value = size_bytes / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"

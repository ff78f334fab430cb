"""What several subcommands share: the storage options, opening a root that must exist, and
the launch command after ``--``."""

from __future__ import annotations

import argparse
import errno
import os

from spotrun.env import DEFAULT_CHECKPOINT_URI
from spotrun.errors import ConfigError
from spotrun.storage import Storage

URI_HELP = f"checkpoint root: local dir, file:// or s3://bucket/prefix (default {DEFAULT_CHECKPOINT_URI})"


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """``--s3-endpoint-url URL``: the S3-compatible endpoint for ``s3://`` URIs."""
    parser.add_argument(
        "--s3-endpoint-url", default=None, metavar="URL",
        help="S3 endpoint for s3:// URIs, e.g. http://minio:9000 (default: the standard AWS "
        "settings such as AWS_ENDPOINT_URL); run passes it on to the workers",
    )


def open_existing_root(uri: str, s3_endpoint_url: str | None, *, check_objects: bool = True) -> Storage:
    """Open the checkpoint root ``uri``, which must exist (like ``ls``: a root that does not
    exist is an error, an empty one is not). An S3 prefix exists when some object is under it:
    that takes a listing, skipped with ``check_objects=False`` by a caller that lists the root
    anyway (call :func:`check_objects_exist` when its listing found nothing).

    Raises:
        ObjectNotFoundError: no such local directory, or nothing stored under the S3 prefix.
        ConfigError: a bad URI or endpoint.
    """
    from spotrun.errors import ObjectNotFoundError
    from spotrun.storage import LocalStorage, open_storage
    from spotrun.supervisor.config import storage_options

    storage = open_storage(uri, **storage_options(uri, s3_endpoint_url=s3_endpoint_url))
    if isinstance(storage, LocalStorage):
        if not os.path.isdir(storage.uri):
            what = "not a directory" if os.path.exists(storage.uri) else "no such directory"
            raise ObjectNotFoundError(errno.ENOENT, f"{what}: {storage.uri}")
    elif check_objects:
        check_objects_exist(storage)
    return storage


def check_objects_exist(storage: Storage) -> None:
    """Raise :class:`~spotrun.errors.ObjectNotFoundError` when nothing is stored under an
    S3 root (one listing); a local root's existence is checked when it is opened."""
    from spotrun.errors import ObjectNotFoundError
    from spotrun.storage import LocalStorage

    if not isinstance(storage, LocalStorage) and not storage.list(""):
        raise ObjectNotFoundError(errno.ENOENT, f"nothing is stored under {storage.uri} (no such prefix)")


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
    given_after_dashes = argv[argv.index("--") + 1:] if "--" in argv else None
    if command and command != given_after_dashes:
        raise ConfigError(
            f"{command[0]!r} is not an option of spotrun {args.subcommand}: put the launch command after "
            f"'--', as in spotrun {args.subcommand} [options] -- torchrun --nproc-per-node 8 train.py"
        )
    return command

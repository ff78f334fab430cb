"""What several subcommands share: the storage options and the root they name."""

from __future__ import annotations

import argparse

from spotrun.env import DEFAULT_CHECKPOINT_URI
from spotrun.storage import StorageLocation, parse_location
from spotrun.supervisor.config import add_option

URI_HELP = f"checkpoint root: local dir, file:// or s3://bucket/prefix (default {DEFAULT_CHECKPOINT_URI})"


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

"""Subcommands of ``spotrun`` besides ``run``, ``ls`` and ``preflight``: ``drill``, and those
that operate on a checkpoint root after the fact (``gc``, ``verify``, ``export``, ``report``).

Each lives in a module of its own with one function ``register(sub, common)`` that adds its
parser to ``sub`` (argparse's subparsers) with ``parents=[common]`` and sets ``handler`` (a
function of the parsed arguments returning the exit code) and ``default_log_level``.
Adding a subcommand is one module plus one name in :data:`MODULES`.
"""

from __future__ import annotations

import argparse
import importlib

#: Modules under ``spotrun.cli`` whose ``register`` :func:`register_all` calls, in help order.
MODULES: tuple[str, ...] = ("drill", "gc", "verify", "export", "report")


def register_all(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add every subcommand of :data:`MODULES` to ``sub``."""
    for name in MODULES:
        importlib.import_module(f"spotrun.cli.{name}").register(sub, common)

"""How an option of ``spotrun run`` is declared: a field of
:class:`~spotrun.supervisor.config.SupervisorConfig` made by :func:`option`, read back as an
:class:`OptionSpec` by :func:`~spotrun.supervisor.config.option_specs` for ``argparse`` and for
the YAML config file (:mod:`spotrun.supervisor.config_file`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OptionSpec:
    """One option, as :func:`~spotrun.supervisor.config.option_specs` reads it from a field.

    Attributes:
        name: the field's name: the YAML key and the ``argparse`` destination.
        kind: ``str``, ``int``, ``float`` or ``bool`` (a flag without a value; ``true``/``false`` in a file).
        default: the default value.
        help: the ``--help`` text.
        metavar: the value's name in ``--help``.
        choices: the allowed values; ``None``: any.
        null_in_file: a YAML ``null`` (or an empty string) means the default.
        every_command: an option of every ``spotrun`` subcommand (on their shared parser).
        list_in_file: a YAML list of strings is accepted and joined with ``,``.
        check_in_file: raises :class:`ConfigError` for a bad string value read from a file.
    """

    name: str
    kind: type
    default: object
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    null_in_file: bool = False
    every_command: bool = False
    list_in_file: bool = False
    check_in_file: Callable[[str], None] | None = None

    @property
    def flag(self) -> str:
        """The command-line flag (``--grace-period-s``)."""
        return "--" + self.name.replace("_", "-")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add this option to ``parser``."""
        if self.kind is bool:
            parser.add_argument(self.flag, action="store_true", default=self.default, help=self.help)
            return
        parser.add_argument(
            self.flag,
            type=None if self.kind is str else self.kind,
            default=self.default,
            choices=self.choices,
            metavar=self.metavar,
            help=self.help,
        )


def option(
    default: object,
    help: str,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    null_in_file: bool | None = None,
    every_command: bool = False,
    list_in_file: bool = False,
    check_in_file: Callable[[str], None] | None = None,
) -> Any:
    """A field of :class:`~spotrun.supervisor.config.SupervisorConfig` that is an option (arguments
    as :class:`OptionSpec`'s; ``null_in_file`` defaults to whether the type admits ``None``)."""
    return field(
        default=default,
        metadata={
            "option": dict(
                help=help,
                metavar=metavar,
                choices=choices,
                null_in_file=null_in_file,
                every_command=every_command,
                list_in_file=list_in_file,
                check_in_file=check_in_file,
            )
        },
    )

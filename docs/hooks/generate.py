"""MkDocs hook: writes the CLI and configuration references from the code, so they cannot drift.

A page holding ``<!-- generated: cli -->`` gets the reference of every ``spotrun`` subcommand,
read from the argparse parsers ``spotrun.cli`` builds; a page holding
``<!-- generated: configuration -->`` gets every option of ``spotrun run`` (its YAML key,
flag, type, default and help), read from the fields of
``spotrun.supervisor.config.SupervisorConfig``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import os
import sys

CLI_MARKER = "<!-- generated: cli -->"
CONFIG_MARKER = "<!-- generated: configuration -->"
CHECKPOINTER_MARKER = "<!-- generated: checkpointer-options -->"
USAGE_WIDTH = 100


def on_config(config):
    # The references describe the checkout being built, not whichever spotrun is installed.
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


def on_page_markdown(markdown, page, config, files):
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, configuration_reference())
    if CHECKPOINTER_MARKER in markdown:
        markdown = markdown.replace(CHECKPOINTER_MARKER, checkpointer_options_reference())
    return markdown


def checkpointer_options_reference() -> str:
    """A table of ``spotrun.Checkpointer``'s settings: each field of ``CheckpointerOptions``
    with its default and the line under it in the code."""
    import dataclasses
    import inspect

    options = importlib.import_module("spotrun.train.options").CheckpointerOptions
    tree = ast.parse(inspect.getsource(options))
    lines = {}
    body = tree.body[0].body
    for field_node, doc_node in zip(body, body[1:]):
        if isinstance(field_node, ast.AnnAssign) and isinstance(doc_node, ast.Expr):
            lines[field_node.target.id] = inspect.cleandoc(doc_node.value.value)
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for field in dataclasses.fields(options):
        rows.append(f"| `{field.name}` | `{field.default!r}` | {lines.get(field.name, '')} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``spotrun`` command line, as ``spotrun.cli.main`` builds it."""
    return importlib.import_module("spotrun.cli")._build_parser()


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, parser)`` of each subcommand of ``parser``, in help order."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def usage(parser: argparse.ArgumentParser) -> str:
    """``parser``'s usage, wrapped at a fixed width: the terminal's would make each build differ."""
    formatter = parser.formatter_class(prog=parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _md(text: str) -> str:
    """Help text as Markdown prose: characters Markdown would read as markup are escaped."""
    for char in ("\\", "`", "*", "[", "]"):
        text = text.replace(char, "\\" + char)
    # Python-Markdown has no backslash escape for angle brackets: entities keep them literal
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _expand_help(action: argparse.Action, prog: str) -> str:
    """``action.help`` with ``%(default)s`` and the like filled in, as ``--help`` prints it."""
    params = {name: value for name, value in vars(action).items() if value is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return (action.help or "") % params


def _option_line(action: argparse.Action, prog: str) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        takes_value = action.nargs != 0
        if takes_value:
            metavar = action.metavar or (
                "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
            )
            names = f"{names} {metavar}"
    else:
        names = action.metavar or action.dest
    line = f"- `{names}`"
    help_text = _expand_help(action, prog)
    default = action.default
    # Most help texts name their default themselves; the others get it here.
    if (
        action.option_strings
        and action.nargs != 0
        and default not in (None, argparse.SUPPRESS)
        and "default" not in help_text
    ):
        line += f" (default `{default}`)"
    return line + (f": {_md(help_text)}" if help_text else "")


def cli_reference() -> str:
    """Markdown: for each subcommand its usage and every argument with its help and default."""
    parser = build_parser()
    links = ", ".join(f"[`{name}`](#spotrun-{name})" for name, _, _ in subcommands(parser))
    out = [f"`spotrun` subcommands: {links}.", ""]
    for name, summary, sub in subcommands(parser):
        out += [f"## spotrun {name}", ""]
        if summary:
            out += [_md(summary[0].upper() + summary[1:]) + ".", ""]
        out += ["```text", usage(sub), "```", ""]
        if sub.description:
            out += [_md(sub.description), ""]
        arguments = [
            a for a in sub._actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        ]
        positionals = [a for a in arguments if not a.option_strings]
        options = [a for a in arguments if a.option_strings]
        if positionals:
            out += ["Arguments:", ""] + [_option_line(a, sub.prog) for a in positionals] + [""]
        if options:
            out += ["Options:", ""] + [_option_line(a, sub.prog) for a in options] + [""]
    return "\n".join(out)


def configuration_reference() -> str:
    """Markdown: every option of ``spotrun run`` as a field of ``SupervisorConfig``."""
    config = importlib.import_module("spotrun.supervisor.config")
    out = []
    for field in dataclasses.fields(config.SupervisorConfig):
        meta = field.metadata.get("option")
        if meta is None:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        help_text = meta["help"] % {"default": default}
        where = "every subcommand" if meta["every_command"] else "`spotrun run`"
        out += [
            f"### `{field.name}`",
            "",
            f"Flag `{flag}` ({where}); type `{field.type}`; default `{default}`"
            + (f"; one of {', '.join(f'`{c}`' for c in meta['choices'])}" if meta["choices"] else "")
            + ("; a YAML list of strings is joined with `,`" if meta["list_in_file"] else "")
            + ".",
            "",
            _md(help_text[0].upper() + help_text[1:]) + ".",
            "",
        ]
    return "\n".join(out)

"""YAML configuration files for ``spotrun run --config FILE``.

A config file holds defaults for the options of ``spotrun run``: its keys are the fields of
:class:`~spotrun.supervisor.config.SupervisorConfig` made with ``option(...)``, each the long
option in snake_case (``--grace-period-s`` becomes ``grace_period_s``). Options given on the
command line win over the file. String values may refer to the environment (``${NAME}``,
``${NAME:-default}``). The rules for types, ``null`` and expansion:
``docs/design/internals.md`` (CLI and configuration).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping

import yaml

from spotrun.errors import ConfigError
from spotrun.supervisor.config import OptionSpec, option_specs

_EXPANSION = re.compile(r"\$\$|\$\{([^}]*)\}|\$\{")
_REFERENCE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def load_run_config(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Read a ``spotrun run`` config file and return its values as option defaults.

    Args:
        path: the YAML file.
        environ: variables for ``${...}`` expansion; default ``os.environ``.

    Returns:
        ``{key: value}`` for the keys present in the file (see the module docstring),
        with numbers as ``float`` (integer options: ``int``), strings expanded, and a
        ``null``/empty optional value as ``None``. Suitable for
        ``argparse.ArgumentParser.set_defaults(**result)``.

    Raises:
        ConfigError: the file is missing or unreadable, is not valid YAML (the message
            gives line and column), its top level is not a mapping, it has an unknown key
            (the message lists the valid keys), a value has the wrong type or is not one
            of the allowed choices, or a ``${NAME}`` refers to an unset variable. Every
            message starts with the file's path.
    """
    env = os.environ if environ is None else environ
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{where}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read config file: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: invalid YAML: {_yaml_error_text(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of option names to values, got {_type_name(data)}")
    specs = {spec.name: spec for spec in option_specs()}
    return {str(key): _convert(where, specs, key, value, env) for key, value in data.items()}


def expand_env(text: str, environ: Mapping[str, str]) -> str:
    """Expand ``${NAME}``, ``${NAME:-default}`` and ``$$`` in ``text`` (see the module docstring).

    Raises:
        ConfigError: ``${NAME}`` names an unset variable, or a ``${`` is malformed
            (no closing brace, or not a variable name); the message says which.
    """

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        inner = match.group(1)
        if inner is None:
            raise ConfigError(f"unterminated '${{' in {text!r}")
        ref = _REFERENCE.fullmatch(inner)
        if ref is None:
            raise ConfigError(f"bad variable reference '${{{inner}}}' in {text!r}")
        name, default = ref.group(1), ref.group(2)
        value = environ.get(name)
        if default is not None:
            return value if value else default
        if value is None:
            raise ConfigError(f"environment variable {name} is not set (referenced as '${{{name}}}')")
        return value

    return _EXPANSION.sub(replace, text)


def _convert(where: str, specs: dict[str, OptionSpec], key: object, value: object, env: Mapping[str, str]) -> object:
    spec = specs.get(key) if isinstance(key, str) else None
    if spec is None:
        hint = difflib.get_close_matches(str(key).replace("-", "_"), specs, n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean}; valid keys: {', '.join(specs)}")
    if value is None and spec.null_in_file:
        return None
    if spec.list_in_file and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # [aws, signal] -> "aws,signal", as on the command line
    expanded = False
    if isinstance(value, str) and "$" in value:
        try:
            value = expand_env(value, env)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
        expanded = True
    if spec.kind is str:
        return _checked_string(where, spec, value)
    if spec.kind is bool:
        if expanded and isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"  # "${RERUN:-false}"
        if not isinstance(value, bool):
            raise _type_error(where, spec, value)
        return value
    if expanded:  # a number from the environment: "${GRACE_S:-25}"
        value = _parse_number(value, spec.kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(where, spec, value)
    if spec.kind is int:
        if not isinstance(value, int):
            raise _type_error(where, spec, value)
        return value
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a finite number, got {value}")
    return float(value)


def _checked_string(where: str, spec: OptionSpec, value: object) -> str | None:
    if not isinstance(value, str):
        raise _type_error(where, spec, value)
    if value == "":
        if spec.null_in_file:
            return None
        raise ConfigError(f"{where}: {spec.name} must not be empty")
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(f"{where}: {spec.name} must be one of {', '.join(spec.choices)}, got {value!r}")
    if spec.check_in_file is not None:
        try:
            spec.check_in_file(value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return value


def _parse_number(text: object, kind: type) -> object:
    """The number in an expanded string, or the string itself if it is none."""
    if not isinstance(text, str):
        return text
    try:
        return kind(text.strip())
    except ValueError:
        return text


def _type_error(where: str, spec: OptionSpec, value: object) -> ConfigError:
    expected = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}[spec.kind]
    return ConfigError(f"{where}: {spec.name} must be {expected}, got {_type_name(value)} {value!r}")


def _type_name(value: object) -> str:
    names = {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "mapping",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _yaml_error_text(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"

"""YAML configuration files for ``spotrun run --config FILE``.

A config file holds defaults for the long options of ``spotrun run``, spelled in
snake_case (``--grace-period-s`` becomes ``grace_period_s``). Options given on the
command line win over the file: the CLI passes the loaded dict to
``parser.set_defaults(**cfg)`` before parsing. Keys, types and units:

=================  ========  ==============================================================
key                type      meaning
=================  ========  ==============================================================
checkpoint_uri     string    checkpoint root: local directory, ``file://`` or ``s3://bucket/prefix``
grace_period_s     number    seconds from a preemption notice to the hard kill of the machine/pod
safety_margin_s    number    seconds kept free before the end of the grace period
stop_timeout_s     number    seconds between SIGTERM and SIGKILL when stopping the command
max_restarts       integer   restarts after a crash without a notice
restart_backoff_s  number    seconds before the first crash restart (doubled each time)
s3_endpoint_url    string    S3 endpoint (MinIO, R2, moto); ``null`` or ``""``: the standard
                             AWS settings (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, AWS)
notice             string    notice sources: ``auto``, ``none`` or a comma-separated list of
                             ``aws``, ``gcp``, ``azure``, ``signal``, ``file`` (a YAML list of
                             names is accepted too); see :mod:`spotrun.notices.detect`
notice_file        string    path watched by the ``file`` notice source (drills); ``null``: none
notice_signals     string    signals that are notices, comma-separated (``TERM,INT,HUP,USR1,USR2``,
                             the default) or ``none``; a YAML list of names is accepted too
keep_last          integer   retention: keep this many newest complete steps (0 or ``null``:
                             every step)
keep_every         integer   retention: also keep every step divisible by this (needs keep_last)
log_level          string    one of :data:`LOG_LEVELS`; ``null``: the subcommand's default
log_format         string    ``text`` or ``json`` (:mod:`spotrun.logs`); ``null``: ``$SPOTRUN_LOG_FORMAT``,
                             else ``text``
metrics_port       integer   serve Prometheus metrics on this port (:mod:`spotrun.supervisor.metrics_export`)
metrics_address    string    the endpoint's address (default ``0.0.0.0``)
metrics_textfile   string    write the metrics to this ``.prom`` file (node_exporter textfile collector)
=================  ========  ==============================================================

Numbers may be written as integers or decimals (``30`` or ``30.5``); they are returned
as ``float``. Range checks (a grace period > 0, ...) happen where the options are used
(:class:`~spotrun.supervisor.config.SupervisorConfig`), for file and command line alike.

Environment variables
    String values may refer to the environment, which is handy in Kubernetes where
    values come from ``env:`` / Secrets:

    - ``${NAME}``: the value of ``NAME``; an error if ``NAME`` is not set.
    - ``${NAME:-default}``: the value of ``NAME``, or ``default`` if ``NAME`` is unset or
      empty (as in the shell). ``default`` is taken literally (no nesting).
    - ``$$``: a literal ``$``. A ``$`` not followed by ``{`` or ``$`` is kept as is.

    A number may come from the environment too: a numeric key accepts a string that
    contains ``${...}`` if the expanded text is a number (``grace_period_s:
    ${GRACE_S:-25}``). A plain quoted string such as ``"25"`` is still a type error.

An empty file (or one with only comments) is an empty configuration.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping

import yaml

from spotrun.errors import ConfigError
from spotrun.logs import LOG_FORMATS

#: Values of ``log_level``.
LOG_LEVELS = ("debug", "info", "warning", "error")

_STR, _FLOAT, _INT = "string", "number", "integer"
#: key -> expected type; the keys are the ``dest`` names of ``spotrun run``'s options.
RUN_KEYS: dict[str, str] = {
    "checkpoint_uri": _STR,
    "grace_period_s": _FLOAT,
    "safety_margin_s": _FLOAT,
    "stop_timeout_s": _FLOAT,
    "max_restarts": _INT,
    "restart_backoff_s": _FLOAT,
    "s3_endpoint_url": _STR,
    "notice": _STR,
    "notice_file": _STR,
    "notice_signals": _STR,
    "aws_metadata_endpoint": _STR,
    "gcp_metadata_host": _STR,
    "azure_metadata_endpoint": _STR,
    "azure_vm_name": _STR,
    "log_level": _STR,
    "log_format": _STR,
    "metrics_port": _INT,
    "metrics_address": _STR,
    "metrics_textfile": _STR,
    "keep_last": _INT,
    "keep_every": _INT,
}
_CHOICES: dict[str, tuple[str, ...]] = {"log_level": LOG_LEVELS, "log_format": LOG_FORMATS}
#: Keys whose "not set" (``null`` or an empty string) means "use the built-in behaviour".
_NULLABLE = frozenset({
    "s3_endpoint_url", "notice_file", "aws_metadata_endpoint", "gcp_metadata_host",
    "azure_metadata_endpoint", "azure_vm_name", "log_level", "log_format", "metrics_port", "metrics_address",
    "metrics_textfile", "keep_last", "keep_every",
})

_EXPANSION = re.compile(r"\$\$|\$\{([^}]*)\}|\$\{")
_REFERENCE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def load_run_config(
    path: str | os.PathLike[str], environ: Mapping[str, str] | None = None
) -> dict[str, object]:
    """Read a ``spotrun run`` config file and return its values as option defaults.

    Args:
        path: the YAML file.
        environ: variables for ``${...}`` expansion; default ``os.environ``.

    Returns:
        ``{key: value}`` for the keys present in the file (see the module docstring),
        with numbers as ``float`` (``max_restarts``: ``int``), strings expanded, and a
        ``null``/empty ``s3_endpoint_url``, ``notice_file`` or ``log_level`` as ``None``. Suitable for
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
        raise ConfigError(
            f"{where}: the top level must be a mapping of option names to values, "
            f"got {_type_name(data)}"
        )
    return {str(key): _convert(where, key, value, env) for key, value in data.items()}


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


def _convert(where: str, key: object, value: object, env: Mapping[str, str]) -> object:
    kind = RUN_KEYS.get(key) if isinstance(key, str) else None
    if kind is None:
        hint = difflib.get_close_matches(str(key).replace("-", "_"), RUN_KEYS, n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"{where}: unknown key {key!r}{did_you_mean}; valid keys: {', '.join(RUN_KEYS)}"
        )
    if value is None and key in _NULLABLE:
        return None
    if key in ("notice", "notice_signals") and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # [aws, signal] -> "aws,signal", as on the command line
    expanded = False
    if isinstance(value, str) and "$" in value:
        try:
            value = expand_env(value, env)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
        expanded = True
    if kind == _STR:
        if not isinstance(value, str):
            raise _type_error(where, key, kind, value)
        if key in _NULLABLE and value == "":
            return None
        if value == "":
            raise ConfigError(f"{where}: {key} must not be empty")
        choices = _CHOICES.get(key)
        if choices is not None and value not in choices:
            raise ConfigError(f"{where}: {key} must be one of {', '.join(choices)}, got {value!r}")
        if key == "notice":
            _check_notice(where, value)
        if key == "notice_signals":
            from spotrun.notices.signals import parse_notice_signals

            try:
                parse_notice_signals(value)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        return value
    if expanded:  # a number from the environment: "${GRACE_S:-25}"
        value = _parse_number(value, kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(where, key, kind, value)
    if kind == _INT:
        if not isinstance(value, int):
            raise _type_error(where, key, kind, value)
        return value
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a finite number, got {value}")
    return float(value)


def _check_notice(where: str, value: str) -> None:
    from spotrun.notices.registry import SOURCE_NAMES, parse_notice_option

    try:
        parse_notice_option(value)
    except ConfigError:
        raise ConfigError(
            f"{where}: notice must be auto, none or a comma-separated list of "
            f"{', '.join(SOURCE_NAMES)}; got {value!r}"
        ) from None


def _parse_number(text: object, kind: str) -> object:
    """The number in an expanded string, or the string itself if it is none."""
    if not isinstance(text, str):
        return text
    try:
        return int(text.strip()) if kind == _INT else float(text.strip())
    except ValueError:
        return text


def _type_error(where: str, key: str, kind: str, value: object) -> ConfigError:
    article = "an" if kind == _INT else "a"
    return ConfigError(f"{where}: {key} must be {article} {kind}, got {_type_name(value)} {value!r}")


def _type_name(value: object) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string",
             list: "list", dict: "mapping", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _yaml_error_text(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"

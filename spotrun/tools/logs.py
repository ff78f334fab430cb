"""Log line formats shared by the ``spotrun`` command and the training workers.

``--log-format text|json`` (or ``$SPOTRUN_LOG_FORMAT``): one human-readable line, or one JSON
object per line for log pipelines. ``spotrun run`` passes its format to the launch command, so
a script that calls :func:`configure_logging` logs like the supervisor. Nothing here runs at
import time. The fields of a JSON line: ``docs/design/internals.md`` (CLI and configuration).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from spotrun.errors import ConfigError

#: The environment variable that carries the log format to the launch command (spotrun run sets it).
LOG_FORMAT = "SPOTRUN_LOG_FORMAT"

#: The values of ``--log-format`` / ``$SPOTRUN_LOG_FORMAT``.
LOG_FORMATS = ("text", "json")
#: The values of ``--log-level``.
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_FORMAT = "text"

# Attributes every LogRecord has: anything else on a record came from ``extra={...}``.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def utc_iso_ms(unix_s: float) -> str:
    """Seconds since the epoch as ``2025-11-30T06:04:00.123Z`` (UTC, milliseconds)."""
    whole = int(unix_s)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((unix_s - whole) * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """Formats each record as one JSON object on one line (see the module docstring).

    Args:
        fields: static fields added to every record (e.g. ``{"rank": 3}``); a record's own
            ``extra`` fields win over them.
    """

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": utc_iso_ms(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self._fields,
        }
        doc.update((k, v) for k, v in vars(record).items() if k not in _STANDARD_ATTRIBUTES and not k.startswith("_"))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``PREFIX 2025-11-30T06:04:00.123Z LEVEL message``: UTC time with milliseconds.

    Args:
        prefix: the words before the time (``"spotrun:"``, ``"[rank 0]"``); ``""``: none.
    """

    def __init__(self, prefix: str = "") -> None:
        lead = f"{prefix} " if prefix else ""
        super().__init__(f"{lead}%(asctime)s.%(msecs)03dZ %(levelname)s %(message)s", datefmt="%Y-%m-%dT%H:%M:%S")
        self.converter = time.gmtime


def log_format_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPOTRUN_LOG_FORMAT`` (``text`` or ``json``), ``None`` when unset or empty.

    Raises:
        ConfigError: it holds anything else.
    """
    value = (os.environ if environ is None else environ).get(LOG_FORMAT, "").strip().lower()
    if not value:
        return None
    if value not in LOG_FORMATS:
        raise ConfigError(f"{LOG_FORMAT}={value!r} is not one of {', '.join(LOG_FORMATS)}")
    return value


def make_formatter(log_format: str, *, prefix: str = "", fields: Mapping[str, Any] | None = None) -> logging.Formatter:
    """The formatter of ``log_format`` (``text``: with ``prefix``; ``json``: with ``fields``).

    Raises:
        ConfigError: an unknown format.
    """
    if log_format == "json":
        return JsonFormatter(fields)
    if log_format == "text":
        return TextFormatter(prefix)
    raise ConfigError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")


def configure_logging(
    level: int | str = logging.INFO,
    *,
    log_format: str | None = None,
    logger: str = "",
    prefix: str = "",
    fields: Mapping[str, Any] | None = None,
    stream: TextIO | None = None,
) -> str:
    """Send ``logger``'s records (default: the root logger, so ``spotrun.*`` too) to ``stream``
    (default ``sys.stderr``) in one format, replacing the handlers it had.

    Args:
        level: the logger's level (``logging.INFO`` or ``"info"``).
        log_format: ``text`` or ``json``; ``None``: ``$SPOTRUN_LOG_FORMAT``, else ``text``.
        logger: name of the logger to configure; a named one stops propagating to the root.
        prefix: words before each text line (``"[rank 0]"``).
        fields: static fields of each JSON line (``{"rank": 0}``).

    Returns:
        The format used.

    Raises:
        ConfigError: an unknown format (given, or in ``$SPOTRUN_LOG_FORMAT``).
    """
    chosen = log_format or log_format_from_env() or DEFAULT_LOG_FORMAT
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(make_formatter(chosen, prefix=prefix, fields=fields))
    target = logging.getLogger(logger or None)
    target.handlers[:] = [handler]
    target.setLevel(level.upper() if isinstance(level, str) else level)
    if logger:
        target.propagate = False
    return chosen

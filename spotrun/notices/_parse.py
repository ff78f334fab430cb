"""Strict parsing of metadata answers; every failure is a :class:`PollProblem`.

Answers come from a network service and may be anything: each helper checks the type it
expects and raises :class:`~spotrun.notices.base.PollProblem` (never ``ValueError`` or
``KeyError``) so that a malformed notice is logged once and ignored.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import math
from typing import Any

from spotrun.notices.base import PollProblem


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """Decode ``body`` as a JSON object.

    Raises:
        PollProblem: key ``"bad JSON <what>"`` when it is not valid UTF-8 JSON or not an object.
    """
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PollProblem(f"bad JSON {what}", f"{what} is not valid JSON: {_short(body)} ({exc})") from exc
    if not isinstance(value, dict):
        raise PollProblem(f"bad JSON {what}", f"{what} is not a JSON object: {_short(body)}")
    return value


def field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``obj[name]`` if it exists and is an instance of ``kind`` (``bool`` never counts as a number).

    Raises:
        PollProblem: key ``"bad <what>.<name>"``: the field is missing or of the wrong type.
    """
    value = obj.get(name)
    if value is None or not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind)):
        raise PollProblem(
            f"bad {what}.{name}", f"{what} field {name!r} is missing or not {_names(kind)}: {value!r:.80}"
        )
    return value


def rfc3339_unix_s(text: str, what: str) -> float:
    """``"2017-09-18T08:22:00Z"`` -> seconds since the epoch (a time without zone is UTC).

    Raises:
        PollProblem: key ``"bad time <what>"``.
    """
    try:
        moment = dt.datetime.fromisoformat(text.strip())
    except (ValueError, TypeError, AttributeError) as exc:
        raise PollProblem(f"bad time {what}", f"{what}: {text!r:.80} is not an RFC 3339 time") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return _finite(moment.timestamp(), text, what)


def rfc1123_unix_s(text: str, what: str) -> float:
    """``"Tue, 09 Aug 2022 17:07:32 GMT"`` -> seconds since the epoch.

    Raises:
        PollProblem: key ``"bad time <what>"``.
    """
    try:
        moment = email.utils.parsedate_to_datetime(text)
    except (ValueError, TypeError, IndexError) as exc:
        raise PollProblem(f"bad time {what}", f"{what}: {text!r:.80} is not an RFC 1123 date") from exc
    if moment is None:
        raise PollProblem(f"bad time {what}", f"{what}: {text!r:.80} is not an RFC 1123 date")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return _finite(moment.timestamp(), text, what)


def _finite(value: float, text: str, what: str) -> float:
    if not math.isfinite(value):
        raise PollProblem(f"bad time {what}", f"{what}: {text!r:.80} is not a usable time")
    return value


def _short(body: bytes) -> str:
    return repr(body[:80]) + ("..." if len(body) > 80 else "")


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _tuple(kind))

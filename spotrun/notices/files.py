"""A drill notice: a notice when a given file appears.

Used for rehearsals (``spotrun drill``) and by operators who want a save-and-stop without a
signal. The file's content is optional; a JSON object may say::

    {"deadline_unix_s": 1767225600.0}   the deadline, in seconds since the epoch
    {"deadline_in_s": 20}               the deadline, seconds after the file is first seen
    {"kind": "rebalance"}               the notice's kind (``rebalance``: ordinary checkpoint)

Anything else in the file (empty, not JSON, fields of the wrong type) still counts as a
notice with the supervisor's configured grace period; the problem is logged once. A file
rewritten with different content is a new notice; the same content again is a repeat.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from spotrun.errors import ConfigError
from spotrun.notices.base import Finding, NoticeSource, PolledSource, PollProblem

if TYPE_CHECKING:
    from spotrun.notices.options import NoticeOptions

DEFAULT_POLL_PERIOD_S = 0.5
#: At most this many bytes of the file are read.
MAX_FILE_BYTES = 64 * 1024


class FileSource(PolledSource):
    """Posts a notice when ``path`` exists.

    Args:
        path: the file to watch (its directory need not exist yet).
        poll_period_s: seconds between two looks.

    Raises:
        ConfigError: an empty path.
    """

    name = "file"

    def __init__(self, path: str, *, poll_period_s: float = DEFAULT_POLL_PERIOD_S):
        super().__init__(poll_period_s=poll_period_s)
        if not path:
            raise ConfigError("the file notice source needs a file path")
        self.path = str(path)

    def describe(self) -> str:
        return f"file ({self.path})"

    def poll_once(self) -> list[Finding]:
        try:
            with open(self.path, "rb") as f:
                body = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise PollProblem("unreadable", f"cannot read {self.path}: {exc.strerror or exc}") from exc
        seen_unix_s = time.time()
        kind, deadline_unix_s = f"notice file {self.path}", None
        if len(body) > MAX_FILE_BYTES:
            self.problems.report("too large", f"{self.path} is longer than {MAX_FILE_BYTES} bytes: content ignored")
            return [Finding(kind=kind, body=body)]
        if not body.strip():
            return [Finding(kind=kind, body=body)]
        try:
            doc = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            self.problems.report("bad content", f"{self.path} is not a JSON object: content ignored")
            return [Finding(kind=kind, body=body)]
        if "kind" in doc:
            if isinstance(doc["kind"], str) and doc["kind"].strip():
                kind = doc["kind"].strip()[:200]
            else:
                self.problems.report("bad kind", f"{self.path}: 'kind' is not a non-empty string: ignored")
        for name, offset_s in (("deadline_unix_s", 0.0), ("deadline_in_s", seen_unix_s)):
            if name not in doc:
                continue
            value = doc[name]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                deadline_unix_s = offset_s + float(value)
            else:
                self.problems.report(f"bad {name}", f"{self.path}: {name!r} is not a number: ignored")
        return [Finding(kind=kind, body=body, deadline_unix_s=deadline_unix_s)]


def configured(options: NoticeOptions) -> bool:
    """Whether ``options`` name a notice file (``auto`` then watches it)."""
    return bool(options.notice_file)


def build(options: NoticeOptions, environ: Mapping[str, str]) -> list[NoticeSource]:
    """The file source of ``options``.

    Raises:
        ConfigError: no notice file is set.
    """
    if not options.notice_file:
        raise ConfigError("--notice file needs a notice file path")
    return [FileSource(options.notice_file, **options.poll_timing(retry=False))]

"""Watch what a child Python process does with sockets, from inside it.

:func:`audited_env` writes a ``sitecustomize.py`` into a directory and returns an environment
that puts it first on ``PYTHONPATH``: every Python process started with that environment
installs an audit hook (:func:`sys.addaudithook`, PEP 578) at start-up, before any spotrun
code runs, and appends one JSON line per socket event (DNS lookups, socket creation,
connect, bind, send) to a log file. :func:`read_audit` reads that log back.

The hook sees every use of Python's ``socket`` module (urllib, http.client, boto3 all go
through it); C code that opens sockets behind Python's back would need strace, which
tests/unit/notices/test_cloud_detection.py also uses where it is available.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

#: The audit events that mean "this process used the network" (or prepared to).
SOCKET_EVENTS = (
    "socket.__new__",
    "socket.bind",
    "socket.connect",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
    "socket.sendmsg",
    "socket.sendto",
)
AUDIT_LOG_ENV = "SPOTRUN_TEST_SOCKET_AUDIT"

_SITECUSTOMIZE = f"""\
import json, os, sys

_path = os.environ.get({AUDIT_LOG_ENV!r})
if _path:
    _fd = os.open(_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _events = frozenset({SOCKET_EVENTS!r})

    def _write(record):
        os.write(_fd, (json.dumps(record) + "\\n").encode())

    def _hook(event, args):
        if event in _events:
            shown = [repr(a) for a in args if not hasattr(a, "fileno")]  # the socket object itself is left out
            _write({{"pid": os.getpid(), "event": event, "args": shown}})

    sys.addaudithook(_hook)
    _write({{"pid": os.getpid(), "event": "hook-installed", "args": []}})
"""


@dataclass(frozen=True)
class AuditEvent:
    """One line of the audit log: process id, event name, ``repr`` of its arguments."""

    pid: int
    event: str
    args: tuple[str, ...]


def audited_env(directory: pathlib.Path, base_env: dict[str, str]) -> tuple[dict[str, str], pathlib.Path]:
    """``base_env`` plus the hook; returns (environment, path of the audit log)."""
    hook_dir = directory / "audit-hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    log_path = directory / "socket-audit.jsonl"
    env = dict(base_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), base_env.get("PYTHONPATH", "")) if p)
    env[AUDIT_LOG_ENV] = str(log_path)
    return env, log_path


def read_audit(log_path: pathlib.Path) -> list[AuditEvent]:
    """Every event logged so far, in order (``hook-installed`` once per process)."""
    if not log_path.exists():
        return []
    return [
        AuditEvent(r["pid"], r["event"], tuple(r["args"])) for r in map(json.loads, log_path.read_text().splitlines())
    ]


def socket_events(events: list[AuditEvent]) -> list[AuditEvent]:
    """The events that touched the network (everything but ``hook-installed``)."""
    return [e for e in events if e.event != "hook-installed"]

"""The workers' report that a rank stopped answering: one of spotrun's collectives timed out
(:class:`~spotrun.errors.CollectiveTimeoutError`).

Any rank that raises it writes ``collective-timeout.json`` into its node's control directory
(:mod:`spotrun.control.files`). A background save's thread writes it as soon as its gather
gave up, while the training thread may be stuck in the job's own collective with the rank that
stopped (which spotrun cannot bound): the supervisor, reading the file about once a second,
names the rank in its log, and stops the command when the process that reported still runs 10 s
later (stuck; one that exited leaves the rest to torchrun). The fields:
``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from spotrun.control.files import read_json, write_json_atomically

COLLECTIVE_TIMEOUT_FILE = "collective-timeout.json"
#: How often the supervisor looks for the report while the command runs, in seconds: a worker
#: facing a deadline writes it this much before it at the latest.
LOOK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class CollectiveTimeoutReport:
    """What a rank that gave up on a collective found.

    Attributes:
        ranks: the ranks that did not arrive (empty: the roll call could not tell).
        what: the collective (``"the write gather of step 40's save"``).
        timeout_s: its bound, seconds.
        message: the error's text.
        rank: the rank that wrote the report.
        reported_unix_s: when it was written.
        pid: the process that wrote it (the supervisor stops the command when it still runs 10 s later).
    """

    ranks: list[int]
    what: str
    timeout_s: float
    message: str
    rank: int
    reported_unix_s: float
    pid: int | None = None

    def describe(self) -> str:
        """The supervisor's line: ``"rank(s) [1] did not arrive at ... within 3 s (reported by rank 0)"``."""
        return f"{self.message} (reported by rank {self.rank})"


def write_collective_timeout_report(
    control_dir: str, *, ranks: list[int], what: str, timeout_s: float, message: str, rank: int
) -> None:
    """Worker side: report that a collective gave up (the newest report wins; all say the same)."""
    report = CollectiveTimeoutReport(list(ranks), what, float(timeout_s), message, rank, time.time(), os.getpid())
    write_json_atomically(os.path.join(control_dir, COLLECTIVE_TIMEOUT_FILE), asdict(report))


def read_collective_timeout_report(control_dir: str) -> CollectiveTimeoutReport | None:
    """Supervisor side: the report, or ``None`` (one ``open``; a file that is not a report counts as none).

    Raises:
        ConfigError: the file exists but is unreadable.
    """
    doc = read_json(os.path.join(control_dir, COLLECTIVE_TIMEOUT_FILE))
    if doc is None or not isinstance(doc.get("ranks"), list) or not isinstance(doc.get("message"), str):
        return None
    return CollectiveTimeoutReport(
        ranks=[r for r in doc["ranks"] if type(r) is int],
        what=str(doc.get("what", "")),
        timeout_s=float(doc.get("timeout_s") or 0.0),
        message=doc["message"],
        rank=doc["rank"] if type(doc.get("rank")) is int else -1,
        reported_unix_s=float(doc.get("reported_unix_s") or 0.0),
        pid=doc["pid"] if type(doc.get("pid")) is int else None,
    )

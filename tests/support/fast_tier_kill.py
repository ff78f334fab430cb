"""Kill one rank of a training job under ``spotrun run`` at a known fast-tier step.

A rank killed while the job runs on leaves the fast tier's newest step to chance (one more save
may commit before the job notices). :func:`kill_rank_0_frozen` freezes every worker first, reads
the tier's newest complete step, then SIGKILLs rank 0, the only rank that commits a step, so that
step stays the newest: the step the restart must resume from.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from spotrun.checkpoint import catalog
from spotrun.storage import LocalStorage
from spotrun.supervisor import process


def worker_rank(pid: int) -> int | None:
    """The ``RANK`` a torchrun worker was started with; ``None`` for another process."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [entry.split(b"=", 1)[1] for entry in environ if entry.startswith(b"RANK=")]
    return int(ranks[0]) if ranks and b"TORCHELASTIC_RUN_ID=" in b"\0".join(environ) else None


def fast_tier_newest(memory_dir: Path) -> int | None:
    """The newest complete step of the one fast tier under ``memory_dir``."""
    [steps_root] = [p / "steps" for p in memory_dir.iterdir() if p.name.startswith("tier-")]
    complete = [s.step for s in catalog.list_steps(LocalStorage(str(steps_root))) if s.status == catalog.COMPLETE]
    return max(complete, default=None)


def kill_rank_0_frozen(supervisor_pid: int, memory_dir: Path) -> int | None:
    """Freeze every worker under ``supervisor_pid``, read the fast tier's newest complete step, SIGKILL
    rank 0 and let the others go on (torchrun then stops them); returns that step."""
    workers = {p.pid: worker_rank(p.pid) for p in process.descendants(supervisor_pid)}
    workers = {pid: rank for pid, rank in workers.items() if rank is not None}
    assert 0 in workers.values(), f"no rank 0 among the workers {workers}"
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        newest = fast_tier_newest(memory_dir)
        os.kill(next(pid for pid, rank in workers.items() if rank == 0), signal.SIGKILL)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return newest

"""Restoring the training state at the start of a job: the newest loadable complete step, then
this start's incarnation.

:func:`restore_state` does it for :meth:`spotrun.train.checkpointer.Checkpointer.restore` and
returns what it restored (:class:`Restored`); the Checkpointer keeps that in one place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from spotrun.checkpoint.claim import claim_incarnation
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.rank_layout import restored_onto
from spotrun.checkpoint.restore import load_newest
from spotrun.control.env import WorkerEnv
from spotrun.storage import Storage
from spotrun.tools import dist
from spotrun.train.apply import apply_loaded, check_serialisable, restore_destinations
from spotrun.train.events import TrainingEvents
from spotrun.train.meter import SaveMeter

log = logging.getLogger("spotrun.checkpointer")  # the Checkpointer's log lines, as they always were


@dataclass(frozen=True)
class Restored:
    """What a restore found and claimed.

    Attributes:
        step: the restored step; 0 when there was nothing to resume.
        manifest: the restored step's manifest; ``None`` when there was nothing to resume.
        run_id: this job's run id from now on (the environment's, else the restored step's).
        incarnation: the incarnation this start claimed on the root.
        bytes_read: bytes this rank read from storage (format-4 steps; 0 before).
        meshes: the device meshes of the state's DTensors, as the restore found them.
        tier: where the step was read: ``"memory"`` (the fast tier) or ``"storage"``; ``None``: nothing restored.
    """

    step: int
    manifest: Manifest | None
    run_id: str
    incarnation: int
    bytes_read: int = 0
    meshes: list[dict[str, Any]] = field(default_factory=list)
    tier: str | None = None
    bytes_received: int = 0
    """Bytes this rank received from the other ranks instead of reading them from storage."""


def restore_state(
    storage: Storage,
    env: WorkerEnv,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    run_id: str,
    meter: SaveMeter,
    events: TrainingEvents,
    fast_tier: Storage | None = None,
) -> Restored:
    """Load the newest loadable complete step into ``state`` and ``rank_state``, then claim this
    start's incarnation (see :meth:`spotrun.train.checkpointer.Checkpointer.restore`).

    ``run_id``: this process's run id, kept when neither the environment nor the step names one.
    ``fast_tier``: the fast tier's root, whose steps of this job are candidates too.
    """
    started_s = time.monotonic()
    events.restore_started()
    meshes: list[dict[str, Any]] = []

    def destinations() -> dict:  # the live tensors a restore reads into
        tensors, meshes[:] = restore_destinations(state, rank_state)
        return tensors

    loaded = load_newest(
        storage,
        supervisor_step=env.resume_step,
        destinations=destinations,
        apply=lambda step: apply_loaded(step, state, rank_state),
        fast_tier=fast_tier,
        run_id=env.run_id,
    )
    manifest = loaded.manifest if loaded is not None else None
    step, bytes_read = (manifest.step, loaded.bytes_read) if manifest is not None else (0, 0)
    tier = loaded.tier if loaded is not None else None
    if tier == "memory" and isinstance(getattr(fast_tier, "read_from", None), set):
        tier = _peer_reads(fast_tier, step)
    if manifest is not None:
        if dist.rank() == 0:
            log.info("%s", restored_onto(step, manifest.world_size, manifest.meshes, dist.world_size(), meshes))
        meter.restored(manifest.timing.step_time_s if manifest.timing is not None else None)
        run_id = env.run_id or manifest.run_id or run_id
        meter.restore_ended(step, time.monotonic() - started_s, bytes_read)
    check_serialisable(state, rank_state)  # refused before this start leaves any trace on the root
    incarnation = claim_incarnation(
        storage,
        resumed_step=step if manifest else None,
        run_id=run_id,
        at_least=max(env.incarnation, manifest.incarnation + 1 if manifest else 0),
        worker_env=env,
    )
    events.started(incarnation, step if manifest else None, bytes_read, tier)
    if dist.rank() == 0:
        log.info(
            "%s (incarnation %d)",
            f"restored step {step} from {fast_tier.uri if tier in ('memory', 'peer') else storage.uri}"
            + (" (the fast tier, in memory)" if tier == "memory" else "")
            + (" (the fast tier, parts from other nodes' memory)" if tier == "peer" else "")
            if manifest
            else f"no checkpoint under {storage.uri}: starting from step 0",
            incarnation,
        )
    received = loaded.bytes_received if loaded is not None else 0
    return Restored(step, manifest, run_id, incarnation, bytes_read, list(meshes), tier, received)


def _peer_reads(fast_tier: Any, step: int) -> str:
    """``"peer"`` when any rank read part of the restored step from another node's tier (said per
    rank, with the bytes and the nodes), else ``"memory"`` (collective)."""
    reads = dist.all_gather_json({"nodes": sorted(fast_tier.read_from), "bytes": fast_tier.peer_bytes_read})
    if not any(r["nodes"] for r in reads):
        return "memory"
    if dist.rank() == 0:
        for rank, r in enumerate(reads):
            if r["nodes"]:
                log.info(
                    "rank %d read %d bytes of step %d from the fast tier of node(s) %s",
                    rank,
                    r["bytes"],
                    step,
                    ", ".join(r["nodes"]),
                )
    return "peer"

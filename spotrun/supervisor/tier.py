"""The supervisor's fast tier: made at start in host memory, after removing those of killed runs
(:mod:`spotrun.storage.tier_dir`); the workers save into it (:mod:`spotrun.train.fast_tier`)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from spotrun.checkpoint import catalog
from spotrun.errors import SpotrunError
from spotrun.storage import LocalStorage, Storage
from spotrun.storage.tier_dir import (
    MEMORY_FILESYSTEMS,
    TierOwner,
    create_tier,
    filesystem_type,
    release_tier,
    remove_stale_tiers,
)
from spotrun.supervisor.config import SupervisorConfig
from spotrun.supervisor.launch import newest_in_fast_tier
from spotrun.supervisor.tier_replicas import TierService, start_tier_service
from spotrun.supervisor.torchrun_command import TorchrunLaunch

log = logging.getLogger("spotrun.supervisor.run")  # said where the other start lines are


def open_fast_tier(
    config: SupervisorConfig, launch: TorchrunLaunch | None, stack: contextlib.ExitStack
) -> tuple[TierOwner | None, TierService | None]:
    """This run's fast tier (``--memory-interval-steps``), after removing those of killed runs, and its
    server to the job's other nodes, both closed with ``stack``; ``(None, None)`` when it is off or
    cannot be made (said: the job runs with storage only)."""
    tier = _make_tier(config, stack)
    return tier, start_tier_service(config, tier, launch, stack)


def _make_tier(config: SupervisorConfig, stack: contextlib.ExitStack) -> TierOwner | None:
    if not config.memory_interval_steps:
        return None
    remove_stale_tiers(config.memory_dir)
    try:
        tier = create_tier(config.memory_dir, config.location.uri)  # as the workers get it: one spelling
    except OSError as exc:
        log.error("cannot make the fast tier under %s (%s): running with storage only", config.memory_dir, exc)
        return None
    stack.callback(release_tier, tier)
    kind = filesystem_type(tier.path)
    if kind is not None and kind not in MEMORY_FILESYSTEMS:
        log.warning(
            "the fast tier %s is on a %s file system, not in memory (tmpfs): its saves go to that disk", tier.path, kind
        )
    log.info("fast tier: %s, every %d steps", tier.path, config.memory_interval_steps)
    return tier


def fast_tier_launch(
    config: SupervisorConfig, tier: TierOwner | None, service: TierService | None = None
) -> dict[str, Any]:
    """The fast tier's arguments of :func:`~spotrun.supervisor.launch.plan_launch` (with ``service``:
    how the workers reach the other nodes, and the supervisor's view of every node's tier)."""
    if tier is None:
        return {}
    env = config.fast_tier_env(tier.steps_root)
    if service is not None:
        env.update(service.env())
    view = service.view() if service is not None else LocalStorage(tier.steps_root)
    return {"fast_tier": view, "fast_tier_env": env}


def lost(tier: TierOwner | None, storage: Storage) -> str:
    """What a stop without a save loses of the fast tier, for the log line: its newest step when it
    is newer than storage's (the tier is removed at exit), else nothing."""
    if tier is None:
        return ""
    try:
        in_memory = newest_in_fast_tier(LocalStorage(tier.steps_root), storage, None)
        on_storage = catalog.newest_complete(storage)
    except (OSError, SpotrunError):
        return ""
    if in_memory is None or (on_storage is not None and on_storage.step >= in_memory.step):
        return ""
    newest = on_storage.step if on_storage is not None else "none"
    return f"; the fast tier's step {in_memory.step} (storage's newest: {newest}) is lost with the tier"

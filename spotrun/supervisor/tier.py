"""The supervisor's fast tier: made at start in host memory, after removing those of killed runs
(:mod:`spotrun.storage.tier_dir`); the workers save into it (:mod:`spotrun.train.fast_tier`)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from spotrun.storage import LocalStorage
from spotrun.storage.tier_dir import TierOwner, create_tier, release_tier, remove_stale_tiers
from spotrun.supervisor.config import SupervisorConfig

log = logging.getLogger("spotrun.supervisor.run")  # said where the other start lines are


def open_fast_tier(config: SupervisorConfig, stack: contextlib.ExitStack) -> TierOwner | None:
    """This run's fast tier (``--memory-interval-steps``), after removing those of killed runs, removed
    when ``stack`` closes; ``None`` when it is off or cannot be made (said: the job runs with storage only)."""
    if not config.memory_interval_steps:
        return None
    remove_stale_tiers(config.memory_dir)
    try:
        tier = create_tier(config.memory_dir, config.location.uri)  # as the workers get it: one spelling
    except OSError as exc:
        log.error("cannot make the fast tier under %s (%s): running with storage only", config.memory_dir, exc)
        return None
    stack.callback(release_tier, tier)
    log.info("fast tier: %s, every %d steps", tier.path, config.memory_interval_steps)
    return tier


def fast_tier_launch(config: SupervisorConfig, tier: TierOwner | None) -> dict[str, Any]:
    """The fast tier's arguments of :func:`~spotrun.supervisor.launch.plan_launch`."""
    if tier is None:
        return {}
    return {"fast_tier": LocalStorage(tier.steps_root), "fast_tier_env": config.fast_tier_env(tier.steps_root)}

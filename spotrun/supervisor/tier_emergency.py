"""Where an emergency checkpoint goes after a notice, and a notice too short for storage.

The supervisor that got the notice asks for the save to storage when it fits before the deadline
(:mod:`spotrun.supervisor.estimate`); when it does not, but a save into the fast tier and its copy
to another node do, it asks for that instead, waits (bounded by the deadline) until the copy is
there, and exits 143. A supervisor whose workers stopped for another node's notice holds that
copy: it writes the step to storage (verified first, committed last) before it exits, so the step
outlives both nodes' memory. The figures and the rules: ``docs/guide/fast-tier.md``.
"""

from __future__ import annotations

import logging
import time

from spotrun.checkpoint import catalog, fencing
from spotrun.checkpoint.layout import file_key
from spotrun.checkpoint.manifest import Manifest
from spotrun.control import files as control
from spotrun.errors import ObjectExistsError, SpotrunError
from spotrun.storage import Storage
from spotrun.storage.base import ByteSource
from spotrun.supervisor.estimate import SaveEstimate, amount, decide, estimate_emergency_save
from spotrun.supervisor.observers import Observers
from spotrun.supervisor.tier_replicas import TierService

log = logging.getLogger("spotrun.supervisor.run")  # the supervisor's own log lines

STORAGE, MEMORY = "storage", "memory"
#: Seconds allowed beyond a fast-tier save's recorded write time for its commit.
MEMORY_COMMIT_ALLOWANCE_S = 0.5
#: Bytes per read of a step drained from the fast tier to storage.
DRAIN_CHUNK_BYTES = 8 << 20
#: Seconds between two looks at whether every part of a step to drain has reached this node's view.
DRAIN_POLL_S = 0.5


def decide_emergency(
    control_dir: str,
    resumed: Manifest | None,
    ranks_now: int | None,
    deadline_unix_s: float,
    observers: Observers,
    service: TierService | None,
) -> str | None:
    """Where the emergency checkpoint goes: :data:`STORAGE`, :data:`MEMORY` (the fast tier, copied to
    another node) or ``None`` (no save fits: the workers stop without one); logged and recorded."""
    try:
        stats = control.read_save_stats(control_dir)
    except SpotrunError as exc:
        log.warning("%s: estimating without this launch's measurements", exc)
        stats = None
    now_s = time.time()
    left_s = deadline_unix_s - now_s
    estimate = estimate_emergency_save(stats, resumed, now_s, ranks_now=ranks_now)
    if estimate is None:
        message = (
            f"emergency checkpoint requested: no save measured yet to estimate it from; "
            f"the save is bounded by the deadline ({left_s:.1f} s left)"
        )
        route: str | None = STORAGE
    else:
        decision = decide(estimate, left_s)
        route, message = (STORAGE if decision.save else None), decision.message
        memory = None if decision.save else _memory_route(service, estimate, left_s)
        if memory is not None:
            route, message = MEMORY, memory
    log.warning("%s", message)
    observers.emit("decision", save=route is not None, tier=route, message=message)
    return route


def _memory_route(service: TierService | None, estimate: SaveEstimate, left_s: float) -> str | None:
    """The log line when the emergency step fits into the fast tier and its copy to another node
    before the deadline, else ``None``; timed like the newest fast-tier step of this node."""
    if service is None:
        return None
    targets = service.target_nodes()
    newest = _newest_tier_step(service.own_steps)
    if not targets or newest is None:
        return None
    manifest, own_bytes = newest
    save_s = manifest.timing.write_s + MEMORY_COMMIT_ALLOWANCE_S
    rate = service.copy_rate_bytes_s()
    copy_s = own_bytes / rate
    # a synchronous save in progress ends first; a background one is abandoned at the boundary
    first_s = 0.0 if estimate.in_flight_background else estimate.in_flight_s
    total_s = first_s + estimate.boundary_s + save_s + copy_s
    if total_s > left_s:
        return None
    return (
        f"emergency checkpoint to the fast tier, copied to node(s) {', '.join(targets)}: a save to storage "
        f"would take {estimate.total_s:.1f} s, more than the {left_s:.1f} s left; the fast tier takes "
        f"{total_s:.1f} s ({first_s + estimate.boundary_s:.1f} s to the next step boundary, {save_s:.1f} s to "
        f"save as step {manifest.step} did, {copy_s:.1f} s to copy this node's {amount(own_bytes)} at "
        f"{amount(rate)}/s); a node that stays writes it to storage"
    )


def _newest_tier_step(own: Storage) -> tuple[Manifest, int] | None:
    """The newest fast-tier step with a manifest that records its timing, and this node's bytes of it."""
    try:
        by_step = catalog.objects_by_step(own.list(""))
        for step in sorted(by_step, reverse=True):
            info = catalog.inspect_step(own, step)
            if info is not None and info.manifest is not None and info.manifest.timing is not None:
                own_bytes = sum(i.size_bytes for i in by_step[step] if i.key != info.manifest_key)
                return info.manifest, own_bytes
    except (SpotrunError, OSError) as exc:
        log.warning("cannot read the fast tier's newest step (%s): no emergency checkpoint to it", exc)
    return None


def settle_memory_step(
    service: TierService | None, storage: Storage, step: int, *, deadline_unix_s: float | None, wait_s: float
) -> bool:
    """After the workers committed ``step`` to the fast tier as the emergency checkpoint: on the
    node that got the notice (``deadline_unix_s``), wait until another node holds its copy; on a
    node that stays, write the step to storage (waiting up to ``wait_s`` seconds for the other
    nodes' copies). Whether the step is safe (logged either way)."""
    if service is None:
        log.error("the workers committed step %d to the fast tier, but it is not served to other nodes", step)
        return False
    if deadline_unix_s is not None:
        held = service.wait_replicated(step, deadline_unix_s - time.time())
        staying = service.staying(held) if held else set()
        if held and not staying:
            log.error(
                "the emergency checkpoint of step %d is held only by node(s) %s, which are being preempted too: "
                "it is lost with them",
                step,
                ", ".join(sorted(held)),
            )
            return False
        if held:
            held = staying
            log.info(
                "the emergency checkpoint of step %d is held by node(s) %s, which write it to storage",
                step,
                ", ".join(sorted(held)),
            )
            return True
        log.error("the emergency checkpoint of step %d reached no other node before the deadline: it is lost", step)
        return False
    view = service.view()
    try:
        return drain_to_storage(view, storage, step, wait_s=wait_s)
    finally:
        view.close()  # it holds connections to the other nodes


def drain_to_storage(tier: Storage, storage: Storage, step: int, *, wait_s: float) -> bool:
    """Copy ``step`` from the job's fast tier (``tier``: every node's) to ``storage``: once it is whole
    there (waiting up to ``wait_s`` seconds) and verified, its files, then its manifest as the commit
    (first writer wins). Whether storage holds it complete."""
    # imported here: it checks tensors with torch, which the supervisor loads only when it drains a step
    from spotrun.checkpoint.verify import verify_step

    started = time.monotonic()
    try:
        info = catalog.inspect_step(tier, step)
        while info is None or info.status != catalog.COMPLETE:
            if time.monotonic() - started >= wait_s:
                why = info.problem if info is not None else "no file of it"
                log.error(
                    "the fast tier's step %d is not whole after %.0f s (%s): not written to storage", step, wait_s, why
                )
                return False
            time.sleep(DRAIN_POLL_S)
            info = catalog.inspect_step(tier, step)
        report = verify_step(tier, info)
        if not report.ok:
            log.error(
                "the fast tier's step %d failed verification, not written to storage: %s", step, report.problems[0]
            )
            return False
        assert info.manifest is not None and info.manifest_key is not None
        if _complete_on(storage, step):
            return True
        # the files the manifest names, at the keys it names them by (the one mapping of layout.file_key)
        files = [(file_key(step, r, info.manifest), r.size_bytes) for r in info.manifest.files]
        for key, size_bytes in files:
            storage.put_stream(key, _TierFile(tier, key, size_bytes), chunk_bytes=DRAIN_CHUNK_BYTES)
        fencing.check_not_fenced(storage, info.manifest.incarnation)
        try:
            storage.put_if_absent(info.manifest_key, tier.get(info.manifest_key))
        except ObjectExistsError:
            pass  # another node that stays committed it first
    except (SpotrunError, OSError) as exc:
        log.error("writing the fast tier's step %d to storage failed: %s", step, exc)
        return False
    done = _complete_on(storage, step)
    log.log(
        logging.INFO if done else logging.ERROR,
        "the fast tier's step %d %s on storage (%d files, %s, %.1f s)",
        step,
        "is complete" if done else "is NOT complete",
        len(files) + 1,
        amount(sum(size_bytes for _key, size_bytes in files)),
        time.monotonic() - started,
    )
    return done


def _complete_on(storage: Storage, step: int) -> bool:
    info = catalog.inspect_step(storage, step)
    return info is not None and info.status == catalog.COMPLETE


class _TierFile(ByteSource):
    """One file of the fast tier, read in ranges as storage writes it."""

    def __init__(self, tier: Storage, key: str, size_bytes: int) -> None:
        self._tier, self._key, self._size_bytes = tier, key, size_bytes

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    def readinto(self, offset: int, out: memoryview) -> None:
        self._tier.read_into(self._key, offset, [out])

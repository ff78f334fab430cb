"""The fast tier: every few steps, the whole state saved into host memory on this node, in the
checkpoint format of storage (a tmpfs root written by the local backend), so that a restart
after a worker or torchrun crash resumes from a step a few steps old without reading storage.

:class:`FastTier` runs its saves as :class:`~spotrun.train.saving.Saves` of their own (staged,
then written on a background thread with its own process group, a save in flight skips the next
rather than stalling training), keeps the tier to its newest complete step and the one before
it, fences it with the job's incarnation, and checks once that two steps fit. Any failure of the
tier is logged and turns the tier off: training goes on with storage alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from spotrun.checkpoint import catalog, fencing
from spotrun.checkpoint.claim import claim_incarnation
from spotrun.checkpoint.layout import parse_manifest_name
from spotrun.checkpoint.retention import delete_step
from spotrun.checkpoint.save import prepare_save
from spotrun.control.env import WorkerEnv
from spotrun.errors import CheckpointSaveError, SpotrunError
from spotrun.storage import LocalStorage, Storage
from spotrun.storage.tier_dir import free_bytes
from spotrun.storage.tier_holdings import NodeHoldings
from spotrun.storage.tier_peers import JobTier
from spotrun.tools import dist
from spotrun.train.identity import Identity
from spotrun.train.meter import SaveMeter
from spotrun.train.options import CheckpointerOptions
from spotrun.train.saving import Saves
from spotrun.train.tier_nodes import JobNodes, forget_peers, job_nodes, multi_node, write_peers_file

log = logging.getLogger("spotrun.checkpointer")

#: The reason recorded in a fast-tier step's manifest.
MEMORY_REASON = "memory"
#: The tier's name where a step's tier is said (``spotrun ls``, the event log's records).
MEMORY_TIER = "memory"
#: Complete steps the tier keeps after a commit (the newest and the one before it).
KEPT_STEPS = 2
#: What the budget check adds to a rank's tensor bytes for its files: a shard and an index per
#: rank (the manifest counted with them), each rounded up to pages, and per chunk its entries in
#: the shard's header, the index and the manifest. Generous: a refused tier costs nothing, a tier
#: that runs out of room mid-save costs a failed save.
FILE_OVERHEAD_BYTES = 64 * 1024
FILES_PER_RANK = 3
ENTRY_OVERHEAD_BYTES = 2048
#: An emergency step goes into the tier too when the tier's saves take at most this share of the
#: time left before the deadline (a tier save is a copy into memory: it should take far less).
STOPPING_SAVE_SHARE = 0.5


def tier_settings(options: CheckpointerOptions, env: WorkerEnv) -> tuple[str | None, int]:
    """(the tier's root, its interval in steps) from the options, else the environment; (None, 0): no tier."""
    interval = options.memory_interval_steps
    if interval is None:
        interval = env.memory_interval_steps or 0
    root = options.memory_dir or env.memory_dir
    return (root, interval) if root and interval > 0 else (None, 0)


def open_fast_tier(
    options: CheckpointerOptions,
    env: WorkerEnv,
    identity: Identity,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    on_save_ended: Callable[..., None] | None = None,
) -> FastTier | None:
    """The Checkpointer's fast tier when one is set (options, else ``spotrun run``'s environment);
    ``None`` without one. On several nodes (collective) the tier is the job's: each node's
    ranks write into their node's tier, and reads and listings reach the other nodes' through
    their supervisors (:class:`~spotrun.storage.tier_peers.JobTier`); without ``spotrun run``'s
    tier servers it is off (said). ``on_save_ended``: told of every fast-tier save that ended, as
    :class:`~spotrun.train.meter.SaveMeter`'s (the event log's ``save`` records, with ``tier``
    ``"memory"``)."""
    root, interval = tier_settings(options, env)
    job = None
    if multi_node():  # every rank gathers, with a tier or without: one that stayed away would hang the rest
        job = job_nodes(env, wanted=root is not None, interval_steps=interval)
        if job is None:
            return None
    elif _supervised(root, env) and _holds_replicas(root):
        # the job spanned several nodes and goes on with this one: the replicas it holds of the nodes
        # that left complete their steps (a 2-node step restored onto 1 node), and its pruning frees them
        job = job_nodes(env, wanted=True, interval_steps=interval)
    if root is None:
        return None
    budget = options.memory_budget_bytes if options.memory_budget_bytes is not None else env.memory_budget_bytes
    return FastTier(root, interval, budget, options, env, identity, state, rank_state, on_save_ended, job=job)


def _supervised(root: str | None, env: WorkerEnv) -> bool:
    """Whether ``root`` is the fast tier of ``spotrun run``'s tier server on this node."""
    return root is not None and bool(env.memory_node) and root == env.memory_dir


def _holds_replicas(root: str) -> bool:
    """Whether this node's tier holds other nodes' replicas, as local rank 0 saw it (collective on
    this node's ranks alone; they share the tier): every rank then takes the same path."""
    held = bool(NodeHoldings(os.path.dirname(os.path.abspath(root))).replica_nodes()) if dist.rank() == 0 else None
    return bool(dist.broadcast_json(held))


class FastTier:
    """The fast tier of one Checkpointer.

    Args:
        root: the tier's checkpoint root (a directory in host memory).
        interval_steps: save every this many steps.
        budget_bytes: most bytes the tier may hold on this node; ``None``: its free space.
        options, env, identity, state, rank_state: the Checkpointer's.
        on_save_ended: called with the figures of every fast-tier save that ended (as
            :class:`~spotrun.train.meter.SaveMeter`'s).
        job: the job's nodes when it spans several (:func:`job_nodes`).
    """

    def __init__(
        self,
        root: str,
        interval_steps: int,
        budget_bytes: int | None,
        options: CheckpointerOptions,
        env: WorkerEnv,
        identity: Identity,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        on_save_ended: Callable[..., None] | None = None,
        *,
        job: JobNodes | None = None,
    ) -> None:
        self.job = job
        self.storage: Storage = LocalStorage(root)
        if job is not None:
            tier_path = os.path.dirname(os.path.abspath(root))
            peers = [p for p in job.nodes if p.node != job.own]
            self.storage = JobTier(tier_path, peers, job.own, job.timeout_s)
            if dist.local_rank() == 0:
                write_peers_file(tier_path, job)
            if dist.rank() == 0:
                log.info("fast tier on %d nodes, each step also held by %d other node(s)", len(job.nodes), job.replicas)
        elif _supervised(root, env) and dist.local_rank() == 0:
            forget_peers(os.path.dirname(os.path.abspath(root)))
        self._root = root
        self.interval_steps = interval_steps
        self.budget_bytes = budget_bytes
        self.enabled = True
        self._identity = identity
        self._checked = False
        self._fenced_incarnation: int | None = None
        self._restored_step: int | None = None  # recorded with the tier's claim
        # its own saves: never published to the supervisor's save statistics (they time storage saves)
        tier_options = replace(
            options,
            keep_last=None,
            keep_every=None,
            background_saves=True,
            on_save_in_flight="skip",
            max_failed_periodic_saves=0,
        )
        meter = SaveMeter(None, publishes=False, check_interval_steps=1, on_save_ended=on_save_ended)
        self._meter = meter
        self.saves = Saves(
            tier_options,
            replace(env, keep_last=None, keep_every=None),
            self.storage,
            meter,
            identity,
            state,
            rank_state,
            name="fast-tier save",
        )

    @property
    def running(self) -> bool:
        """Whether this rank still writes a fast-tier save."""
        return self.enabled and self.saves.saver.running

    def due(self, step: int) -> bool:
        """Whether a fast-tier save is due at ``step``."""
        return self.enabled and step % self.interval_steps == 0

    def report_ended(self) -> None:
        """Act on the fast-tier save that ended on every rank (a failure turns the tier off)."""
        ended = self.saves.saver.take()
        self._guarded(lambda: self.saves.report(ended))

    def save(self, step: int, still_running: bool | None) -> None:
        """Start the fast-tier save of ``step`` (collective; skipped while the previous one is in flight)."""
        self._guarded(lambda: self._save(step, still_running))

    def save_stopping(self, step: int, left_s: float) -> None:
        """The job stops after the emergency save of ``step`` to storage: write it into the tier too
        (collective) when that costs about a copy, i.e. the tier's saves take at most
        :data:`STOPPING_SAVE_SHARE` of the ``left_s`` seconds left; a restart by this supervisor
        then reads it from memory."""
        self._guarded(lambda: self._save_stopping(step, left_s))

    def save_emergency(self, step: int, left_s: float) -> bool:
        """The emergency checkpoint of ``step`` in the tier (collective), a save to storage not fitting
        before the deadline: the supervisors copy it to another node. Whether it committed."""
        self._guarded(lambda: self._save_emergency(step, left_s))
        return self.enabled and self.saves.last_saved_step == step

    def restored(self, step: int) -> None:
        """A restore loaded ``step`` (from either tier): the tier's saves skip it."""
        self.saves.saved(step)
        self._restored_step = step

    def abandon(self) -> None:
        """The job stops: stop writing the save in flight (nothing half-written is ever read)."""
        self.saves.saver.abort()

    def close(self) -> None:
        """Wait for the save in flight to end and stop the tier's thread (failures only logged)."""
        try:
            self.report_ended()
        finally:
            self.saves.saver.shutdown()
            if isinstance(self.storage, JobTier):
                self.storage.close()

    def _save(self, step: int, still_running: bool | None) -> None:
        if not self._checked:
            self._checked = True
            if dist.rank() == 0:  # what an earlier start left (a half-written step) is not counted against it
                self._make_room()
            if not self._fits(step):
                return
        if self._fenced_incarnation is None or self._fenced_incarnation != self._identity.incarnation:
            self._claim(step)
        # the older step goes on the save's thread, before any rank writes: deleting a step's
        # files frees its pages, which took longer than the staging copy on the training thread
        self.saves.due(step, MEMORY_REASON, still_running, before_write=self._make_room if dist.rank() == 0 else None)

    def _save_stopping(self, step: int, left_s: float) -> None:
        self.report_ended()  # the save abandoned for the emergency one: ended before the tier is pruned
        estimate_s = self._meter.full_save_s()  # None before a tier save committed: cost unknown
        fits = self._checked and estimate_s is not None and estimate_s <= STOPPING_SAVE_SHARE * left_s
        if dist.any_rank(not fits):
            if dist.rank() == 0:
                log.info(
                    "the emergency step %d is not written to the fast tier: %s",
                    step,
                    "no fast-tier save has committed yet"
                    if estimate_s is None or not self._checked
                    else f"a fast-tier save takes {estimate_s:.2f} s and {max(left_s, 0.0):.2f} s are left",
                )
            return
        if self._fenced_incarnation != self._identity.incarnation:
            self._claim(step)
        if dist.rank() == 0:
            self._make_room()
        self.saves.save_now(step, MEMORY_REASON, timeout_s=left_s)

    def _save_emergency(self, step: int, left_s: float) -> None:
        self.report_ended()  # the save in flight was abandoned for this one: ended before the tier is pruned
        if self._fenced_incarnation != self._identity.incarnation:
            self._claim(step)
        if dist.rank() == 0:
            self._make_room()
        self.saves.save_now(step, "emergency", timeout_s=left_s)

    def _claim(self, step: int) -> None:
        """Record this start's incarnation in the tier (collective), so that an older start of the job
        can never commit into it; a save without a restore first claims it on storage."""
        replicated, rank_local = self.saves._state_dicts()
        self._identity.save_context(step, MEMORY_REASON, replicated, rank_local, None)
        incarnation = self._identity.incarnation
        newest: dict = {}
        if dist.rank() == 0:  # read once, told to every rank, so that all of them act alike
            try:
                newest = {"newest": fencing.read_fences(self.storage).newest}
            except (SpotrunError, OSError) as exc:
                newest = {"error": f"{type(exc).__name__}: {exc}"}
        newest = dist.broadcast_json(newest)
        if "error" in newest:
            raise CheckpointSaveError(f"cannot read the fast tier's incarnations: {newest['error']}")
        if newest["newest"] is not None and newest["newest"] > incarnation:
            # an older start never claims here: a claim would fence the newer start's steps
            raise CheckpointSaveError(
                f"the fast tier {self.storage.uri} belongs to incarnation {newest['newest']}, newer than this "
                f"start's ({incarnation})",
                retryable=False,
            )
        if newest["newest"] != incarnation:
            claim_incarnation(
                self.storage, resumed_step=self._restored_step, at_least=incarnation, run_id=self._identity.run_id
            )
        self._fenced_incarnation = incarnation

    def _fits(self, step: int) -> bool:
        """Whether two steps of this node's ranks fit the budget and the tier's free space (collective:
        every rank agrees); if not, say so with the sizes and turn the tier off."""
        replicated, rank_local = self.saves._state_dicts()
        prepared = prepare_save(step, replicated, rank_local)
        own_bytes = sum(t.numel() * t.element_size() for t in prepared.tensors.values())
        # the files hold more than the tensors: headers, the rank's index, the manifest, and
        # each file fills whole pages of the tmpfs
        own_bytes += FILE_OVERHEAD_BYTES * FILES_PER_RANK + ENTRY_OVERHEAD_BYTES * len(prepared.tensors)
        rank_bytes = dist.all_gather_json(own_bytes)
        step_bytes = sum(rank_bytes)
        kept = KEPT_STEPS
        if self.job is None:
            need = kept * step_bytes
        else:  # a node holds its ranks' files and the replicas of the nodes before it
            per_node: dict[str, int] = {}
            for node, size in zip(self.job.node_of_rank, rank_bytes):
                per_node[node] = per_node.get(node, 0) + size
            # one more step while the newest one's replicas copy (steps_to_keep)
            kept = KEPT_STEPS + (1 if self.job.replicas else 0)
            need = kept * self.job.copies * max(per_node.values())
        free = None
        if dist.local_rank() == 0:
            try:
                free = free_bytes(self._root)
            except OSError as exc:  # said; the budget alone then decides
                log.warning("cannot read the free space of the fast tier %s: %s", self._root, exc)
        frees = [f for f in dist.all_gather_json(free) if f is not None]
        # on one node the ranks share the tier; across nodes the fullest node decides
        free = (max(frees) if self.job is None else min(frees)) if frees else None
        room = free if self.budget_bytes is None else min(self.budget_bytes, free or self.budget_bytes)
        if room is not None and need > room:
            if dist.rank() == 0:
                log.error(
                    "the fast tier does not fit: %d steps of this node's ranks%s take %s, but %s allows %s "
                    "(budget %s, free in %s: %s); running with storage only",
                    kept,
                    f" and of the {self.job.replicas} node(s) it holds replicas of"
                    if self.job and self.job.replicas
                    else "",
                    _size(need),
                    "the budget" if self.budget_bytes is not None and room == self.budget_bytes else "memory",
                    _size(room),
                    "none" if self.budget_bytes is None else _size(self.budget_bytes),
                    self.storage.uri,
                    "?" if free is None else _size(free),
                )
            self.enabled = False
            return False
        if dist.rank() == 0:
            log.info(
                "fast tier in %s: every %d steps, %s per step (budget %s)",
                self.storage.uri,
                self.interval_steps,
                _size(step_bytes),
                _size(room or need),
            )
        return True

    def _make_room(self) -> None:
        """Before a save writes (rank 0, none in flight): keep only the newest complete step, so that
        the tier never holds more than two steps' bytes; the save then makes two again. One listing,
        no manifest parsed."""
        try:
            by_step = catalog.objects_by_step(self.storage.list(""))
            spread = isinstance(self.storage, JobTier) and self.job is not None
            keep = steps_to_keep(by_step, self.storage.holders if spread else None, self.job.copies if spread else 1)
            for step in by_step:
                if step not in keep:
                    delete_step(
                        self.storage, step, why=f"fast tier: keeps {sorted(keep)} and the next", objects=by_step[step]
                    )
        except (SpotrunError, OSError) as exc:  # this rank alone: the tier stays on, the save may then not fit
            log.warning("the fast tier could not delete its older steps: %s", exc)

    def _guarded(self, action) -> None:
        """Run ``action``; a failure (raised alike on every rank by the collective save) turns the tier off."""
        if not self.enabled:
            return
        try:
            action()
        except (SpotrunError, OSError) as exc:
            self.enabled = False
            log.error("the fast tier failed (%s: %s); running with storage only", type(exc).__name__, exc)
            if dist.rank() == 0:  # its memory goes back to training: keep only the newest complete step
                self._make_room()


def steps_to_keep(by_step: dict[int, list], holders: Callable[[str], int] | None, copies: int) -> set[int]:
    """Of the tier's steps (step -> its objects), those a save keeps: the newest complete one (a
    manifest is there) and, on several nodes (``holders(key)``: how many nodes hold it), the newest
    complete one whose every object is held on ``copies`` nodes, since the replicas of the newest
    may still be copying when a node is lost."""
    complete = [
        step
        for step, objects in by_step.items()
        if any(parse_manifest_name(o.key.partition("/")[2])[0] for o in objects)
    ]
    keep = {max(complete)} if complete else set()
    if holders is not None:
        held = [step for step in complete if all(holders(o.key) >= copies for o in by_step[step])]
        keep |= {max(held)} if held else set()
    return keep


def _is_manifest(key: str) -> bool:
    return parse_manifest_name(key.partition("/")[2])[0]


def _size(size_bytes: int) -> str:
    """``1000`` -> ``"1000 B"``, ``1536`` -> ``"1.5 KiB"``: a small budget is shown as given, not as 0.0 MiB."""
    if size_bytes < 1024:
        return f"{size_bytes} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes} B"

"""Background saves: one worker thread writes and commits a staged step while training goes on.

The training thread prepares a step (:func:`~spotrun.checkpoint.save.prepare_save` into
reused :class:`~spotrun.checkpoint.staging.StagingBuffers`) and hands it to
:meth:`BackgroundSaver.start`; the worker thread runs
:func:`~spotrun.checkpoint.save.commit_save` on a process group of its own
(:func:`spotrun.tools.dist.new_background_group`), so its collectives never interleave with the
training thread's, under the storage deadline of the save (deadlines are per thread). At
most one save is in flight. Its outcome (a :class:`~spotrun.checkpoint.save.SavedStep` or
the exception) stays in the :class:`InFlightSave` until the training thread takes it
(:meth:`BackgroundSaver.take`); what to do with it - and when, the same step on every rank -
is the :class:`~spotrun.train.checkpointer.Checkpointer`'s decision.
"""

from __future__ import annotations

import functools
import logging
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from spotrun.checkpoint import in_flight
from spotrun.checkpoint.save import PreparedSave, SaveContext, SavedStep, SaveProgress, commit_save, prepare_save
from spotrun.checkpoint.save_bounds import before_deadline_s, collectives_deadline_s, phase_timeout_s
from spotrun.checkpoint.shard import ShardLimits
from spotrun.checkpoint.staging import StagingBuffers
from spotrun.errors import CollectiveTimeoutError
from spotrun.storage.base import Storage
from spotrun.tools import dist, process_local

log = logging.getLogger(__name__)
in_flight_log = logging.getLogger(in_flight.__name__)  # the decision's log line, under the rule's name


class SaveObserver(Protocol):
    """What the saver reports each save to (the training library's save meter): the engine
    defines the interface so that it never imports the training library."""

    def save_started(self, step: int, reason: str, *, background: bool = False) -> float: ...

    def stall_ended(self) -> None: ...

    def progress(self, step: int, bytes_done: int, bytes_total: int, remaining_s: float | None) -> None: ...

    def save_ended(
        self, step: int, reason: str, started_s: float, size_bytes: int | None, *, stall_s: float | None = None
    ) -> float: ...


@dataclass
class InFlightSave:
    """One background save, from its start to the moment the training thread took its outcome.

    Attributes:
        step: the step being saved.
        reason: ``periodic`` or ``requested``.
        started_s: when the save started in the training thread (``time.monotonic()``),
            before the staging copy.
        stall_s: seconds training was blocked by it (the staging copy, and any wait for the
            save before it).
        progress: bytes this rank wrote so far (:class:`~spotrun.checkpoint.shard_write.SaveProgress`).
        abort: set to abandon the save (on every rank): it then commits nothing
            (:class:`~spotrun.errors.SaveAbortedError`), unless rank 0 had already committed.
        done: set by the worker thread once ``saved`` or ``error`` is final.
        saved: the outcome when it committed.
        error: the exception when it did not.
        ended_s: when it ended (``time.monotonic()``).
    """

    step: int
    reason: str
    started_s: float
    stall_s: float
    progress: SaveProgress = field(default_factory=SaveProgress)
    abort: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    saved: SavedStep | None = None
    error: BaseException | None = None
    ended_s: float | None = None

    @property
    def committed(self) -> bool:
        """Whether it ended with its step committed."""
        return self.done.is_set() and self.error is None


@dataclass
class _Job:
    save: InFlightSave
    storage: Storage
    prepared: PreparedSave
    context: SaveContext
    limits: ShardLimits | None
    timeout_s: float
    before_write: Callable[[], None] | None = None


class BackgroundSaver:
    """Owns the worker thread and the process group of background saves; at most one in flight.

    Args:
        meter: measures each save (the time training was blocked and the whole save) and
            publishes the progress of the one in flight for the supervisor.
        after_commit: called ``(step, reason)`` on the worker thread after a save committed,
            once its outcome is final (retention): a next save waits in the queue meanwhile,
            training does not. What it raises is logged.
        on_collective_timeout: called on the worker thread as soon as a save's collective gave up
            (:class:`~spotrun.errors.CollectiveTimeoutError`), before the training thread hears of
            it: that thread may be stuck in the job's own collective with the rank that stopped
            (under ``spotrun run``, the report to the supervisor). What it raises is logged.
    """

    def __init__(
        self,
        meter: SaveObserver | None = None,
        after_commit: Callable[[int, str], None] | None = None,
        on_collective_timeout: Callable[[CollectiveTimeoutError], None] | None = None,
    ) -> None:
        self._meter = meter
        self._after_commit = after_commit
        self._on_collective_timeout = on_collective_timeout
        self._staging = StagingBuffers()  # allocated at the first save, then reused
        self._group: Any = None
        self._group_made = False
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._current: InFlightSave | None = None
        # A job that never called close(); never in a forked child (spotrun.tools.process_local).
        process_local.at_exit(_finish_at_exit, weakref.ref(self), before_thread_pools=True)

    @property
    def in_flight(self) -> InFlightSave | None:
        """The save started and not yet taken (:meth:`take`), finished or not. The same on
        every rank when every rank starts and takes saves at the same steps."""
        return self._current

    @property
    def running(self) -> bool:
        """Whether a save is still being written or committed on this rank."""
        return self._current is not None and not self._current.done.is_set()

    def start(
        self,
        storage: Storage,
        step: int,
        replicated: dict[str, Any],
        rank_local: dict[str, Any],
        context: Callable[[], SaveContext],
        limits: ShardLimits | None,
        *,
        timeout_s: float,
        reason: str,
        waited_s: float = 0.0,
        before_write: Callable[[], None] | None = None,
    ) -> InFlightSave:
        """Stage this rank's part of ``step`` into the reused buffers, then write and commit it
        in the background (collective on every rank: the first call makes the process group,
        which every rank must do at the same point). Returns once the staging copies are
        complete: training may then change the live tensors.

        Args:
            storage, limits: as for :func:`~spotrun.checkpoint.save.commit_save`.
            replicated, rank_local: the state dicts (``state_dict()`` values), as for
                :func:`~spotrun.checkpoint.save.prepare_save`.
            context: returns the save's context once the state is staged (it may claim the
                incarnation; called in this thread, under the storage deadline).
            timeout_s: bound of the save's storage operations, seconds.
            reason: ``periodic`` or ``requested``.
            waited_s: seconds training already waited for the save before (part of the stall).
            before_write: called on the worker thread, under the save's deadline, before this
                rank joins the save's first collective (the fast tier deletes its older step there,
                off the training thread; the other ranks write nothing before that collective).
                What it raises is logged, never raised: one rank failing alone would strand the rest.

        Raises:
            RuntimeError: a save is already in flight (take its outcome first).
            Whatever ``context`` raises (nothing is started then).
        """
        if self._current is not None:
            raise RuntimeError(f"the save of step {self._current.step} is still in flight")
        started_s = time.monotonic() if self._meter is None else self._meter.save_started(step, reason, background=True)
        try:
            prepared = prepare_save(step, replicated, rank_local, staging=self._staging)
            with storage.deadline(timeout_s):
                save_context = context()
            if not self._group_made:
                self._group = dist.new_background_group(timeout_s=timeout_s, what=f"the {reason} save of step {step}")
                self._group_made = True
        except BaseException:
            if self._meter is not None:
                self._meter.save_ended(step, reason, started_s, None)
            raise
        save = InFlightSave(
            step=step, reason=reason, started_s=started_s, stall_s=waited_s + time.monotonic() - started_s
        )
        if self._meter is not None:
            self._meter.stall_ended()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spotrun-background-save", daemon=True)
            self._thread.start()
        self._current = save
        self._jobs.put(_Job(save, storage, prepared, save_context, limits, timeout_s, before_write))
        return save

    def publish_progress(self) -> None:
        """Publish the progress of the save in flight, if it is still running (about once a
        second at most: see :meth:`SaveObserver.progress`)."""
        current = self._current
        if self._meter is not None and current is not None and not current.done.is_set():
            progress = current.progress
            self._meter.progress(
                step=current.step,
                bytes_done=progress.bytes_done,
                bytes_total=progress.bytes_total,
                remaining_s=progress.remaining_s(),
            )

    def wait_reporting(self, why: str) -> float:
        """Block until the save in flight ended on this rank, publishing its progress
        meanwhile; rank 0 logs how long it waited (``why``: what waited). Returns the seconds."""
        current = self._current
        if current is None:
            return 0.0
        started_s = time.monotonic()
        while not current.done.wait(1.0):  # wake to publish its progress for the supervisor
            self.publish_progress()
        waited_s = time.monotonic() - started_s
        if dist.rank() == 0:
            log.log(
                logging.WARNING if waited_s >= 1.0 else logging.INFO,
                "%s waited %.2f s for the background save of step %d still in flight",
                why,
                waited_s,
                current.step,
            )
        return waited_s

    def abort(self) -> None:
        """Ask the save in flight to stop at its next chunk and commit nothing (call on every rank)."""
        if self._current is not None:
            self._current.abort.set()

    def take(self) -> InFlightSave | None:
        """Wait for the save in flight to end, and hand over its outcome (``None`` if none):
        afterwards no save is in flight."""
        current = self._current
        if current is None:
            return None
        current.done.wait()
        self._current = None
        return current

    def shutdown(self) -> None:
        """Stop the worker thread and free the process group, the staging buffers and their
        copy threads (after :meth:`take`; a later :meth:`start` makes them again). Nothing of
        a background save outlives :meth:`~spotrun.train.checkpointer.Checkpointer.close`: a gloo
        group or thread left to the interpreter's exit can abort the process there."""
        if self._current is not None:
            raise RuntimeError(f"the save of step {self._current.step} is still in flight")
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        if self._group is not None:
            self._group.destroy()
        self._group, self._group_made = None, False
        self._staging.release()

    def _run(self) -> None:
        # Python runs signal handlers in the main thread whichever thread the kernel picks;
        # keep SIGCHLD for the main thread, whose emergency save blocks it (a dying loader
        # worker must not interrupt that save through this thread).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        while True:
            job = self._jobs.get()
            if job is None:  # shutdown()
                return
            save = job.save
            try:
                until_s = collectives_deadline_s(job.timeout_s)
                with job.storage.deadline(job.timeout_s):  # thread-local: entered on this thread
                    if job.before_write is not None:
                        _call_logged(job.before_write, save.step)
                    save.saved = commit_save(
                        job.storage,
                        job.prepared,
                        job.context,
                        job.limits,
                        group=self._group,
                        abort=save.abort,
                        progress=save.progress,
                        collective_deadline_s=until_s,
                    )
            except BaseException as exc:  # handed to the training thread
                save.error = exc
                report = self._on_collective_timeout
                if isinstance(exc, CollectiveTimeoutError) and report is not None:
                    _call_logged(functools.partial(report, exc), save.step, "reporting the failure of")
            finally:
                save.ended_s = time.monotonic()
                job = None  # the staged tensors are the caller's again
                try:
                    self._ended(save)
                except Exception:  # a measurement or a log line must not lose the outcome
                    log.exception("after the background save of step %d", save.step)
                save.done.set()
            if save.committed and self._after_commit is not None:
                try:
                    self._after_commit(save.step, save.reason)
                except Exception:  # noqa: BLE001 - retention never fails a save or training
                    log.exception("after the commit of step %d", save.step)

    def _ended(self, save: InFlightSave) -> None:
        """On the worker thread, as a save ends: measure it, log its commit (rank 0)."""
        saved = save.saved
        if self._meter is not None:
            self._meter.save_ended(
                save.step,
                save.reason,
                save.started_s,
                None if saved is None else saved.size_bytes,
                stall_s=save.stall_s,
            )
        if saved is not None and saved.manifest is not None:
            log.info(
                "committed step %d (%s, in the background): %d files, %.1f MiB in %.2f s, training blocked %.2f s",
                save.step,
                save.reason,
                len(saved.manifest.files),
                saved.size_bytes / 2**20,
                (save.ended_s or 0.0) - save.started_s,
                save.stall_s,
            )


def _call_logged(action: Callable[[], None], step: int, when: str = "before writing") -> None:
    try:
        action()
    except Exception:  # noqa: BLE001 - this rank alone: raising would leave the other ranks waiting for it
        log.exception("%s the background save of step %d", when, step)


def settle(
    saver: BackgroundSaver, *, step: int, left_s: float, full_save_s: float | None, may_save: bool
) -> tuple[in_flight.Choice, InFlightSave | None]:
    """Decide on rank 0, from every rank's progress, what happens to the save in flight; do it
    on every rank (abandon it or not, then wait for it to end); log the decision when a save
    was still being written (rule: :mod:`spotrun.checkpoint.in_flight`).

    Collective on the training thread's group (one gather, one broadcast): every rank calls
    it at the same step, a save in flight or not. Both give up early enough to name the
    ranks that did not arrive before ``left_s`` passes (:class:`~spotrun.errors.CollectiveTimeoutError`).

    Args:
        saver: holds the save in flight.
        step: the current step (the one an emergency save would save).
        left_s: seconds left before the deadline.
        full_save_s: seconds a full save takes, as measured by this launch (rank 0's figure
            is used); ``None`` when nothing was measured.
        may_save: whether the current step may be saved (False: stopping without a save).

    Returns:
        The choice (the same on every rank) and the save that was in flight on this rank,
        ended (its outcome not yet acted on; none is in flight afterwards), or ``None``.
    """
    current = saver.in_flight
    running = saver.running
    mine = {
        "step": None if current is None else current.step,
        "running": running,
        "remaining_s": current.progress.remaining_s() if running else 0.0,
        "elapsed_s": 0.0 if current is None else time.monotonic() - current.started_s,
    }
    until_s = time.monotonic() + before_deadline_s(left_s)
    what = f"the decision on the save in flight at step {step}"
    everyone = dist.all_gather_json(mine, timeout_s=phase_timeout_s(until_s), what=what)
    decision = None
    if dist.rank() == 0:
        decision = in_flight.decide(everyone, step, left_s, full_save_s, may_save)
    decision = dist.broadcast_json(decision, timeout_s=phase_timeout_s(until_s), what=what)
    choice = in_flight.Choice(decision["choice"])
    if choice.abandons:
        saver.abort()  # before the log line: whoever reads the log sees it already set
    if dist.rank() == 0 and decision["why"]:
        in_flight_log.warning("%s", decision["why"])
    return choice, saver.take()


def _finish_at_exit(saver_ref: weakref.ref) -> None:
    """At interpreter exit, for a job that never called ``Checkpointer.close()``: let the save
    in flight finish (its storage deadline bounds the wait; on several ranks every rank waits
    likewise), then free the thread and the process group."""
    saver = saver_ref()
    if saver is None:
        return
    current = saver._current
    try:
        if current is not None and not current.done.is_set():
            log.warning(
                "the process is exiting with the background save of step %d still being written: "
                "waiting for it (call Checkpointer.close() before exiting)",
                current.step,
            )
            current.done.wait()
        if current is not None and current.error is not None:
            log.error("the background save of step %d failed: %s", current.step, current.error)
        saver._current = None  # the process is ending: nobody else takes the outcome
        saver.shutdown()
    except Exception:  # noqa: BLE001 - never fail the exit
        log.exception("shutting down the background saver at exit")

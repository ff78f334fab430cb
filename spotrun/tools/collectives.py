"""spotrun's own process groups, whose every collective is bounded and names the ranks that
did not arrive.

spotrun never runs its collectives on the job's default group: that group's timeout is the
job's (torch's default: 30 min on gloo, 10 min on NCCL) and an NCCL collective would sync the
device. It makes gloo groups over all ranks instead (CPU only): one for the training thread
(:func:`training_group`, made at its first collective), one per background saver, and one per
step a cooperative restore tries (its point-to-point transfers, :meth:`BoundedGroup.transfer`).
Each collective has its own bound; when it passes, the ranks hold a roll call on the job's store
(:mod:`spotrun.tools.rollcall`) and raise :class:`~spotrun.errors.CollectiveTimeoutError`
naming the ranks that did not check in. A group that failed once is never used again: a
later collective on it raises the same error at once. The bounds of each path and their
order: ``docs/reference/timeouts.md``.

Every group spotrun made and did not free is freed at the interpreter's exit (:func:`_free_at_exit`):
gloo's worker thread drops a finished collective's tensors after the caller saw it done, taking the
GIL to do so, and a thread that takes the GIL while Python finalizes aborts the process
("terminate called without an active exception"). Freeing a group joins its threads first.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from spotrun.errors import CollectiveTimeoutError
from spotrun.tools import rollcall

T = TypeVar("T")

#: The roll calls' keys, under the group's own store prefix.
ROLLCALL_PREFIX = "spotrun-rollcall"


def _seconds(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _second(started_s: float, timeout_s: float) -> float:
    """The start counted for a collective's second operation (every rank arrived at the first):
    the collective's own start, but at least a roll call's window before the bound passes."""
    return max(started_s, time.monotonic() + rollcall.window_s(timeout_s) - timeout_s)


class Pending(Generic[T]):
    """A collective started and not yet waited for: :meth:`wait` returns its result, or raises
    :class:`~spotrun.errors.CollectiveTimeoutError` once its bound (counted from its start) passed."""

    def __init__(
        self, group: BoundedGroup, work: Any, sequence: int, what: str, timeout_s: float, result: Callable[[], T]
    ):
        self._group, self._work, self._sequence = group, work, sequence
        self._what, self._timeout_s, self._result = what, timeout_s, result
        self._started_s = time.monotonic()
        self._done = threading.Event()
        work.get_future().add_done_callback(lambda _future: self._done.set())

    def wait(self) -> T:
        """The collective's result; blocks at most until its bound and the roll call's window."""
        try:
            self._group._finish(self._work, self._done, self._sequence, self._what, self._timeout_s, self._started_s)
        finally:
            self._group._in_flight -= 1
        return self._result()


class BoundedGroup:
    """A gloo process group over all ranks whose collectives are bounded (see the module docstring).

    Collectives of one group must be issued in the same order on every rank, from one thread.
    """

    def __init__(self, group: Any, name: str, epoch: str) -> None:
        self.group = group
        self.name = name
        self._epoch = epoch  # unique on the job's store: a torchrun restart reuses group names
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._sequence = 0
        self._in_flight = 0  # collectives started and not yet waited for (the exit frees idle groups only)
        self._pid = os.getpid()  # a forked child has none of gloo's threads: its exit frees nothing
        self.broken: CollectiveTimeoutError | None = None
        _groups.live.append(self)

    def all_gather_bytes(self, data: bytes, *, timeout_s: float, what: str) -> list[bytes]:
        """Every rank's ``data``, by rank."""
        sequence, started_s = self._next(what), time.monotonic()
        sizes = self._gather_sizes(len(data), sequence, what, timeout_s)
        longest = max(sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self._world_size)]
        work = self.group.allgather(gathered, mine, timeout=self._gloo_timeout(timeout_s))
        self._wait(work, sequence, what, timeout_s, _second(started_s, timeout_s))
        return [bytes(t[:size].numpy()) for t, size in zip(gathered, sizes)]

    def broadcast_bytes(self, data: bytes | None, src: int, *, timeout_s: float, what: str) -> bytes:
        """Rank ``src``'s ``data`` on every rank (the others pass ``None``)."""
        sequence, started_s = self._next(what), time.monotonic()
        # The sizes travel as an all-gather: no rank gets past it before every rank arrived,
        # which a broadcast does not promise its root.
        size = self._gather_sizes(
            len(data) if self._rank == src and data is not None else 0, sequence, what, timeout_s
        )[src]
        buffer = torch.empty(size, dtype=torch.uint8)
        if self._rank == src and size:
            buffer.copy_(torch.frombuffer(bytearray(data or b""), dtype=torch.uint8))
        work = self.group.broadcast(buffer, src, timeout=self._gloo_timeout(timeout_s))
        self._wait(work, sequence, what, timeout_s, _second(started_s, timeout_s))
        return bytes(buffer.numpy())

    def start_all_reduce_max(self, values: list[int], *, timeout_s: float, what: str) -> Pending[list[int]]:
        """Start the element-wise maximum over the ranks of ``values``; wait for it with
        :meth:`Pending.wait` (now, or steps later: the bound counts from now)."""
        sequence = self._next(what)
        tensor = torch.tensor(values, dtype=torch.int64)
        work = self.group.allreduce([tensor], op=dist.ReduceOp.MAX, timeout=self._gloo_timeout(timeout_s))
        self._in_flight += 1
        return Pending(self, work, sequence, what, timeout_s, tensor.tolist)

    def begin_transfers(self, what: str) -> int:
        """Start a phase of point-to-point :meth:`transfer` calls (every rank at the same point,
        as for a collective, though each rank transfers with its own peers): the phase's number,
        under which the ranks whose transfer gave up hold their roll call."""
        return self._next(what)

    def transfer(
        self,
        sends: list[tuple[int, int, torch.Tensor]],
        recvs: list[tuple[int, int, torch.Tensor]],
        *,
        phase: int,
        timeout_s: float,
        what: str,
    ) -> None:
        """Send each ``(peer, tag, tensor)`` of ``sends`` and receive each of ``recvs`` (contiguous
        CPU tensors), all at once; returns when every one is done, within ``timeout_s`` from now.

        Otherwise this rank holds the roll call of ``phase`` (:meth:`begin_transfers`): a wait that
        timed out closed its connections, so the ranks blocked on it fail at once and check in too.
        The error names the peers whose transfers failed that did not check in (or, when they all
        did, being blocked themselves, every rank that did not).
        """
        self._refuse_if_broken(what)
        with self._busy():
            started_s = time.monotonic()
            failed: dict[int, RuntimeError] = {}
            works = []
            for start, transfers in ((dist.isend, sends), (dist.irecv, recvs)):
                for peer, tag, tensor in transfers:
                    try:
                        works.append((peer, start(tensor, peer, group=self.group, tag=tag)))
                    except RuntimeError as exc:  # the peer's connection closed already
                        failed.setdefault(peer, exc)
            for peer, work in works:  # gloo's point-to-point works have no future: each wait is bounded
                try:  # one peer's closed connection leaves the others' transfers going: wait for them too
                    work.wait(datetime.timedelta(seconds=max(0.001, started_s + timeout_s - time.monotonic())))
                except RuntimeError as exc:  # timed out, or the peer's connection closed
                    failed.setdefault(peer, exc)
            if not failed:
                return
            failure = next(iter(failed.values()))
            store = dist.PrefixStore(f"{ROLLCALL_PREFIX}/{self._epoch}/{phase}", self.group.get_group_store())
            call = rollcall.hold(store, self._rank, self._world_size, rollcall.window_s(timeout_s))
            missing = call.missing(self._world_size)
            silent = [peer for peer in sorted(failed) if missing is not None and peer in missing]
            if silent:
                text = f"rank(s) {silent} did not answer {what} within {_seconds(timeout_s)} s"
                self.broken = CollectiveTimeoutError(text, ranks=silent, what=what, timeout_s=timeout_s)
            else:
                self.broken = timeout_error(call, self._world_size, what, timeout_s, failure)
            raise self.broken from failure

    def destroy(self) -> None:
        """Free the group (its connections and gloo's threads, joined here); never raises. A broken
        group is left to the process's end: its operation may still be pending in gloo's thread,
        which freeing it would wait for until gloo's own timeout."""
        if self.broken is not None or self.group is None:
            return
        if self in _groups.live:
            _groups.live.remove(self)
        try:
            dist.destroy_process_group(self.group)
        except (ValueError, RuntimeError, AssertionError):  # the application destroyed every group first
            pass
        # torch's registries let go of it above: dropping the last reference runs gloo's destructor
        # now (it releases the GIL, waits for its queue and joins its threads), not at the exit
        self.group = None

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Count a collective in flight while it runs (the exit frees idle groups only)."""
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    def _next(self, what: str) -> int:
        self._refuse_if_broken(what)
        self._sequence += 1
        return self._sequence

    def _refuse_if_broken(self, what: str) -> None:
        if self.broken is not None:
            raise CollectiveTimeoutError(
                f"{self.broken} (spotrun's {self.name} process group is not used again: {what} cannot run)",
                ranks=self.broken.ranks,
                what=what,
                timeout_s=self.broken.timeout_s,
            ) from self.broken

    def _gather_sizes(self, size: int, sequence: int, what: str, timeout_s: float) -> list[int]:
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self._world_size)]
        started_s = time.monotonic()
        work = self.group.allgather(
            sizes, torch.tensor([size], dtype=torch.int64), timeout=self._gloo_timeout(timeout_s)
        )
        self._wait(work, sequence, what, timeout_s, started_s)
        return [int(s.item()) for s in sizes]

    def _wait(self, work: Any, sequence: int, what: str, timeout_s: float, started_s: float) -> None:
        done = threading.Event()
        work.get_future().add_done_callback(lambda _future: done.set())
        with self._busy():
            self._finish(work, done, sequence, what, timeout_s, started_s)

    def _finish(
        self, work: Any, done: threading.Event, sequence: int, what: str, timeout_s: float, started_s: float
    ) -> None:
        def succeeded() -> bool:
            try:
                return done.is_set() and work.wait()
            except RuntimeError:  # gloo gave up, or a peer's connection closed
                return False

        failed_early = done.wait(max(0.0, started_s + timeout_s - time.monotonic()))
        if failed_early and succeeded():
            return
        store = dist.PrefixStore(f"{ROLLCALL_PREFIX}/{self._epoch}/{sequence}", self.group.get_group_store())
        # The bound passed: the collective may still complete during the window (a rank was late,
        # not gone) until gloo's own timeout ends it with the window, closing this rank's
        # connections; the ranks blocked on this one then fail at once and check in after it.
        call = rollcall.hold(store, self._rank, self._world_size, rollcall.window_s(timeout_s), succeeded)
        if call.completed:
            return
        if not failed_early:
            call = rollcall.hold(store, self._rank, self._world_size, rollcall.AFTER_CLOSE_S, check_in=False)
        failure = None
        try:
            work.wait()
        except RuntimeError as exc:
            failure = exc
        self.broken = timeout_error(call, self._world_size, what, timeout_s, failure)
        raise self.broken from failure

    @staticmethod
    def _gloo_timeout(timeout_s: float) -> datetime.timedelta:
        """gloo's own timeout: the bound and the roll call's window (its connections close then)."""
        return datetime.timedelta(seconds=timeout_s + rollcall.window_s(timeout_s))


def timeout_error(
    call: rollcall.RollCall, world_size: int, what: str, timeout_s: float, failure: Exception | None
) -> CollectiveTimeoutError:
    """The error a collective raises after its roll call."""
    missing = call.missing(world_size)
    bound = f"within {_seconds(timeout_s)} s"
    if missing is None:
        text = f"not every rank arrived at {what} {bound}, and the roll call on the job's store got no answer"
    elif missing:
        text = f"rank(s) {missing} did not arrive at {what} {bound}"
    else:
        text = f"{what} failed although every rank arrived ({type(failure).__name__}: {failure})"
    return CollectiveTimeoutError(text, ranks=missing or [], what=what, timeout_s=timeout_s)


class _Groups:
    """The training thread's group of the current default process group, and how many groups
    spotrun made in this process (in the same order on every rank: their roll calls' names)."""

    def __init__(self) -> None:
        # weak: the job's destroy_process_group() frees its default group (and gloo's threads) at
        # once, as without spotrun
        self.default: weakref.ref[Any] | None = None
        self.training: BoundedGroup | None = None
        self.made = 0
        self.live: list[BoundedGroup] = []  # made and not freed (the exit frees them)


# Process-wide as torch's default group is: the training thread's group lives as long as it does.
_groups = _Groups()


def _free_at_exit() -> None:
    """Free every idle, unbroken group before Python finalizes (see the module docstring). A group
    with a collective in flight (a background thread the application never closed) or a broken one
    is left: freeing it would wait for its collective, up to gloo's own timeout."""
    for group in list(_groups.live):
        if group._in_flight == 0 and group._pid == os.getpid():
            group.destroy()
    _groups.training = _groups.default = None


atexit.register(_free_at_exit)


def new_group(name: str, *, timeout_s: float, what: str) -> BoundedGroup:
    """Make a bounded group over all ranks (collective: every rank makes spotrun's groups at the
    same point, in the same order). A rank that does not arrive within ``timeout_s`` is named
    (:class:`~spotrun.errors.CollectiveTimeoutError`), ``what`` saying what made the group."""
    _groups.made += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    what = f"the start of spotrun's {name} process group (at {what})"
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # the epoch makes the roll calls' keys unique on the store, which a torchrun restart keeps
        bounded = BoundedGroup(group, name, epoch=f"new-{restart}-{_groups.made}")
        epoch = group.get_group_store().add(f"{ROLLCALL_PREFIX}/epochs", 1) if bounded._rank == 0 else None
        bounded._epoch = bounded.broadcast_bytes(
            str(epoch).encode() if epoch is not None else None, 0, timeout_s=timeout_s, what=what
        ).decode()
        return bounded
    except CollectiveTimeoutError:
        raise
    except RuntimeError as exc:  # gloo's connections were not all made in time (DistStoreError is one)
        store = dist.PrefixStore(
            f"{ROLLCALL_PREFIX}/new-{restart}-{_groups.made}", dist.distributed_c10d._get_default_store()
        )
        call = rollcall.hold(store, dist.get_rank(), dist.get_world_size(), rollcall.window_s(timeout_s))
        raise timeout_error(call, dist.get_world_size(), what, timeout_s, exc) from exc


def training_group(*, timeout_s: float, what: str) -> BoundedGroup:
    """The training thread's bounded group, made at its first collective (collective then:
    ``timeout_s`` and ``what`` bound and name the making, as for :func:`new_group`)."""
    default = dist.distributed_c10d._get_default_group()
    made_for = _groups.default() if _groups.default is not None else None
    if _groups.training is None or made_for is not default:  # none yet, or the job made a new default group
        if _groups.training is not None:  # the old default group's: its peers made a new one too
            _groups.training.destroy()
        _groups.training, _groups.default = new_group("training", timeout_s=timeout_s, what=what), weakref.ref(default)
    return _groups.training

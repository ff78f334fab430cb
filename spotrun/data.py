"""Data order that resumes exactly: a distributed sampler and loader that know their position.

:class:`ResumableDataLoader` is a :class:`torch.utils.data.DataLoader` over a map-style dataset
that shards the samples over ranks like :class:`~torch.utils.data.DistributedSampler` and counts
the batches it has handed to the training loop. Its ``state_dict()`` (epoch and batches consumed,
plus the settings that fix the order) is plain JSON and identical on every rank, so a checkpoint
stores it once as replicated state. After ``load_state_dict()`` the next batch is exactly the one
an uninterrupted run would have seen next.

How the order is made: epoch ``e`` is ``torch.randperm(dataset_len)`` drawn from a private
generator seeded with ``seed + e`` (the same permutation ``DistributedSampler`` draws), padded
or cut to a multiple of the world size, and rank ``r`` takes ``indices[r::num_replicas]``.
A resume skips the consumed samples in the sampler, so nothing is loaded twice. The global
torch RNG is never used, so iterating does not shift the training's own random numbers.

Limits:
    * Random augmentations inside loader workers are not resumed. Worker seeds come from a
      generator seeded with ``seed + epoch`` when the epoch's iterator starts (the same on every
      rank), so after a mid-epoch resume the workers' random streams restart from the epoch's
      seeds and the remaining samples get different random augmentations than they would have
      without the interruption. Deterministic datasets resume bit-exactly.
    * With ``persistent_workers=True`` the workers keep the seeds of the epoch they started in.
    * The world size, dataset length and batch size must stay the same across a resume;
      resharding a partly consumed epoch over another world size is not supported
      (``load_state_dict`` refuses it with :class:`~spotrun.errors.StateMismatchError`).
    * One iterator at a time: starting a new ``iter(loader)`` ends the previous one.

Stop signals: torchrun forwards SIGTERM to each rank's whole process group, and a spot VM's
shutdown signals every process. torch's loader workers die on a SIGTERM that does not come
from their parent, and the rank then raises ``DataLoader worker ... is killed by signal``
before it can save (field case C09). Workers of this loader therefore ignore SIGTERM and
SIGINT unless the parent sends them (the rank decides when to stop, and shuts them down
as usual); the signals are blocked while workers start, so none slips in before the
worker has set that up.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler

from spotrun.errors import ConfigError, StateMismatchError

#: Version of the dict returned by ``ResumableDataLoader.state_dict``.
STATE_VERSION = 1
_REJECTED_KWARGS = ("sampler", "batch_sampler", "generator")
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class _IgnoreStopSignals:
    """``worker_init_fn`` wrapper: stop signals from anyone but the parent are ignored.

    The worker keeps SIGTERM and SIGINT blocked and a daemon thread takes them with
    ``sigwaitinfo``, which tells who sent each: a SIGTERM from the parent (the loader's or
    multiprocessing's own shutdown) ends the worker at once, as torch's handler does;
    anything else (torchrun's ``killpg``, a VM-wide shutdown, Ctrl-C) is dropped, and the
    rank decides when its workers stop.
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # already so when forked
        threading.Thread(target=_take_stop_signals, name="spotrun-stop-signals", daemon=True).start()
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _take_stop_signals() -> None:
    while True:
        info = signal.sigwaitinfo(_STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == os.getppid():
            os._exit(0)


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """Block SIGTERM/SIGINT in this thread while loader workers are forked: they inherit the
    mask, so no stop signal reaches them before :class:`_IgnoreStopSignals` runs; one that
    arrives for this process meanwhile waits, then is handled as usual."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if type(num_replicas) is not int or num_replicas < 1:
        raise ConfigError(f"num_replicas must be a positive int, got {num_replicas!r}")
    if type(rank) is not int or not 0 <= rank < num_replicas:
        raise ConfigError(f"rank must be an int in [0, {num_replicas}), got {rank!r}")
    return num_replicas, rank


class ResumableDistributedSampler(Sampler[int]):
    """Indices of one rank's share of an epoch, starting from any position in it.

    Args:
        dataset_len: number of samples, or a ``Sized`` dataset to take it from.
        num_replicas: world size; default ``torch.distributed`` world size if initialised, else 1.
        rank: this rank; default ``torch.distributed`` rank if initialised, else 0.
        shuffle: permute the samples every epoch (otherwise ``0..dataset_len-1`` in order).
        seed: epoch ``e`` uses the permutation of a generator seeded with ``seed + e``.
        drop_last: drop the tail that does not split evenly over the ranks; otherwise pad with
            samples from the start of the epoch's order (as ``DistributedSampler`` does).

    Iterating yields ``indices[start_index:]`` of epoch ``epoch`` (see :meth:`set_position`).
    ``len()`` is the full per-rank epoch length, :attr:`num_samples`, as for ``DistributedSampler``.

    Raises:
        ConfigError: a negative length or a bad ``num_replicas`` / ``rank`` / ``seed``.
    """

    def __init__(
        self,
        dataset_len: int | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        length = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
        if type(length) is not int or length < 0:
            raise ConfigError(f"dataset_len must be a non-negative int, got {dataset_len!r}")
        if type(seed) is not int:
            raise ConfigError(f"seed must be an int, got {seed!r}")
        self.dataset_len = length
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        # per-rank samples: the even share when dropping the tail, else the padded share
        if self.drop_last:
            self.num_samples = length // self.num_replicas
        else:
            self.num_samples = math.ceil(length / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.epoch = 0
        self.start_index = 0

    def set_position(self, epoch: int, start_index: int = 0) -> None:
        """Make the next iteration yield epoch ``epoch`` from this rank's ``start_index``-th sample.

        Raises:
            ConfigError: a negative epoch, or ``start_index`` outside ``[0, num_samples]``.
        """
        if type(epoch) is not int or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative int, got {epoch!r}")
        if type(start_index) is not int or not 0 <= start_index <= self.num_samples:
            raise ConfigError(
                f"start_index must be an int in [0, {self.num_samples}], got {start_index!r}"
            )
        self.epoch, self.start_index = epoch, start_index

    def set_epoch(self, epoch: int) -> None:
        """``DistributedSampler``-compatible: start epoch ``epoch`` from its beginning."""
        self.set_position(epoch, 0)

    def epoch_indices(self, epoch: int) -> list[int]:
        """All of this rank's indices of epoch ``epoch``, ``num_samples`` of them."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        if self.drop_last:
            order = order[: self.total_size]
        elif order:
            repeats = math.ceil(self.total_size / len(order))
            order = (order * repeats)[: self.total_size]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices(self.epoch)[self.start_index :])

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position in the data order can be saved and restored exactly.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch on each rank.
        shuffle, seed, num_replicas, rank: as for :class:`ResumableDistributedSampler`.
        drop_last: drop the tail that does not split evenly over the ranks *and* the last
            incomplete batch, so every batch is full; otherwise pad (every rank still gets the
            same number of batches) and keep a smaller last batch.
        **dataloader_kwargs: passed to ``DataLoader`` (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``worker_init_fn``, ...).

    Iterating yields the rest of the current epoch, counting each batch when it is handed to
    the caller (not when workers prefetch it). When the epoch is exhausted, ``epoch`` goes up
    by one and the position goes back to 0, so both ``for epoch in ...: for batch in loader``
    and ``while step < n: for batch in loader`` work. A loader restored right after the last
    batch of an epoch yields nothing once and then moves on to the next epoch, so code after
    the inner loop (a per-epoch scheduler step) runs exactly once for that epoch.
    ``len(loader)`` is the number of batches per epoch on each rank. The loader keeps the epoch
    itself: read ``loader.epoch`` rather than calling ``sampler.set_epoch`` (which the next
    iteration overrides).

    Raises:
        ConfigError: an iterable-style dataset, a bad ``batch_size``, or a ``sampler``,
            ``batch_sampler`` or ``generator`` argument (this loader makes its own).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        **dataloader_kwargs: Any,
    ) -> None:
        given = [name for name in _REJECTED_KWARGS if dataloader_kwargs.get(name) is not None]
        if given:
            raise ConfigError(
                "ResumableDataLoader makes its own sampler and generator; do not pass "
                f"{', '.join(given)}"
                " (use shuffle=, seed=, num_replicas=, rank=, drop_last= instead)"
            )
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
            raise ConfigError(
                "ResumableDataLoader needs a map-style dataset with __len__ and __getitem__"
            )
        if type(batch_size) is not int or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        sampler = ResumableDistributedSampler(
            len(dataset), num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self._seed_generator = torch.Generator()
        for name in _REJECTED_KWARGS:
            dataloader_kwargs.pop(name, None)
        dataloader_kwargs["worker_init_fn"] = _IgnoreStopSignals(dataloader_kwargs.get("worker_init_fn"))
        super().__init__(
            dataset, batch_size, sampler=sampler, drop_last=drop_last,
            generator=self._seed_generator, **dataloader_kwargs,
        )
        self._epoch = 0
        self._batches_consumed = 0
        self._iteration = 0

    @property
    def epoch(self) -> int:
        """Current epoch (0-based); goes up when an iteration runs out of batches."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch already handed to the caller on this rank."""
        return self._batches_consumed

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._iteration += 1
        return self._iterate(self._iteration)

    def _iterate(self, iteration: int) -> Iterator[Any]:
        if iteration != self._iteration:
            return
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        start_index = min(self._batches_consumed * self.batch_size, len(sampler))
        sampler.set_position(self._epoch, start_index)
        self._seed_generator.manual_seed(sampler.seed + self._epoch)
        if self._batches_consumed < len(self):
            with _stop_signals_blocked():
                batches = super().__iter__()  # forks the workers, if any
            for batch in batches:
                if iteration != self._iteration:
                    return  # a newer iterator took over; it owns the position now
                self._batches_consumed += 1
                yield batch
        if iteration == self._iteration:
            self._epoch += 1
            self._batches_consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """Position and order settings; JSON values only, identical on every rank."""
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "batches_consumed": self._batches_consumed,
            "seed": sampler.seed,
            "num_replicas": sampler.num_replicas,
            "batch_size": self.batch_size,
            "dataset_len": sampler.dataset_len,
            "shuffle": sampler.shuffle,
            "drop_last": sampler.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the next batch is the one after the saved ones.

        Raises:
            StateMismatchError: a field is missing, unknown or of the wrong type, the position is
                out of range, or the world size, dataset length, batch size, seed, shuffle or
                drop_last differ from this loader's (the message names each difference).
        """
        if not isinstance(state, dict):
            raise StateMismatchError(
                f"data loader state must be a dict, got {type(state).__name__}"
            )
        own = self.state_dict()
        unknown = sorted(set(state) - set(own))
        if unknown:
            raise StateMismatchError(f"data loader state has unknown fields {unknown}")
        for key, value in own.items():
            if key not in state:
                raise StateMismatchError(f"data loader state lacks the field {key!r}")
            if type(state[key]) is not type(value):
                raise StateMismatchError(
                    f"data loader state field {key!r} is {state[key]!r}, "
                    f"expected a {type(value).__name__}"
                )
        if state["version"] != STATE_VERSION:
            raise StateMismatchError(
                f"data loader state version {state['version']} is not {STATE_VERSION}"
            )
        problems = [
            _describe(key, state[key], own[key]) for key in _MUST_MATCH if state[key] != own[key]
        ]
        if problems:
            raise StateMismatchError(
                "data loader state does not fit this loader: " + "; ".join(problems)
                + ". The rest of the saved epoch cannot be mapped onto this order (resharding"
                " is not supported): resume with the saved settings, or start a new run."
            )
        if state["epoch"] < 0 or not 0 <= state["batches_consumed"] <= len(self):
            raise StateMismatchError(
                f"data loader position epoch={state['epoch']}, batches_consumed="
                f"{state['batches_consumed']} is outside an epoch of {len(self)} batches"
            )
        self._iteration += 1  # any running iterator stops
        self._epoch, self._batches_consumed = state["epoch"], state["batches_consumed"]


_MUST_MATCH = ("num_replicas", "dataset_len", "batch_size", "seed", "shuffle", "drop_last")


def _describe(key: str, saved: Any, now: Any) -> str:
    if key == "num_replicas":
        return f"saved at world size {saved}, now {now}"
    return f"{key} was {saved!r} when saved, now {now!r}"

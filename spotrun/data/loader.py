"""Data order that resumes exactly, also at another world size.

:class:`ResumableDataLoader` is a :class:`torch.utils.data.DataLoader` over a map-style dataset
that shards the samples over ranks like :class:`~torch.utils.data.DistributedSampler` and counts
the batches it has handed out. Its ``state_dict()`` is the *global* position (plain JSON, the
same on every rank, :mod:`spotrun.data.state`), so after ``load_state_dict()`` the next global
batch is the one an uninterrupted run would have seen, at the same or another world size.
How the order is made, and its limits: ``docs/design/internals.md`` (Data).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler

from spotrun.data.state import STATE_VERSION, mismatches, parse_state
from spotrun.data.workers import IgnoreStopSignals, stop_signals_blocked
from spotrun.errors import ConfigError, StateMismatchError

__all__ = [
    "STATE_VERSION",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "samples_digest",
]

log = logging.getLogger(__name__)
_REJECTED_KWARGS = ("sampler", "batch_sampler", "generator")


def samples_digest(indices: Iterable[int]) -> str:
    """A short fingerprint of a set of sample indices, to compare data orders across runs.

    The first 16 hex characters of the SHA-256 of the indices sorted ascending and written as
    decimal text joined by commas (``[5, 2, 9]`` hashes ``b"2,5,9"``). The sort makes it
    independent of which rank held which sample; repeats (padding) count.

    Args:
        indices: dataset indices (ints), e.g. :meth:`ResumableDataLoader.last_global_batch`.

    Returns:
        16 lowercase hex characters.
    """
    text = ",".join(str(i) for i in sorted(int(i) for i in indices))
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


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


def _positive_int(name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _batch_size(batch_size: int | None, global_batch_size: int | None, num_replicas: int) -> int:
    """Samples per rank per batch, from ``batch_size`` (per rank, default 1) or
    ``global_batch_size`` (over all ``num_replicas`` ranks); never both."""
    if global_batch_size is None:
        return _positive_int("batch_size", 1 if batch_size is None else batch_size)
    if batch_size is not None:
        raise ConfigError(
            f"give batch_size (per rank, {batch_size!r}) or global_batch_size ({global_batch_size!r}), not both"
        )
    _positive_int("global_batch_size", global_batch_size)
    if global_batch_size % num_replicas:
        raise ConfigError(f"global batch {global_batch_size} does not divide by world size {num_replicas}")
    return global_batch_size // num_replicas


class ResumableDistributedSampler(Sampler[int]):
    """Indices of one rank's share of an epoch, starting from any position in it.

    Args:
        dataset_len: number of samples, or a ``Sized`` dataset to take it from.
        num_replicas: world size ``W``; default ``torch.distributed`` world size if
            initialised, else 1.
        rank: this rank; default ``torch.distributed`` rank if initialised, else 0.
        shuffle: permute the samples every epoch (otherwise ``0..dataset_len-1`` in order).
        seed: epoch ``e`` uses the permutation of a generator seeded with ``seed + e``.
        drop_last: drop the tail that does not fill a global batch; otherwise pad the epoch
            with samples from the start of its order.
        batch_size: samples per batch on each rank; the epoch is padded or cut to whole global
            batches of ``G = batch_size * W``. With the default 1 the order is exactly
            ``DistributedSampler``'s.

    Global batch ``k`` of an epoch is ``global_order(epoch)[k*G:(k+1)*G]``; this rank's share
    of it is every ``W``-th entry from position ``rank``. Iterating yields this rank's indices
    of epoch ``epoch`` from its ``start_index``-th on (see :meth:`set_position`). ``len()`` is the
    full per-rank epoch length, :attr:`num_samples` (a multiple of ``batch_size``).

    Raises:
        ConfigError: a negative length or a bad ``num_replicas`` / ``rank`` / ``seed`` /
            ``batch_size``.
    """

    def __init__(
        self,
        dataset_len: int | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int = 1,
    ) -> None:
        length = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
        if type(length) is not int or length < 0:
            raise ConfigError(f"dataset_len must be a non-negative int, got {dataset_len!r}")
        if type(seed) is not int:
            raise ConfigError(f"seed must be an int, got {seed!r}")
        self.dataset_len = length
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.global_batch_size = self.batch_size * self.num_replicas
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        global_batches = length // self.global_batch_size if self.drop_last else -(-length // self.global_batch_size)
        self.total_size = global_batches * self.global_batch_size  # all ranks, per epoch
        self.num_samples = global_batches * self.batch_size  # this rank, per epoch
        self.epoch = 0
        self.start_index = 0
        self._order_cache: tuple[int, torch.Tensor] | None = None

    def set_position(self, epoch: int, start_index: int = 0) -> None:
        """Make the next iteration yield epoch ``epoch`` from this rank's ``start_index``-th sample.

        Raises:
            ConfigError: a negative epoch, or ``start_index`` outside ``[0, num_samples]``.
        """
        if type(epoch) is not int or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative int, got {epoch!r}")
        if type(start_index) is not int or not 0 <= start_index <= self.num_samples:
            raise ConfigError(f"start_index must be an int in [0, {self.num_samples}], got {start_index!r}")
        self.epoch, self.start_index = epoch, start_index

    def set_epoch(self, epoch: int) -> None:
        """``DistributedSampler``-compatible: start epoch ``epoch`` from its beginning."""
        self.set_position(epoch, 0)

    def global_order(self, epoch: int) -> torch.Tensor:
        """Every rank's indices of epoch ``epoch`` in global order: int64, shape ``(total_size,)``.

        The permutation (or ``arange``) padded by repeating it from its start, or cut, to
        ``total_size``, a whole number of global batches. The same at every world size for the
        same global batch size. The latest epoch's order is cached; do not modify it.
        """
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=generator)
        else:
            order = torch.arange(self.dataset_len, dtype=torch.int64)
        if self.total_size > self.dataset_len:  # pad, from the epoch's start
            order = order.repeat(-(-self.total_size // self.dataset_len))
        order = order[: self.total_size]
        self._order_cache = (epoch, order)
        return order

    def epoch_indices(self, epoch: int) -> list[int]:
        """All of this rank's indices of epoch ``epoch``, ``num_samples`` of them."""
        return self.global_order(epoch)[self.rank :: self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices(self.epoch)[self.start_index :])

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position in the data order can be saved and restored exactly.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch on each rank (default 1 when ``global_batch_size`` is
            not given).
        global_batch_size: the alternative to ``batch_size`` (give at most one): samples per
            step on all ranks together, ``G``; each rank's batch is ``G // world size``.
        shuffle, seed, num_replicas, rank: as for :class:`ResumableDistributedSampler`.
        drop_last: drop the tail of an epoch that does not fill a global batch, so every batch
            is full of distinct samples; otherwise fill the last global batch up with samples
            from the start of the epoch's order (every rank's batches are full either way).
        **dataloader_kwargs: passed to ``DataLoader`` (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``worker_init_fn``, ...).

    Iterating yields the rest of the current epoch, counting each batch when it is handed to
    the caller (not when workers prefetch it). When the epoch is exhausted, ``epoch`` goes up
    by one and the position goes back to 0, so both ``for epoch in ...: for batch in loader``
    and ``while step < n: for batch in loader`` work. A loader restored right after the last
    batch of an epoch yields nothing once and then moves on to the next epoch, so code after
    the inner loop (a per-epoch scheduler step) runs exactly once for that epoch.
    ``len(loader)`` is the number of batches (global batches) per epoch. The loader keeps the
    epoch itself: read ``loader.epoch`` rather than calling ``sampler.set_epoch`` (which the
    next iteration overrides).

    Raises:
        ConfigError: an iterable-style dataset, a bad ``batch_size`` or ``global_batch_size``,
            both of them, a global batch that does not divide by the world size ("global batch
            10 does not divide by world size 3"), or a ``sampler``, ``batch_sampler`` or
            ``generator`` argument (this loader makes its own).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = None,
        *,
        global_batch_size: int | None = None,
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
            raise ConfigError("ResumableDataLoader needs a map-style dataset with __len__ and __getitem__")
        num_replicas, rank = _world(num_replicas, rank)
        batch_size = _batch_size(batch_size, global_batch_size, num_replicas)
        sampler = ResumableDistributedSampler(
            len(dataset),
            num_replicas,
            rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            batch_size=batch_size,
        )
        self._seed_generator = torch.Generator()
        for name in _REJECTED_KWARGS:
            dataloader_kwargs.pop(name, None)
        user_init = dataloader_kwargs.get("worker_init_fn")
        dataloader_kwargs["worker_init_fn"] = IgnoreStopSignals(user_init)
        super().__init__(
            dataset,
            batch_size,
            sampler=sampler,
            drop_last=drop_last,
            generator=self._seed_generator,
            **dataloader_kwargs,
        )
        self._epoch = 0
        self._batches_consumed = 0
        self._iteration = 0
        self._last_batch: tuple[int, int] | None = None  # (epoch, global batch) last yielded

    @property
    def epoch(self) -> int:
        """Current epoch (0-based); goes up when an iteration runs out of batches."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch handed to the caller on this rank (= global batches)."""
        return self._batches_consumed

    @property
    def global_batch_size(self) -> int:
        """Samples per step on all ranks together: ``batch_size * world size``."""
        return self.sampler.global_batch_size  # type: ignore[attr-defined]

    @property
    def global_samples_consumed(self) -> int:
        """Samples of the current epoch handed out on all ranks together."""
        return self._batches_consumed * self.global_batch_size

    def last_global_batch(self) -> list[int]:
        """Dataset indices of the global batch that the latest batch yielded here belongs to.

        Every rank's samples of that step, in the global order (rank ``r`` of ``W`` held
        positions ``r, r+W, ...``), ``global_batch_size`` of them; padding repeats count. The
        same list on every rank and at every world size with the same global batch size, so
        :func:`samples_digest` of it identifies the step's data. ``[]`` before the first batch
        and right after ``load_state_dict``.
        """
        if self._last_batch is None:
            return []
        epoch, k = self._last_batch
        size = self.global_batch_size
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        return sampler.global_order(epoch)[k * size : (k + 1) * size].tolist()

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
            with stop_signals_blocked():
                batches = super().__iter__()  # forks the workers, if any
            for batch in batches:
                if iteration != self._iteration:
                    return  # a newer iterator took over; it owns the position now
                self._last_batch = (self._epoch, self._batches_consumed)
                self._batches_consumed += 1
                yield batch
        if iteration == self._iteration:
            self._epoch += 1
            self._batches_consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """The global position and the order settings (version 2, see :mod:`spotrun.data.state`).

        JSON values only, identical on every rank.
        """
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "global_samples_consumed": self.global_samples_consumed,
            "seed": sampler.seed,
            "global_batch_size": sampler.global_batch_size,
            "dataset_len": sampler.dataset_len,
            "shuffle": sampler.shuffle,
            "drop_last": sampler.drop_last,
            "world_size": sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the next global batch is the one after the saved ones.

        ``state`` may come from another world size (the rest of the epoch is dealt out to this
        loader's ranks, in the same global batches; one INFO line says so) and may be a
        version-1 state of an older spotrun (converted, see :mod:`spotrun.data.state`).

        Raises:
            StateMismatchError: a field is missing, unknown or of the wrong type, the position is
                not a whole number of global batches inside an epoch, or the global batch size,
                dataset length, seed, shuffle or drop_last differ from this loader's (the message
                names each difference, and a saved global batch that does not divide by this
                world size names both numbers). Nothing changes then.
        """
        saved = parse_state(state)
        own = self.state_dict()
        problems = mismatches(saved, own)
        if problems:
            raise StateMismatchError(
                "data loader state does not fit this loader: "
                + "; ".join(problems)
                + ". The rest of the saved epoch cannot be mapped onto this order:"
                " resume with the saved settings, or start a new run."
            )
        size, consumed = own["global_batch_size"], saved["global_samples_consumed"]
        if consumed % size or consumed > len(self) * size:
            raise StateMismatchError(
                f"data loader position epoch={saved['epoch']}, global_samples_consumed="
                f"{consumed} is not a whole number of global batches of {size} inside an "
                f"epoch of {len(self)} of them"
            )
        self._iteration += 1  # any running iterator stops
        self._epoch, self._batches_consumed = saved["epoch"], consumed // size
        self._last_batch = None
        if saved["world_size"] != own["world_size"]:
            log.info(
                "data order: resuming epoch %d at global sample %d, saved at world size %d, now %d",
                saved["epoch"],
                consumed,
                saved["world_size"],
                own["world_size"],
            )

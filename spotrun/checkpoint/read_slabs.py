"""Scratch buffers for the rows a resharding restore reads whole and copies from
(:mod:`spotrun.checkpoint.chunk_reader`): a slab of rows, read in one or two read units, copied
into its box once every part is read and verified."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from spotrun.checkpoint.stream import CHECKSUM_CHUNK_BYTES


class ScratchPool:
    """Scratch buffers of up to one read unit, reused from slab to slab (a fresh buffer costs a
    page fault per 4 KiB when first written)."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.numel() >= nbytes:
                    return self._free.pop(i)
        return torch.empty(max(nbytes, CHECKSUM_CHUNK_BYTES), dtype=torch.uint8)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)


class Slab:
    """Rows of a chunk read into a scratch buffer (taken when its first part is read), then
    copied into the receiving box once every part of it has been read and verified."""

    def __init__(self, nbytes: int, copy: Callable[[torch.Tensor], None], pool: ScratchPool) -> None:
        self.nbytes = nbytes
        self.copy = copy
        self.pending = 1  # parts not yet read (a slab cut by a read unit has two)
        self._pool = pool
        self._scratch: torch.Tensor | None = None
        self._lock = threading.Lock()

    def view(self, lo: int, hi: int) -> torch.Tensor:
        with self._lock:
            if self._scratch is None:
                self._scratch = self._pool.take(self.nbytes)
            return self._scratch[lo:hi]

    def part_read(self) -> None:
        with self._lock:
            self.pending -= 1
            if self.pending:
                return
            scratch, self._scratch = self._scratch, None
        self.copy(scratch[: self.nbytes])
        self._pool.give_back(scratch)

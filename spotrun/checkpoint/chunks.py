"""Chunks of a global tensor: boxes in its index space, who wrote each, and which bytes
of a chunk a box of another layout needs.

A *chunk* is the part of a global tensor one rank wrote (offsets and lengths, row-major). A
restore on another layout asks :func:`overlap` and :func:`byte_runs` which chunks hold which
bytes of the box it needs. A manifest stores a tensor's chunks as a grid or a list
(:class:`ChunkLayout`), so it stays small at any rank count. The forms:
``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

#: A box: (offsets, lengths), one entry per dimension.
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Chunk:
    """One chunk: ``offsets`` and ``lengths`` in the global shape, and the rank that wrote it."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    writer: int

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


def grid_bounds(size: int, parts: int) -> list[int]:
    """Boundaries of ``size`` cut into ``parts`` as ``torch.chunk`` does (``parts + 1`` values).

    Parts are ``ceil(size / parts)`` long; the last ones are shorter or empty.
    """
    step = -(-size // parts) if parts else 0
    if step == 0:
        return [0] * (parts + 1)
    reached = min(parts, size // step)  # the parts that start within the tensor; the rest are empty
    return list(range(0, reached * step + 1, step)) + [size] * (parts - reached)


class ChunkLayout:
    """The chunks of one global tensor of ``shape`` (see the module docstring).

    Built from a grid (``grid``, ``writers``) or from explicit ``chunks``; chunks of zero
    elements are never listed (nothing was written for them).
    """

    def __init__(
        self,
        shape: list[int],
        *,
        grid: list[int] | None = None,
        writers: list[int] | None = None,
        chunks: list[Chunk] | None = None,
    ) -> None:
        self.shape = tuple(shape)
        self.grid = None if grid is None else tuple(grid)
        self._writers = writers
        self._chunks = chunks
        if grid is not None:
            if len(grid) != len(shape) or any(p < 1 for p in grid):
                raise ValueError(f"grid {grid} does not fit shape {list(shape)}")
            if writers is None or len(writers) != math.prod(grid):
                raise ValueError(f"grid {grid} needs {math.prod(grid)} writers")
            self._bounds = [grid_bounds(s, p) for s, p in zip(shape, grid)]
        elif chunks is None:
            raise ValueError("a chunk layout needs a grid or a chunk list")

    @property
    def whole_writer(self) -> int | None:
        """The rank that wrote the whole tensor as one chunk, else ``None``."""
        if self.grid is not None and len(self._writers) == 1 and math.prod(self.shape):
            return self._writers[0]
        return None

    def chunks(self) -> list[Chunk]:
        """Every chunk that holds bytes."""
        if self._chunks is not None:
            return list(self._chunks)
        return self._cells(tuple((0, p) for p in self.grid))

    def overlapping(self, box: Box) -> list[Chunk]:
        """The chunks that share at least one element with ``box``."""
        offsets, lengths = box
        if self._chunks is not None:
            return [c for c in self._chunks if _intersect((c.offsets, c.lengths), box) is not None]
        ranges = []
        for bounds, start, length in zip(self._bounds, offsets, lengths):
            if length == 0:
                return []
            first = bisect.bisect_right(bounds, start, 0, len(bounds) - 1) - 1
            last = bisect.bisect_left(bounds, start + length, 0, len(bounds) - 1)
            ranges.append((first, last))
        return [c for c in self._cells(tuple(ranges)) if _intersect((c.offsets, c.lengths), box) is not None]

    def _cells(self, ranges: tuple[tuple[int, int], ...]) -> list[Chunk]:
        found = []
        for index in _product(ranges):
            offsets = tuple(b[i] for b, i in zip(self._bounds, index))
            lengths = tuple(b[i + 1] - b[i] for b, i in zip(self._bounds, index))
            if math.prod(lengths) == 0:
                continue
            cell = 0
            for parts, i in zip(self.grid, index):
                cell = cell * parts + i
            found.append(Chunk(offsets, lengths, self._writers[cell]))
        return found

    def to_json(self) -> dict[str, Any]:
        """The manifest form: ``{"grid": [...], "writers": ...}`` or ``{"chunks": [...]}``."""
        if self.grid is not None:
            return {"grid": list(self.grid), "writers": compress_ranks(self._writers)}
        return {"chunks": [[list(c.offsets), list(c.lengths), c.writer] for c in self._chunks]}

    @classmethod
    def from_json(cls, shape: list[int], raw: dict[str, Any], *, max_cells: int | None = None) -> ChunkLayout:
        """Parse the manifest form.

        ``max_cells``: the most cells a grid may have (what the step's files can hold:
        :class:`spotrun.checkpoint.manifest.Manifest` says), checked before any list of cells or
        writers is built.

        Raises:
            ValueError: malformed, chunks outside ``shape``, or a grid of more cells than
                ``max_cells``.
        """
        if "grid" in raw:
            grid = raw["grid"]
            writers = raw["writers"]
            if (
                type(writers) is list
                and len(writers) == 1
                and type(writers[0]) is int
                and writers[0] >= 0
                and type(grid) is list
                and len(grid) == len(shape)
                and all(p == 1 for p in grid)
            ):
                return cls(shape, grid=grid, writers=writers)  # a whole tensor (the common case)
            if type(grid) is not list or len(grid) != len(shape) or not all(type(p) is int and p >= 1 for p in grid):
                raise ValueError(f"grid must list {len(shape)} integers >= 1, got {brief(grid)}")
            cells = 1
            for parts in grid:  # stops early: a hostile grid never builds a huge integer or list
                cells *= parts
                if max_cells is not None and cells > max_cells:
                    raise ValueError(
                        f"grid {brief(grid)} of shape {brief(shape)} has more cells than the "
                        f"{max_cells} the step's files can hold"
                    )
            return cls(shape, grid=grid, writers=expand_ranks(raw["writers"], cells))
        chunks = []
        for item in raw["chunks"]:
            offsets, lengths, writer = item
            if not (
                type(offsets) is list
                and type(lengths) is list
                and len(offsets) == len(lengths) == len(shape)
                and all(type(v) is int and v >= 0 for v in offsets + lengths)
                and type(writer) is int
                and all(o + n <= s for o, n, s in zip(offsets, lengths, shape))
            ):
                raise ValueError(f"chunk {item!r} does not fit shape {shape}")
            chunks.append(Chunk(tuple(offsets), tuple(lengths), writer))
        return cls(shape, chunks=chunks)

    @classmethod
    def of(cls, shape: list[int], chunks: list[Chunk]) -> ChunkLayout:
        """The most compact layout holding ``chunks`` (a grid where they form one)."""
        chunks = [c for c in chunks if c.numel]
        if not chunks:  # an empty tensor
            return cls(shape, chunks=[])
        if len(chunks) == 1 and chunks[0].lengths == tuple(shape):  # a whole tensor (the common case)
            return cls(shape, grid=[1] * len(shape), writers=[chunks[0].writer])
        grid = _as_grid(tuple(shape), chunks)
        if grid is not None:
            return cls(shape, grid=grid[0], writers=grid[1])
        return cls(shape, chunks=sorted(chunks, key=lambda c: c.offsets))


def brief(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (a hostile list in a one-line message)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _product(ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, ...]]:
    result: list[tuple[int, ...]] = [()]
    for lo, hi in ranges:
        result = [prefix + (i,) for prefix in result for i in range(lo, hi)]
    return result


def _as_grid(shape: tuple[int, ...], chunks: list[Chunk]) -> tuple[list[int], list[int]] | None:
    """``(grid, writers)`` when ``chunks`` are exactly the non-empty cells of a torch.chunk
    grid of ``shape``; empty cells get the writer that continues the progression."""
    if not shape:
        return ([], [chunks[0].writer]) if len(chunks) == 1 else None
    counts = []
    for d, size in enumerate(shape):
        longest = max(c.lengths[d] for c in chunks)
        # torch.chunk's part length is the longest one; FSDP2 may leave empty parts at the
        # end, which hold nothing and need no cell
        counts.append(max(1, -(-size // longest)) if longest else 1)
    bounds = [grid_bounds(s, p) for s, p in zip(shape, counts)]
    # each dimension: the start of every non-empty part -> (its index, its length)
    parts_at = [{b[i]: (i, b[i + 1] - b[i]) for i in range(len(b) - 1) if b[i + 1] > b[i]} for b in bounds]
    writers: dict[int, int] = {}
    for c in chunks:
        cell = 0
        for at, parts, o, n in zip(parts_at, counts, c.offsets, c.lengths):
            i, length = at.get(o, (None, None))
            if length != n:
                return None
            cell = cell * parts + i
        if cell in writers:
            return None
        writers[cell] = c.writer
    total = math.prod(counts)
    if len(writers) != math.prod(len(at) for at in parts_at):  # every non-empty cell, once
        return None
    return counts, _fill_writers(writers, total)


def _fill_writers(known: dict[int, int], total: int) -> list[int]:
    """Writers of every cell; cells nobody wrote (empty) continue an arithmetic progression
    when the known ones form one, else repeat the last known writer."""
    cells = sorted(known)
    if len(cells) >= 2:
        step = (known[cells[1]] - known[cells[0]]) // max(1, cells[1] - cells[0])
        if all(known[c] == known[cells[0]] + (c - cells[0]) * step for c in cells):
            return [known[cells[0]] + (c - cells[0]) * step for c in range(total)]
    last = known[cells[0]] if cells else 0
    writers = []
    for c in range(total):
        last = known.get(c, last)
        writers.append(last)
    return writers


def compress_ranks(ranks: list[int]) -> list[int] | dict[str, int]:
    """``{"first": a, "step": s}`` for an arithmetic progression of 3 or more ranks, else the list."""
    if len(ranks) >= 3 and ranks == _progression(ranks[0], ranks[1] - ranks[0], len(ranks)):
        return {"first": ranks[0], "step": ranks[1] - ranks[0]}
    return list(ranks)


def _progression(first: int, step: int, count: int) -> list[int]:
    """``[first, first + step, ...]``, ``count`` values (one list built in C: manifests of
    thousands of ranks hold one per sharded tensor)."""
    return list(range(first, first + step * count, step)) if step else [first] * count


def expand_ranks(raw: Any, count: int) -> list[int]:
    """Inverse of :func:`compress_ranks` for ``count`` ranks.

    Raises:
        ValueError: malformed, or not ``count`` ranks.
    """
    if isinstance(raw, dict):
        first, step = raw["first"], raw["step"]
        if type(first) is not int or type(step) is not int:
            raise ValueError(f"writers must hold integers, got {raw!r}")
        if count and min(first, first + step * (count - 1)) < 0:
            raise ValueError(f"writers must list {count} ranks >= 0, got {raw!r}")
        return _progression(first, step, count)
    ranks = raw
    if type(ranks) is not list or len(ranks) != count or not all(type(r) is int and r >= 0 for r in ranks):
        raise ValueError(f"writers must list {count} ranks >= 0, got {raw!r}")
    return ranks


def _intersect(a: Box, b: Box) -> Box | None:
    offsets, lengths = [], []
    for (ao, al), (bo, bl) in zip(zip(*a), zip(*b)):
        start, stop = max(ao, bo), min(ao + al, bo + bl)
        if stop <= start:
            return None
        offsets.append(start)
        lengths.append(stop - start)
    return tuple(offsets), tuple(lengths)


def overlap(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover (global coordinates), or ``None``.
    Zero-dimensional boxes (scalars) always overlap."""
    if not a[0]:
        return (), ()
    return _intersect(a, b)


def byte_runs(chunk_lengths: tuple[int, ...], box: Box, itemsize: int) -> tuple[int, list[tuple[int, int]]]:
    """Where a box lies in a chunk stored contiguously in row-major order.

    Args:
        chunk_lengths: the chunk's shape.
        box: offsets (relative to the chunk's origin) and lengths of the part wanted.
        itemsize: bytes per element.

    Returns:
        ``(run_bytes, starts)``: the box is ``len(starts)`` runs of ``run_bytes`` contiguous
        bytes each, starting at these byte offsets within the chunk, in row-major order of
        the box (so concatenated they are the box as a contiguous tensor).
    """
    offsets, lengths = box
    if not chunk_lengths:
        return itemsize, [0]
    # the trailing dimensions the box spans fully are contiguous with the first partial one
    inner = len(chunk_lengths) - 1
    while inner > 0 and offsets[inner] == 0 and lengths[inner] == chunk_lengths[inner]:
        inner -= 1
    strides = [1] * len(chunk_lengths)
    for d in range(len(chunk_lengths) - 2, -1, -1):
        strides[d] = strides[d + 1] * chunk_lengths[d + 1]
    run_elements = lengths[inner] * strides[inner]
    starts = [sum(o * s for o, s in zip(offsets, strides))]
    for d in range(inner - 1, -1, -1):
        starts = [base + i * strides[d] for i in range(lengths[d]) for base in starts]
    starts.sort()
    return run_elements * itemsize, [s * itemsize for s in starts]

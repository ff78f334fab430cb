"""Training text: the Python standard library's own source code, as bytes.

Every ``.py`` file under the running interpreter's standard library directory
(``site-packages`` excluded) is read in sorted order of its relative path and the
files are joined with ``b"\\n"``. The result is real, varied text that every machine
with Python already has, identical on every rank of one job.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from spotrun.errors import ConfigError

#: Default cap on the text size, in bytes; keeps start-up under a second.
DEFAULT_MAX_BYTES = 4 * 1024 * 1024

_SEPARATOR = b"\n"
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """Relative paths of the ``.py`` files under ``root``, sorted (POSIX string order).

    ``site-packages``, ``dist-packages`` and ``__pycache__`` directories are skipped.
    ``root`` defaults to :func:`stdlib_root`.
    """
    root = stdlib_root() if root is None else root
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        here = Path(dirpath).relative_to(root)
        found.extend(here / name for name in filenames if name.endswith(".py"))
    return sorted(found, key=lambda p: p.as_posix())


def read_stdlib_bytes(max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> bytes:
    """The concatenated source files, cut to at most ``max_bytes`` bytes.

    Raises:
        ConfigError: ``max_bytes`` is not positive, or no ``.py`` file was found.
    """
    if max_bytes < 1:
        raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
    root = stdlib_root() if root is None else root
    parts: list[bytes] = []
    size_bytes = 0
    for rel in stdlib_source_files(root):
        if size_bytes >= max_bytes:
            break
        data = (root / rel).read_bytes() + _SEPARATOR
        parts.append(data)
        size_bytes += len(data)
    if not parts:
        raise ConfigError(f"no .py files found under {root}")
    return b"".join(parts)[:max_bytes]


class StdlibText(Dataset):
    """Map-style dataset of fixed-length byte windows for next-byte prediction.

    Sample ``i`` is ``(x, y)``, two (block_size,) int64 tensors with
    ``x = text[o : o + block_size]`` and ``y = text[o + 1 : o + block_size + 1]``,
    where ``o = i * block_size``. Windows do not overlap.

    Args:
        block_size: tokens per sample (T).
        max_bytes: cap on the text size in bytes (see :func:`read_stdlib_bytes`).
        root: library directory; defaults to :func:`stdlib_root`.

    Raises:
        ConfigError: ``block_size`` is not positive, or the text is too short for one sample.
    """

    def __init__(self, block_size: int, max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        text = read_stdlib_bytes(max_bytes, root)
        self.block_size = block_size
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)  # (N,)
        if len(self) == 0:
            raise ConfigError(f"{len(text)} bytes of text are too few for one sample of {block_size} tokens")

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        offset = (index % len(self)) * self.block_size
        window = self.data[offset : offset + self.block_size + 1].long()  # (T + 1,)
        return window[:-1], window[1:]  # (T,), (T,)

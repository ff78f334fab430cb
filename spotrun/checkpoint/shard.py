"""One rank's shard files: how they are split, and the whole-file checks of formats 1-2.

A rank's tensors are split over several files (:func:`split_into_parts`) when one file
would pass :class:`ShardLimits`: safetensors refuses to read a header over 100 MB (about
a million small tensors). The files themselves are streamed by
:class:`~spotrun.checkpoint.stream.ShardSource` (which converts header metadata values to
strings, field case C11, and writes a valid empty file for a rank without tensors).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load

from spotrun.checkpoint.manifest import FileRecord
from spotrun.errors import ConfigError, CorruptShardError

#: safetensors refuses to read a file whose JSON header is larger than this.
SAFETENSORS_MAX_HEADER_BYTES = 100_000_000
#: Default most bytes of one shard file (a single larger tensor gets a file of its own).
DEFAULT_MAX_FILE_SIZE_BYTES = 4 * 2**30
#: Default most bytes of one shard file's header, well below safetensors' limit.
DEFAULT_MAX_HEADER_BYTES = 16 * 2**20
#: Room kept in every header for the metadata, the braces and the alignment padding.
_HEADER_RESERVE_BYTES = 1024
#: Upper bound of a header entry's bytes besides its name and shape: the dtype code,
#: the keys, the two data offsets (20 digits each), punctuation.
_ENTRY_FIXED_BYTES = 100


@dataclass(frozen=True)
class ShardLimits:
    """When a rank's tensors go into more than one file.

    Attributes:
        max_file_size_bytes: a file is closed before it would pass this size; a single
            tensor larger than it is written alone, in a file of its own.
        max_header_bytes: a file is closed before its JSON header (an upper estimate)
            would pass this; at most :data:`SAFETENSORS_MAX_HEADER_BYTES`.

    Raises:
        ConfigError: a limit out of range.
    """

    max_file_size_bytes: int = DEFAULT_MAX_FILE_SIZE_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_file_size_bytes, bool)
            or not isinstance(self.max_file_size_bytes, int)
            or self.max_file_size_bytes < 1
        ):
            raise ConfigError(f"max_file_size_bytes must be an integer >= 1, got {self.max_file_size_bytes!r}")
        if (
            isinstance(self.max_header_bytes, bool)
            or not isinstance(self.max_header_bytes, int)
            or not 2 * _HEADER_RESERVE_BYTES <= self.max_header_bytes <= SAFETENSORS_MAX_HEADER_BYTES
        ):
            raise ConfigError(
                f"max_header_bytes must be an integer from {2 * _HEADER_RESERVE_BYTES} to "
                f"{SAFETENSORS_MAX_HEADER_BYTES} (safetensors' limit), got {self.max_header_bytes!r}"
            )


def _entry_bytes(name: str, tensor: torch.Tensor) -> int:
    """Upper bound of ``name``'s entry in a safetensors header (JSON escaping included)."""
    quoted = (
        len(name) + 2
        if name.isascii() and name.isprintable() and '"' not in name and "\\" not in name
        else len(json.dumps(name))
    )  # ASCII escapes are never shorter than serde's UTF-8
    return quoted + _ENTRY_FIXED_BYTES + 21 * tensor.dim()


def split_into_parts(tensors: dict[str, torch.Tensor], limits: ShardLimits) -> list[list[str]]:
    """Group tensor names into files, in order, each within ``limits``.

    Args:
        tensors: name -> tensor as it will be stored (any device; only sizes are read).
        limits: the file and header budgets.

    Returns:
        Lists of names, one per file; ``[[]]`` when there are no tensors (one empty file).
    """
    parts: list[list[str]] = [[]]
    header_budget = limits.max_header_bytes - _HEADER_RESERVE_BYTES
    header = data = 0
    for name, tensor in tensors.items():
        entry = _entry_bytes(name, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        too_big = (
            header + entry > header_budget
            or 8 + _HEADER_RESERVE_BYTES + header + entry + data + nbytes > limits.max_file_size_bytes
        )
        if parts[-1] and too_big:
            parts.append([])
            header = data = 0
        parts[-1].append(name)
        header += entry
        data += nbytes
    return parts


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def decode_shard(data: bytes, record: FileRecord, *, where: str) -> dict[str, torch.Tensor]:
    """Verify ``data`` against its manifest record, then parse it.

    Raises:
        CorruptShardError: size or SHA-256 differs from the record, or the bytes are not a
            safetensors file this reader can decode (a dtype code it does not know, say).
            ``where`` (the object's URI) is named in the message.
    """
    if len(data) != record.size_bytes:
        raise CorruptShardError(f"{where}: {len(data)} bytes, manifest recorded {record.size_bytes}")
    if record.algorithm != "sha256":
        raise CorruptShardError(f"{where}: decode_shard verifies whole-file sha256 records, not {record.algorithm}")
    digest = sha256_hex(data)
    if digest != record.digest:
        raise CorruptShardError(f"{where}: sha256 {digest} does not match the manifest's {record.digest}")
    try:
        return safetensors_load(data)
    except (SafetensorError, KeyError, ValueError, TypeError, RuntimeError, OverflowError) as exc:
        # KeyError: safetensors' torch wrapper meets a dtype code it cannot map (F8_E8M0).
        raise CorruptShardError(
            f"{where}: not a safetensors file this reader can decode: {type(exc).__name__}: {exc}"
        ) from exc

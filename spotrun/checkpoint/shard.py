"""One rank's shard file: safetensors bytes, checksum, verification.

safetensors requires header metadata values to be strings (field case C11): every
value is converted with ``str`` here and a non-string key is refused, so a file that
cannot be read back is never written. A rank that owns no tensors still writes a
valid, openable shard (an empty safetensors file), and the manifest lists it.
"""

from __future__ import annotations

import hashlib

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from spotrun.errors import CorruptShardError, StateSerializationError
from spotrun.manifest import FileRecord, TensorRecord


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def tensor_record(tensor: torch.Tensor, file: str) -> TensorRecord:
    """Manifest entry of a whole tensor stored in ``file``."""
    return TensorRecord(file=file, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape))


def encode_shard(tensors: dict[str, torch.Tensor], metadata: dict[str, object]) -> bytes:
    """Serialise CPU tensors into safetensors bytes.

    Args:
        tensors: name -> contiguous CPU tensor (any shape and safetensors-supported dtype).
        metadata: header metadata; values are converted to ``str``.

    Raises:
        StateSerializationError: a metadata key is not a string, or safetensors refuses a
            tensor (unsupported dtype); the message names it.
    """
    header: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise StateSerializationError(f"safetensors metadata key {key!r} is not a string")
        header[key] = value if isinstance(value, str) else str(value)
    try:
        return safetensors_save(tensors, metadata=header)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise StateSerializationError(f"safetensors cannot store this shard: {exc}") from exc


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def decode_shard(data: bytes, record: FileRecord, *, where: str) -> dict[str, torch.Tensor]:
    """Verify ``data`` against its manifest record, then parse it.

    Raises:
        CorruptShardError: size or SHA-256 differs from the record, or the bytes are not a
            valid safetensors file. ``where`` (the object's URI) is named in the message.
    """
    if len(data) != record.size_bytes:
        raise CorruptShardError(
            f"{where}: {len(data)} bytes, manifest recorded {record.size_bytes}"
        )
    digest = sha256_hex(data)
    if digest != record.sha256:
        raise CorruptShardError(
            f"{where}: sha256 {digest} does not match the manifest's {record.sha256}"
        )
    try:
        return safetensors_load(data)
    except (SafetensorError, ValueError) as exc:
        raise CorruptShardError(f"{where}: not a readable safetensors file: {exc}") from exc

"""Which tensor dtypes a checkpoint stores, and how they are written and read back.

Every dtype of the installed torch is **native** (safetensors' own dtype code), **bytes** (the
tensor's bytes as 1-D uint8, the manifest naming the real dtype: bit-exact, and independent of
the installed safetensors) or **refused** (:class:`~spotrun.errors.StateSerializationError`
before anything is written: quantized dtypes, dtypes torch cannot copy). The lists:
``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import functools
import math

import torch

from spotrun.checkpoint.manifest import STORED_AS_BYTES, TensorRecord
from spotrun.errors import CorruptShardError, StateSerializationError

_NATIVE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
#: Dtypes stored under their own safetensors code.
NATIVE_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name) for name in _NATIVE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
)
_QUANTIZED_NAMES = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype | None:
    """``"float32"`` -> ``torch.float32``; ``None`` when this torch has no such dtype."""
    value = getattr(torch, name, None) if name.isidentifier() else None
    return value if isinstance(value, torch.dtype) else None


@functools.cache
def refusal(dtype: torch.dtype) -> str | None:
    """Why tensors of ``dtype`` cannot be checkpointed, or ``None`` when they can."""
    try:
        probe = torch.empty(1, dtype=dtype)
        if dtype_name(dtype) in _QUANTIZED_NAMES or probe.is_quantized:
            return (
                "it is a quantized dtype, whose scale and zero point are not part of the "
                "tensor's bytes; store tensor.int_repr() and the quantization parameters instead"
            )
        probe.clone()
    except (RuntimeError, TypeError) as exc:  # NotImplementedError is a RuntimeError
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"torch {torch.__version__} cannot copy tensors of this dtype ({first_line})"
    return None


def check_storable(tensor: torch.Tensor, path: str) -> None:
    """Refuse a tensor whose dtype cannot be checkpointed.

    Raises:
        StateSerializationError: names ``path`` (the key) and the dtype.
    """
    reason = refusal(tensor.dtype)
    if reason is not None:
        raise StateSerializationError(
            f"state value {path!r} has dtype {tensor.dtype}, which spotrun cannot checkpoint: {reason}"
        )


@functools.cache
def stored_as(dtype: torch.dtype) -> str | None:
    """``None`` when ``dtype`` is stored natively, else ``"bytes"`` (see the module docstring)."""
    return None if dtype in NATIVE_DTYPES else STORED_AS_BYTES


def to_stored(tensor: torch.Tensor) -> torch.Tensor:
    """What goes into the shard for ``tensor`` (a view where possible, not a copy).

    Conjugate and negative views are resolved first (their bits are not the values).
    Returns the tensor itself for native dtypes, else its bytes as a 1-D uint8 tensor
    (``numel * itemsize`` elements, in memory order of the contiguous tensor).
    """
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.dtype in NATIVE_DTYPES:
        return t
    return t.contiguous().reshape(-1).view(torch.uint8)


def tensor_record(tensor: torch.Tensor, file: str) -> TensorRecord:
    """Manifest entry of a whole ``tensor`` (the original, not its stored form) in ``file``."""
    return TensorRecord(
        file=file, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), stored_as=stored_as(tensor.dtype)
    )


def from_stored(stored: torch.Tensor, record: TensorRecord, *, where: str) -> torch.Tensor:
    """Rebuild a tensor from what a shard holds, checked against its manifest record.

    Args:
        stored: the tensor read from the shard.
        record: its manifest record (dtype, shape, ``stored_as``).
        where: names the tensor in error messages (file and key).

    Returns:
        A tensor of ``record.dtype`` and ``record.shape``.

    Raises:
        CorruptShardError: the dtype is unknown to this torch or refused, or the stored
            tensor does not match the record (dtype, shape, byte count).
    """
    dtype = dtype_from_name(record.dtype)
    if dtype is None:
        raise CorruptShardError(
            f"{where}: dtype {record.dtype!r} is not a dtype torch {torch.__version__} has, so it "
            "cannot be decoded (was the checkpoint written with a newer torch?)"
        )
    reason = refusal(dtype)
    if reason is not None:
        raise CorruptShardError(f"{where}: dtype {record.dtype} cannot be decoded: {reason}")
    if record.stored_as is None:
        if stored.dtype != dtype or list(stored.shape) != record.shape:
            raise CorruptShardError(
                f"{where}: stored as {dtype_name(stored.dtype)}{list(stored.shape)}, "
                f"manifest says {record.dtype}{record.shape}"
            )
        return stored
    nbytes = math.prod(record.shape) * dtype.itemsize
    if stored.dtype != torch.uint8 or stored.dim() != 1 or stored.numel() != nbytes:
        raise CorruptShardError(
            f"{where}: stored as {dtype_name(stored.dtype)}{list(stored.shape)}, manifest says the "
            f"{nbytes} bytes of a {record.dtype}{record.shape} tensor"
        )
    if stored.data_ptr() % max(dtype.itemsize, 1):
        stored = stored.clone()  # a view to a wider dtype needs an aligned start
    try:
        return stored.view(dtype).reshape(record.shape)
    except RuntimeError as exc:
        raise CorruptShardError(f"{where}: cannot view its bytes as {record.dtype}{record.shape}: {exc}") from exc

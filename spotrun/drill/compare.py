"""The drill's exact check: one step of two checkpoint roots compared bit for bit
(:func:`compare_steps`), the replicated state once and every rank's own state (its RNGs
included). Tensors must agree in dtype, shape and bytes (so a NaN equals the same NaN and
``-0.0`` differs from ``0.0``), JSON values in type and value (floats bit for bit).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from spotrun.checkpoint import catalog
from spotrun.checkpoint.restore import load_step
from spotrun.storage import Storage


@dataclass(frozen=True)
class Difference:
    """One value that differs between the resumed run's step and the reference run's.

    Attributes:
        key: key path of the value: ``model/layer.weight`` for the replicated state,
            ``rank 1/rng/torch_cpu`` for rank 1's own state.
        what: how it differs (``3 of 64 element(s) differ``, ``dtype float32 vs float64``,
            ``1 vs 2``, ``only in the reference run``, ...); the resumed run's value first.
        max_abs_diff: for floating-point tensors and floats, the largest absolute
            difference over the elements that are not NaN in either (0.0 when only the bits
            differ, e.g. ``-0.0`` vs ``0.0``); ``None`` for other values or when no
            finite difference exists.
        max_relative_diff: ``max_abs_diff`` relative to the value's scale (the largest
            magnitude in the reference tensor, or of the two floats); ``None`` where
            ``max_abs_diff`` is or the scale is 0. About 1e-7 for float32 values that were
            rounded differently once. Not part of equality.
    """

    key: str
    what: str
    max_abs_diff: float | None = None
    max_relative_diff: float | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The difference as JSON values."""
        return {
            "key": self.key,
            "what": self.what,
            "max_abs_diff": self.max_abs_diff,
            "max_relative_diff": self.max_relative_diff,
        }

    def __str__(self) -> str:
        extra = "" if self.max_abs_diff is None else f", max abs difference {self.max_abs_diff:.3g}"
        if self.max_relative_diff is not None:
            extra += f" ({self.max_relative_diff:.2g} of its scale)"
        return f"{self.key}: {self.what}{extra}"


def compare_states(resumed: Any, reference: Any, path: str = "") -> list[Difference]:
    """Compare two decoded states (as :func:`spotrun.checkpoint.restore.load_step` returns
    them) recursively, bit for bit.

    Args:
        resumed: the value saved by the resumed run.
        reference: the value saved by the uninterrupted reference run.
        path: key path of these values, prefixed to every reported key.

    Returns:
        Every difference, in the order of ``resumed``'s keys; empty when both are identical.
        Tensors are compared on the CPU (dtype, shape, then bytes); dict keys of different
        types (``1`` and ``"1"``) are different keys; a tuple never equals a list.
    """
    differences: list[Difference] = []
    _compare(resumed, reference, path, differences)
    return differences


def compare_steps(resumed: Storage, reference: Storage, step: int) -> list[Difference]:
    """Compare ``step`` under two checkpoint roots for every rank of its world size.

    Loads (and so verifies) the step for each rank from both roots, one rank at a time:
    the replicated state is compared once (it is the same for every rank), each rank's
    own state (RNGs included) under ``rank R/``.

    Returns:
        Every difference (see :func:`compare_states`); empty when the step is bit-identical.
        Different world sizes give a single difference of key ``world_size``.

    Raises:
        ObjectNotFoundError: a root lacks the step's manifest or a file it lists.
        ManifestError, CorruptShardError: a manifest or shard is malformed or fails its checksum.
        StorageError: a read failed.
    """
    resumed_info = catalog.committed(resumed, step)
    reference_info = catalog.committed(reference, step)
    world_size = resumed_info.manifest.world_size
    reference_world_size = reference_info.manifest.world_size
    if reference_world_size != world_size:
        return [Difference("world_size", f"{world_size} vs {reference_world_size} rank(s)")]
    differences: list[Difference] = []
    for rank in range(world_size):
        got = load_step(resumed, step, resumed_info.manifest_key, rank, world_size)
        expected = load_step(reference, step, reference_info.manifest_key, rank, world_size)
        if rank == 0:
            differences += compare_states(got.replicated, expected.replicated)
        differences += compare_states(got.rank_local, expected.rank_local, f"rank {rank}")
    return differences


def _join(path: str, key: object) -> str:
    return str(key) if not path else f"{path}/{key}"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _compare(a: Any, b: Any, path: str, out: list[Difference]) -> None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        difference = _compare_tensors(a, b, path)
        if difference is not None:
            out.append(difference)
    elif type(a) is not type(b):
        out.append(Difference(path, f"{type(a).__name__} {_describe(a)} vs {type(b).__name__} {_describe(b)}"))
    elif isinstance(a, dict):
        for key, value in a.items():
            if key in b:
                _compare(value, b[key], _join(path, key), out)
            else:
                out.append(Difference(_join(path, key), "only in the resumed run"))
        out.extend(Difference(_join(path, key), "only in the reference run") for key in b if key not in a)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(Difference(path, f"length {len(a)} vs {len(b)}"))
            return
        for index, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, _join(path, index), out)
    elif isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b):
            gap = abs(a - b)
            if math.isfinite(gap):
                out.append(Difference(path, f"{a!r} vs {b!r}", gap, _relative(gap, max(abs(a), abs(b)))))
            else:
                out.append(Difference(path, f"{a!r} vs {b!r}"))
    elif a != b:
        out.append(Difference(path, f"{_describe(a)} vs {_describe(b)}"))


def _compare_tensors(a: torch.Tensor, b: torch.Tensor, path: str) -> Difference | None:
    if a.dtype != b.dtype:
        return Difference(path, f"dtype {str(a.dtype).removeprefix('torch.')} vs {str(b.dtype).removeprefix('torch.')}")
    if a.shape != b.shape:
        return Difference(path, f"shape {list(a.shape)} vs {list(b.shape)}")
    a_bytes, b_bytes = _element_bytes(a), _element_bytes(b)
    if torch.equal(a_bytes, b_bytes):
        return None
    differing = int((a_bytes != b_bytes).any(dim=1).sum())
    max_abs_diff = max_relative_diff = None
    if a.is_floating_point():
        reference = b.detach().cpu().double().reshape(-1)
        gap = (a.detach().cpu().double().reshape(-1) - reference).abs()
        gap = gap[~torch.isnan(gap)]
        if gap.numel() and math.isfinite(float(gap.max())):
            max_abs_diff = float(gap.max())
            finite = reference[torch.isfinite(reference)].abs()
            max_relative_diff = _relative(max_abs_diff, float(finite.max()) if finite.numel() else 0.0)
    return Difference(path, f"{differing} of {a.numel()} element(s) differ", max_abs_diff, max_relative_diff)


def _relative(gap: float, scale: float) -> float | None:
    if scale > 0:
        return gap / scale
    return 0.0 if gap == 0 else None  # a value that should be 0 is not: no scale to compare with


def _element_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, one row per element: uint8 of shape (numel, element size)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), tensor.element_size())

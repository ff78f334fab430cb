"""What ``spotrun export --format hf`` writes, decided from a manifest alone (no tensor is read).

Hugging Face's sharded safetensors layout, as ``huggingface_hub`` and ``transformers`` write
it: ``model-0000i-of-0000K.safetensors`` files of at most ``max_shard_size`` and
``model.safetensors.index.json``, tied weights copied (``copy``) or written once (``drop``).
The layout and the loaders each form suits: ``docs/design/internals.md`` (Export).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from spotrun.checkpoint.dtypes import dtype_from_name
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.stream import SAFETENSORS_CODES
from spotrun.errors import ExportError

#: Hugging Face's name of an unsharded model's file (an earlier export may have left one).
SINGLE_FILE_NAME = "model.safetensors"
#: The index of a sharded model.
INDEX_NAME = "model.safetensors.index.json"
#: The names of files an export writes (and ``--overwrite`` replaces); others are never touched.
WEIGHT_FILE_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")
#: How tied tensors are written (see the module docstring).
TIED_MODES = ("copy", "drop")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5,000,000,000 bytes, as Hugging Face counts: KB/MB/GB/TB are powers of
    1000, KiB/MiB/GiB/TiB powers of 1024; a bare number is bytes.

    Raises:
        ExportError: not a size, or less than 1 byte.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ExportError(f"--max-shard-size {text!r} is not a size such as 5GB, 500MB or 2GiB")
    size_bytes = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if size_bytes < 1:
        raise ExportError(f"--max-shard-size {text!r} is less than one byte")
    return size_bytes


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor of the exported files.

    Attributes:
        key: its name in the files (a ``state_dict()`` key).
        source: the manifest's name of the tensor that holds its values (aliases resolved).
        dtype: its dtype (one safetensors stores natively).
        shape: its global shape.
    """

    key: str
    source: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ExportShard:
    """One output file and the tensors it holds, in order."""

    filename: str
    tensors: tuple[ExportedTensor, ...]

    @property
    def size_bytes(self) -> int:
        """Bytes of tensor data (the file adds its header)."""
        return sum(t.size_bytes for t in self.tensors)


@dataclass(frozen=True)
class ExportPlan:
    """Every file of an export.

    Attributes:
        step: the checkpoint step exported.
        state_name: the top-level state exported (``model``).
        shards: the safetensors files, in order.
        tied: key -> the key whose tensor it shares (``copy``: both written; ``drop``: left out).
        dropped_tied: whether tied keys were left out (``drop``).
        skipped: keys of the state that are not tensors (JSON values), not exported.
    """

    step: int
    state_name: str
    shards: tuple[ExportShard, ...]
    tied: dict[str, str] = field(default_factory=dict)
    dropped_tied: bool = False
    skipped: tuple[str, ...] = ()

    @property
    def total_size_bytes(self) -> int:
        """Bytes of tensor data in all files: the index's ``metadata.total_size``."""
        return sum(s.size_bytes for s in self.shards)

    @property
    def filenames(self) -> list[str]:
        """Every file written: the shards, then the index when there is more than one."""
        names = [s.filename for s in self.shards]
        return names + [INDEX_NAME]

    def metadata(self) -> dict[str, str]:
        """The safetensors header metadata of every file."""
        meta = {"format": "pt"}
        if self.dropped_tied:
            meta.update(self.tied)
        return meta

    def index_json(self) -> bytes:
        """``model.safetensors.index.json``."""
        weight_map = {t.key: s.filename for s in self.shards for t in s.tensors}
        doc: dict[str, Any] = {"metadata": {"total_size": self.total_size_bytes}, "weight_map": weight_map}
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def plan_export(manifest: Manifest, state_name: str, max_shard_size_bytes: int, tied: str = "copy") -> ExportPlan:
    """Plan the export of ``manifest.state[state_name]``'s tensors (see the module docstring).

    Args:
        manifest: the step's manifest.
        state_name: top-level state name (the key of ``Checkpointer(state={...})``).
        max_shard_size_bytes: most bytes of tensor data per file (a larger tensor gets a
            file of its own).
        tied: ``"copy"`` or ``"drop"``.

    Raises:
        ExportError: no such state (the message lists those there are), a state without
            tensors, two keys that flatten to one name, a dtype safetensors cannot hold.
    """
    if tied not in TIED_MODES:
        raise ExportError(f"tied must be one of {TIED_MODES}, got {tied!r}")
    if state_name not in manifest.state:
        raise ExportError(
            f"step {manifest.step} has no state {state_name!r}; its states are "
            f"{', '.join(sorted(manifest.state)) or '(none)'} (choose one with --state)"
        )
    leaves: list[tuple[str, str]] = []
    skipped: list[str] = []
    _flatten(manifest.state[state_name], "", leaves, skipped)
    if not leaves:
        raise ExportError(f"state {state_name!r} of step {manifest.step} holds no tensors")
    tensors, tied_keys = _resolve(manifest, state_name, leaves)
    if tied == "drop":
        tensors = [t for t in tensors if t.key not in tied_keys]
    return ExportPlan(
        step=manifest.step,
        state_name=state_name,
        shards=_shards(tensors, max_shard_size_bytes),
        tied=tied_keys,
        dropped_tied=tied == "drop",
        skipped=tuple(skipped),
    )


def _flatten(node: Any, path: str, leaves: list[tuple[str, str]], skipped: list[str]) -> None:
    """Collect ``(key, manifest tensor name)`` of every tensor in a state skeleton
    (:mod:`spotrun.checkpoint.tree`), keys joined with ``.``; non-tensor leaves go to ``skipped``."""

    def child(name: object) -> str:
        return f"{path}.{name}" if path else str(name)

    if isinstance(node, dict) and len(node) == 1 and "__tensor__" in node:
        leaves.append((path, node["__tensor__"]))
    elif isinstance(node, dict) and len(node) == 1 and "__tuple__" in node:
        for i, item in enumerate(node["__tuple__"]):
            _flatten(item, child(i), leaves, skipped)
    elif isinstance(node, dict) and len(node) == 1 and "__dict__" in node:
        for k, item in node["__dict__"]:
            _flatten(item, child(k), leaves, skipped)
    elif isinstance(node, dict) and not (len(node) == 1 and "__float__" in node):
        for k, item in node.items():
            _flatten(item, child(k), leaves, skipped)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            _flatten(item, child(i), leaves, skipped)
    else:
        skipped.append(path)


def _resolve(
    manifest: Manifest, state_name: str, leaves: list[tuple[str, str]]
) -> tuple[list[ExportedTensor], dict[str, str]]:
    """Each key's tensor record, checked; and which keys are tied to which."""
    tensors: list[ExportedTensor] = []
    seen: set[str] = set()
    key_of_source = {name: key for key, name in leaves}  # a stored (canonical) name -> its own key
    first_key: dict[str, str] = {}
    tied: dict[str, str] = {}
    for key, name in leaves:
        if key in seen:
            raise ExportError(f"state {state_name!r}: two values flatten to the name {key!r}")
        seen.add(key)
        source = manifest.aliases.get(name, name)
        record = manifest.tensors.get(source)
        if record is None:
            raise ExportError(f"step {manifest.step}: the manifest lists no tensor {source!r} (for {key!r})")
        dtype = dtype_from_name(record.dtype)
        if dtype not in SAFETENSORS_CODES:
            exportable = ", ".join(sorted(str(d).removeprefix("torch.") for d in SAFETENSORS_CODES))
            raise ExportError(
                f"tensor {key!r} has dtype {record.dtype}, which a safetensors file cannot hold "
                f"for every reader; exportable dtypes: {exportable}"
            )
        tensors.append(ExportedTensor(key, source, dtype, tuple(record.shape)))
        kept = key_of_source.get(source) or first_key.setdefault(source, key)
        if kept != key:
            tied[key] = kept
    return tensors, tied


def _shards(tensors: list[ExportedTensor], max_shard_size_bytes: int) -> tuple[ExportShard, ...]:
    """Tensors into files as Hugging Face splits them: in order, a tensor that would take the
    open file past the limit starts the next one; a tensor over the limit gets a file of its own
    at once (before the open file is closed), so no file is cut short for it."""
    groups: list[list[ExportedTensor]] = []
    current: list[ExportedTensor] = []
    current_bytes = 0
    for tensor in tensors:
        if tensor.size_bytes > max_shard_size_bytes:
            groups.append([tensor])
            continue
        if current and current_bytes + tensor.size_bytes > max_shard_size_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += tensor.size_bytes
    if current:
        groups.append(current)
    count = len(groups)
    return tuple(ExportShard(f"model-{i + 1:05d}-of-{count:05d}.safetensors", tuple(g)) for i, g in enumerate(groups))

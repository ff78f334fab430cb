"""Split a nested state (``state_dict()`` output) into a JSON skeleton and named tensors.

``encode(value, prefix)`` -> ``(skeleton, tensors)``, every tensor replaced by
``{"__tensor__": name}``; ``decode(skeleton, tensors)`` rebuilds the value, types included
(``int`` keys, tuples, non-finite floats). Anything else raises
:class:`~spotrun.errors.StateSerializationError` naming its key, before a byte is written.
The skeleton tags: ``docs/design/internals.md`` (State).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from spotrun.checkpoint.dtypes import check_storable
from spotrun.checkpoint.strict_json import MAX_DEPTH
from spotrun.errors import ManifestError, StateSerializationError

_TAGS = ("__tensor__", "__tuple__", "__dict__", "__float__")
#: Deepest nesting of a skeleton's JSON (a tuple takes two levels, a dict with int keys three):
#: a manifest holds each skeleton three levels down (``rank_state``, its rank, the name) and a
#: reader refuses a manifest nested deeper than :data:`~spotrun.checkpoint.strict_json.MAX_DEPTH`,
#: so a deeper state is refused when it is saved, not when it is needed.
MAX_SKELETON_DEPTH = MAX_DEPTH - 3


def _plain_key(key: object) -> bool:
    return type(key) is str and not (key.startswith("__") and key.endswith("__"))


def encode(value: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Encode ``value``; tensor names are ``prefix/<path>``.

    Args:
        value: nested dict/list/tuple of tensors, str, int, float, bool and None.
        prefix: name of the whole value, e.g. ``"model"``; also used in error messages.

    Returns:
        ``(skeleton, tensors)``: JSON-serialisable skeleton, and tensors by name (the
        caller's tensors, not copies).

    Raises:
        StateSerializationError: a value of another type, or nested deeper than
            :data:`MAX_SKELETON_DEPTH`; the message names its key path.
    """
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(value, prefix, tensors, 0)
    return skeleton, tensors


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    """``depth``: the JSON levels around ``value`` in the skeleton."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise StateSerializationError(
                f"state value {path!r} is a {value.layout} tensor; only dense tensors can be saved"
            )
        check_storable(value, path)
        if path in tensors:
            raise StateSerializationError(f"two tensors would be stored under the name {path!r}")
        _check_depth(depth + 1, path)
        tensors[path] = value
        return {"__tensor__": path}
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, dict):
        if all(_plain_key(k) for k in value):
            _check_depth(depth + 1, path)
            return {k: _encode(v, f"{path}/{k}", tensors, depth + 1) for k, v in value.items()}
        _check_depth(depth + 3, path)
        items = []
        for k, v in value.items():
            if type(k) not in (str, int):
                raise StateSerializationError(
                    f"state key {k!r} under {path!r} is a {type(k).__name__}; keys must be str or int"
                )
            items.append([k, _encode(v, f"{path}/{k}", tensors, depth + 3)])
        return {"__dict__": items}
    if isinstance(value, list):
        _check_depth(depth + 1, path)
        return [_encode(v, f"{path}/{i}", tensors, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        _check_depth(depth + 2, path)
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors, depth + 2) for i, v in enumerate(value)]}
    raise StateSerializationError(
        f"state value {path!r} has type {type(value).__module__}.{type(value).__qualname__}, "
        "which is neither a tensor nor JSON-serialisable (str, int, float, bool, None, "
        "list, tuple, dict); convert it to one of those or to a tensor"
    )


def _check_depth(depth: int, path: str) -> None:
    if depth > MAX_SKELETON_DEPTH:
        raise StateSerializationError(
            f"state value {path[:200]!r} is nested more than {MAX_SKELETON_DEPTH} levels deep (a tuple takes "
            "two levels, a dict with int keys three); a checkpoint holds no deeper state"
        )


def tensor_names(skeleton: Any) -> list[str]:
    """Names of every tensor a skeleton refers to, in order of appearance."""
    names: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "__tensor__" in node and len(node) == 1:
                names.append(node["__tensor__"])
                return
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(skeleton)
    return names


def decode(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the value that :func:`encode` turned into ``skeleton``.

    Raises:
        ManifestError: the skeleton is malformed or names a tensor missing from ``tensors``.
    """
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        if skeleton is None or type(skeleton) in (bool, int, float, str):
            return skeleton
        raise ManifestError(f"unexpected value of type {type(skeleton).__name__} in a state skeleton")
    if len(skeleton) == 1:
        ((tag, body),) = skeleton.items()
        if tag == "__tensor__":
            try:
                return tensors[body]
            except (KeyError, TypeError):
                raise ManifestError(f"state refers to tensor {body!r}, which was not loaded") from None
        if tag == "__tuple__":
            _expect(isinstance(body, list), "__tuple__ must hold a list")
            return tuple(decode(v, tensors) for v in body)
        if tag == "__dict__":
            _expect(
                isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body),
                "__dict__ must hold [key, value] pairs",
            )
            return {k: decode(v, tensors) for k, v in body}
        if tag == "__float__":
            _expect(body in ("nan", "inf", "-inf"), f"bad __float__ value {body!r}")
            return float(body)
    if any(k in _TAGS for k in skeleton):
        raise ManifestError(f"malformed tagged value in a state skeleton: keys {sorted(skeleton)}")
    return {k: decode(v, tensors) for k, v in skeleton.items()}


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ManifestError(f"malformed state skeleton: {message}")

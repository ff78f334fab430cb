"""The ``state_dict()`` / ``load_state_dict()`` protocol (torch DCP's ``Stateful``) and plain dicts."""

from __future__ import annotations

from typing import Any

import torch

from spotrun.errors import ConfigError, StateMismatchError

#: The attribute (and state_dict key segment) under which ``torch.compile`` keeps a module.
COMPILED_SEGMENT = "_orig_mod"


def _uncompiled(obj: Any) -> Any:
    """The module under ``torch.compile``'s wrapper (``OptimizedModule._orig_mod``), else ``obj``
    (duck-typed: importing dynamo takes seconds)."""
    while isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, COMPILED_SEGMENT, None), torch.nn.Module):
        obj = obj._orig_mod
    return obj


def _uncompiled_key(key: Any) -> Any:
    if type(key) is not str or COMPILED_SEGMENT not in key:
        return key
    return ".".join(part for part in key.split(".") if part != COMPILED_SEGMENT)


def _uncompiled_keys(value: Any) -> Any:
    """A module state with every ``_orig_mod`` key segment dropped: a model (or a submodule of
    it) is saved under the same keys compiled or not, so a run may turn ``torch.compile`` on
    or off between restarts, and exports see plain names."""
    if not isinstance(value, dict) or not any(_uncompiled_key(k) != k for k in value):
        return value
    return type(value)((_uncompiled_key(k), v) for k, v in value.items())


def state_of(obj: Any) -> Any:
    """``obj.state_dict()`` when it has one, else ``obj`` itself (a plain dict of tensors and JSON);
    a module's keys as if nothing in it were compiled."""
    obj = _uncompiled(obj)
    state_dict = getattr(obj, "state_dict", None)
    if not callable(state_dict):
        return obj
    return _uncompiled_keys(state_dict()) if isinstance(obj, torch.nn.Module) else state_dict()


def load_into(name: str, obj: Any, value: Any) -> None:
    """Load ``value`` (a restored state) into ``obj``, named ``name`` in the checkpoint.

    Raises:
        StateMismatchError: ``obj.load_state_dict`` refused the value (other keys or shapes).
        ConfigError: ``obj`` has no ``load_state_dict`` and is not a dict.
    """
    obj = _uncompiled(obj)
    if isinstance(obj, torch.nn.Module) and isinstance(value, dict):
        # saved keys (compiled or not, by this spotrun or an older one) -> the live module's keys
        live = {_uncompiled_key(k): k for k in obj.state_dict()}
        value = type(value)((live.get(_uncompiled_key(k), k), v) for k, v in value.items())
    load = getattr(obj, "load_state_dict", None)
    if callable(load):
        try:
            load(value)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise StateMismatchError(f"cannot load saved state {name!r}: {exc}") from exc
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(value)
    else:
        raise ConfigError(f"state {name!r} ({type(obj).__name__}) has no load_state_dict()")

"""The ``state_dict()`` / ``load_state_dict()`` protocol (torch DCP's ``Stateful``) and plain dicts."""

from __future__ import annotations

from typing import Any

from spotrun.errors import ConfigError, StateMismatchError


def state_of(obj: Any) -> Any:
    """``obj.state_dict()`` when it has one, else ``obj`` itself (a plain dict of tensors and JSON)."""
    state_dict = getattr(obj, "state_dict", None)
    return state_dict() if callable(state_dict) else obj


def load_into(name: str, obj: Any, value: Any) -> None:
    """Load ``value`` (a restored state) into ``obj``, named ``name`` in the checkpoint.

    Raises:
        StateMismatchError: ``obj.load_state_dict`` refused the value (other keys or shapes).
        ConfigError: ``obj`` has no ``load_state_dict`` and is not a dict.
    """
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

"""The saved form of a data loader's position: parsing, checking and converting it.

:meth:`spotrun.data.loader.ResumableDataLoader.state_dict` writes version 2, the *global* position of
the data order, so that a run can resume at another world size; version 1 (per-rank batches)
is converted on load, always exactly. The fields and the conversion:
``docs/design/internals.md`` (Data).
"""

from __future__ import annotations

from typing import Any

from spotrun.errors import StateMismatchError

#: Version of the dict returned by ``ResumableDataLoader.state_dict``.
STATE_VERSION = 2

_FIELDS_V2: dict[str, type] = {
    "version": int,
    "epoch": int,
    "global_samples_consumed": int,
    "seed": int,
    "global_batch_size": int,
    "dataset_len": int,
    "shuffle": bool,
    "drop_last": bool,
    "world_size": int,
}
_FIELDS_V1: dict[str, type] = {
    "version": int,
    "epoch": int,
    "batches_consumed": int,
    "seed": int,
    "num_replicas": int,
    "batch_size": int,
    "dataset_len": int,
    "shuffle": bool,
    "drop_last": bool,
}
#: Settings that fix the global order: a resume needs every one of them unchanged.
MUST_MATCH = ("global_batch_size", "dataset_len", "seed", "shuffle", "drop_last")
_AT_LEAST = {
    "epoch": 0,
    "global_samples_consumed": 0,
    "batches_consumed": 0,
    "dataset_len": 0,
    "global_batch_size": 1,
    "world_size": 1,
    "num_replicas": 1,
    "batch_size": 1,
}


def parse_state(state: Any) -> dict[str, Any]:
    """Check a saved loader state and return it in version-2 form (version 1 converted).

    Args:
        state: what ``state_dict()`` returned, possibly an older version, read back from JSON.

    Returns:
        A new dict with exactly the version-2 fields.

    Raises:
        StateMismatchError: not a dict, an unknown version, a missing, unknown or mistyped
            field (``True`` is not an int here), or a count out of range; the message names it.
    """
    if not isinstance(state, dict):
        raise StateMismatchError(f"data loader state must be a dict, got {type(state).__name__}")
    version = state.get("version")
    if type(version) is not int or version not in (1, STATE_VERSION):
        raise StateMismatchError(f"data loader state version {version!r} is not 1 or {STATE_VERSION}")
    fields = _FIELDS_V1 if version == 1 else _FIELDS_V2
    unknown = sorted(set(state) - set(fields))
    if unknown:
        raise StateMismatchError(f"data loader state has unknown fields {unknown}")
    for key, kind in fields.items():
        if key not in state:
            raise StateMismatchError(f"data loader state lacks the field {key!r}")
        if type(state[key]) is not kind:
            raise StateMismatchError(f"data loader state field {key!r} is {state[key]!r}, expected a {kind.__name__}")
        if key in _AT_LEAST and state[key] < _AT_LEAST[key]:
            raise StateMismatchError(
                f"data loader state field {key!r} is {state[key]}, expected at least {_AT_LEAST[key]}"
            )
    if version == STATE_VERSION:
        return dict(state)
    global_batch = state["batch_size"] * state["num_replicas"]
    return {
        "version": STATE_VERSION,
        "epoch": state["epoch"],
        "global_samples_consumed": state["batches_consumed"] * global_batch,
        "seed": state["seed"],
        "global_batch_size": global_batch,
        "dataset_len": state["dataset_len"],
        "shuffle": state["shuffle"],
        "drop_last": state["drop_last"],
        "world_size": state["num_replicas"],
    }


def mismatches(saved: dict[str, Any], own: dict[str, Any]) -> list[str]:
    """Each order setting that differs between a parsed saved state and this loader's, in words.

    ``own`` is this loader's version-2 state. A differing global batch also says whether the
    saved one could run at this world size at all, and how to ask for it.
    """
    problems = []
    for key in MUST_MATCH:
        if saved[key] == own[key]:
            continue
        if key != "global_batch_size":
            problems.append(f"{key} was {saved[key]!r} when saved, now {own[key]!r}")
            continue
        saved_g, world = saved[key], own["world_size"]
        text = f"global batch size was {saved_g} when saved, now {own[key]}"
        if saved_g % world:
            text += f" (and global batch {saved_g} does not divide by world size {world})"
        else:
            text += (
                f" (to keep the order pass global_batch_size={saved_g}, that is "
                f"batch_size={saved_g // world} per rank at world size {world})"
            )
        problems.append(text)
    return problems

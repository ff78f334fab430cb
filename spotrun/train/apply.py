"""Putting a loaded step into the training objects, and the live tensors a restore reads into.

The :class:`~spotrun.train.checkpointer.Checkpointer` holds two maps of name -> object: the
replicated ``state`` and this rank's ``rank_state`` (objects with ``state_dict()`` /
``load_state_dict()``, or plain dicts: :mod:`spotrun.state.stateful`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from spotrun.checkpoint import tree
from spotrun.checkpoint.encode import encode_state
from spotrun.checkpoint.restore import LoadedStep
from spotrun.checkpoint.sharded import is_dtensor, mesh_description
from spotrun.errors import ConfigError, ManifestError, SpotrunError, StateMismatchError
from spotrun.state.ddp_buckets import DDP_BUCKETS_STATE_NAME
from spotrun.state.numerics import NUMERICS_STATE_NAME
from spotrun.state.optimizer import OptimizerState
from spotrun.state.rng import reseed_new_rank
from spotrun.state.stateful import load_into, state_of
from spotrun.tools import dist

log = logging.getLogger(__name__)


def check_state_names(state: Any, rank_state: dict[str, Any] | None) -> None:
    """Refuse a Checkpointer's ``state`` that is not a non-empty dict, and a ``rank_state`` name spotrun uses."""
    if not isinstance(state, dict) or not state:
        raise ConfigError("Checkpointer(state=...) needs a non-empty dict of name -> object")
    for reserved in ("rng", NUMERICS_STATE_NAME, DDP_BUCKETS_STATE_NAME):
        if reserved in (rank_state or {}):
            raise ConfigError(f"rank_state name {reserved!r} is reserved for the state spotrun saves itself")


def check_serialisable(state: dict[str, Any], rank_state: dict[str, Any]) -> None:
    """Fail before training starts, not at the first save hours later.

    Raises:
        StateSerializationError: a value is neither a tensor nor JSON (names its key).
    """
    encode_state(
        {name: state_of(obj) for name, obj in state.items()},
        {name: state_of(obj) for name, obj in rank_state.items()},
        dist.rank(),
    )


def restore_destinations(
    state: dict[str, Any], rank_state: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The live tensors a restore reads into (:func:`live_tensors`), and the meshes of the
    DTensors among them (:func:`~spotrun.checkpoint.sharded.mesh_description`, each once).
    Optimizers that have not stepped get their state tensors first (placed like their
    parameters): call it once a step is to be loaded."""
    for obj in state.values():
        if isinstance(obj, OptimizerState):
            obj.prepare_for_restore()
    tensors = live_tensors(state, rank_state)
    meshes: list[dict[str, Any]] = []
    for tensor in tensors.values():
        if is_dtensor(tensor) and mesh_description(tensor) not in meshes:
            meshes.append(mesh_description(tensor))
    return tensors, meshes


def live_tensors(state: dict[str, Any], rank_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The objects' current tensors by encoded name (``model/layer.weight``), for a restore to
    read straight into (no copy through fresh memory); empty when the state cannot be encoded
    (:func:`check_serialisable` reports that)."""
    try:
        encoded = encode_state(
            {name: state_of(obj) for name, obj in state.items()},
            {name: state_of(obj) for name, obj in rank_state.items()},
            dist.rank(),
        )
    except SpotrunError:
        return {}
    return {**encoded.tensors, **encoded.sharded, **encoded.rank_tensors}


def _rank_0_json(loaded: LoadedStep, name: str) -> Any:
    """Rank 0's JSON-only rank state ``name`` of ``loaded``'s manifest (``None``: it has none, or
    a malformed one). Every rank restores DDP's bucket layout from rank 0's: ranks that built
    different buckets would abort at their first backward pass (gloo: "Received data size doesn't
    match"), and DDP itself takes rank 0's when it rebuilds them."""
    ranks = loaded.manifest.rank_state
    skeleton = ranks[0].get(name) if ranks and isinstance(ranks[0], dict) else None
    if skeleton is None:
        return None  # written before spotrun recorded it
    try:
        return tree.decode(skeleton, {})
    except ManifestError:
        log.warning("ignoring the checkpoint's %s: not plain JSON", name)
        return None


def apply_loaded(loaded: LoadedStep, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
    """``load_state_dict`` every object from ``loaded``; the rank's own state last (its RNGs:
    nothing may draw after them).

    Raises:
        StateMismatchError: a name the objects need is missing, or an object refuses its state.
        CorruptStateError: a generator refuses the saved RNG state (the step is damaged:
            :func:`~spotrun.checkpoint.restore.load_newest` falls back).
    """
    extra = sorted(set(loaded.replicated) - set(state))
    if extra and dist.rank() == 0:
        log.warning(
            "checkpoint step %d also holds state %s, which this job does not restore", loaded.manifest.step, extra
        )
    for name, obj in state.items():
        if name not in loaded.replicated:
            raise StateMismatchError(
                f"checkpoint step {loaded.manifest.step} has no state named {name!r} "
                f"(it has {sorted(loaded.replicated)})"
            )
        load_into(name, obj, loaded.replicated[name])
    for name, obj in rank_state.items():
        if name == DDP_BUCKETS_STATE_NAME:
            saved_by_rank_0 = _rank_0_json(loaded, name)
            if saved_by_rank_0 is not None:
                load_into(name, obj, saved_by_rank_0)
            continue
        if name == NUMERICS_STATE_NAME and name not in loaded.rank_local:
            continue  # written before spotrun recorded these settings
        if name not in loaded.rank_local:
            raise StateMismatchError(f"checkpoint lacks this rank's state {name!r}")
        load_into(name, obj, loaded.rank_local[name])
    saved, now, rank = loaded.manifest.world_size, dist.world_size(), dist.rank()
    if saved != now:
        if rank == 0:
            log.warning(
                "world size changed from %d to %d: rank r restores the RNG state (and rank_state) saved by "
                "rank r mod %d%s (spotrun.state.rng.reseed_new_rank). Random streams (dropout) now differ from "
                "an uninterrupted run; the data order does not",
                saved,
                now,
                saved,
                f"; ranks {saved} and up then reseed their generators from that state and their rank"
                if now > saved
                else "",
            )
        if rank >= saved and "rng" in rank_state:
            reseed_new_rank(rank)

"""Optimizer state keyed by parameter name, so it loads into any layout of the same model.

``Optimizer.state_dict()`` keys state by parameter position, so it loads back only into an
optimizer built the same way. :class:`OptimizerState` keys it by fully qualified name (through
``torch.distributed.checkpoint.state_dict``), so it loads into the same model however it is
sharded now, each rank saving and restoring only its part. The two exceptions that keep a run
exact, and :func:`prepare_for_restore`: ``docs/design/internals.md`` (State).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spotrun.errors import StateMismatchError


def _module_of(model: nn.Module) -> nn.Module:
    """The module under a ``DistributedDataParallel`` (or similar ``.module``) wrapper."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and not list(model.parameters(recurse=False)) else model


class OptimizerState:
    """``state_dict()`` / ``load_state_dict()`` of ``optimizer`` keyed by the parameter names
    of ``module`` (see the module docstring).

    Raises:
        StateMismatchError: on load, state that does not fit this optimizer.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not self.optimizer.state:
            return self._without_state()
        return get_optimizer_state_dict(self.module, self.optimizer)

    def _names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.module.named_parameters()}

    def _without_state(self) -> dict[str, Any]:
        names = self._names()
        groups = []
        for group in self.optimizer.param_groups:
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
            )
        return {"state": {}, "param_groups": groups}

    def prepare_for_restore(self) -> None:
        """Create the optimizer's state tensors, placed like their parameters (DCP's
        zero-gradient step at learning rate 0), for a restore to read into."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not self.optimizer.state:
            get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        groups = state.get("param_groups") if isinstance(state, dict) else None
        if not groups or not all(isinstance(p, str) for g in groups for p in g.get("params", [])):
            # keyed by position: saved before names were used (whole tensors); a parameter
            # sharded now gets its own part of each
            self.optimizer.load_state_dict(_placed_like_params(self.optimizer, state))
            return
        if not state.get("state"):  # never stepped when saved: no state to place
            ids = {
                name: i
                for i, name in enumerate(self._names()[id(p)] for g in self.optimizer.param_groups for p in g["params"])
            }
            try:
                positional = [{**g, "params": [ids[name] for name in g["params"]]} for g in groups]
            except KeyError as exc:
                raise StateMismatchError(
                    f"saved optimizer state names parameter {exc}, which this model lacks"
                ) from None
            self.optimizer.load_state_dict({"state": {}, "param_groups": positional})
            return
        set_optimizer_state_dict(self.module, self.optimizer, state)


def pair_optimizers(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each optimizer whose parameters all belong to one module of ``state``
    replaced by an :class:`OptimizerState` of the two (others stay as they are)."""
    modules = [_module_of(obj) for obj in state.values() if isinstance(obj, nn.Module)]
    paired = dict(state)
    for name, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        params = {id(p) for group in obj.param_groups for p in group["params"]}
        owners = [m for m in modules if params <= {id(p) for p in m.parameters()}]
        if len(owners) == 1:
            paired[name] = OptimizerState(owners[0], obj)
    return paired


def _placed_like_params(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """Position-keyed optimizer ``state`` with each whole tensor of a parameter's global shape
    replaced by a DTensor placed like that parameter, where the parameter is a DTensor."""
    from spotrun.checkpoint.sharded import is_dtensor, local_box

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(is_dtensor(p) for p in params) or not isinstance(state.get("state"), dict):
        return state
    from torch.distributed.tensor import DTensor

    placed = {}
    for key, values in state["state"].items():
        param = params[key] if isinstance(key, int) and 0 <= key < len(params) else None
        if param is None or not is_dtensor(param) or not isinstance(values, dict):
            placed[key] = values
            continue
        offsets, lengths = local_box(param)
        box = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
        placed[key] = {
            name: DTensor.from_local(
                value[box].clone(),
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
            if isinstance(value, torch.Tensor) and not is_dtensor(value) and value.shape == param.shape
            else value
            for name, value in values.items()
        }
    return {**state, "state": placed}

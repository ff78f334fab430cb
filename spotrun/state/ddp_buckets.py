"""DDP's gradient buckets across a restart, so that the first step after a resume sums the
gradients as an uninterrupted run does.

``DistributedDataParallel`` all-reduces gradients in flat buckets. A new DDP buckets the
parameters in reverse definition order; after its first step it rebuilds them in the order the
gradients became ready. On 3 or more ranks the ring all-reduce's summation order for an element
depends on its offset in the bucket, so the first step after a resume (a fresh DDP) summed in
another order than the uninterrupted run's step and drifted in the last bits (found by a user:
4 gloo ranks, losses 1e-7 off). :class:`DDPBucketsState` saves the rebuilt layout, as DDP's own
logging data reports it, and on restore gives a DDP that has not stepped yet a reducer built
with that layout, the way DDP builds one when it is unpickled. Where that cannot be done (a
communication hook, mixed precision, a torch whose DDP differs) it says so and leaves DDP alone.
"""

from __future__ import annotations

import gc
import inspect
import logging
import unittest.mock
import weakref
from typing import Any

import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spotrun.tools import dist

log = logging.getLogger(__name__)

#: The rank state name the layouts are saved under.
DDP_BUCKETS_STATE_NAME = "ddp_buckets"

#: What a reducer is rebuilt through (the torch versions spotrun checked: 2.13).
_INIT_HELPER_PARAMETERS = ["parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"]


def rebuilt_layout(ddp: DistributedDataParallel) -> list[list[int]] | None:
    """The parameter indices of each of ``ddp``'s buckets after its rebuild, in the reducer's
    order; ``None`` before DDP reported one (it reports at its first steps, then now and then)."""
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        return [[int(index) for index in bucket.split()] for bucket in text.split(",")]
    except ValueError:
        return None


def encode_layout(layout: list[list[int]]) -> str:
    """``layout`` as text: buckets split by ``,``, each a list of runs by one (``"9-4 0-3"``, a
    run from 9 down to 4, then 0 up to 3). DDP's rebuilt order is mostly the reverse of the
    definition order, so a model's layout is a few runs, not an index per parameter on every
    rank's record in the manifest."""
    buckets = []
    for bucket in layout:
        runs: list[list[int]] = []
        for index in bucket:
            if runs and len(runs[-1]) == 1 and abs(index - runs[-1][0]) == 1:
                runs[-1].append(index)
            elif runs and len(runs[-1]) == 2 and index - runs[-1][1] == (1 if runs[-1][1] > runs[-1][0] else -1):
                runs[-1][1] = index
            else:
                runs.append([index])
        buckets.append(" ".join("-".join(map(str, run)) for run in runs))
    return ", ".join(buckets)


def decode_layout(text: str, max_indices: int) -> list[list[int]]:
    """The layout :func:`encode_layout` wrote. Raises ``ValueError`` on other text, or on more
    than ``max_indices`` indices (a checkpoint is untrusted: a run of a billion is refused)."""
    layout, count = [], 0
    for bucket_text in text.split(","):
        bucket: list[int] = []
        for run in bucket_text.split():
            first, _, last = run.partition("-")
            start, stop = int(first), int(last or first)
            if start < 0 or stop < 0:
                raise ValueError(f"a negative index in {run!r}")
            count += abs(stop - start) + 1
            if count > max_indices:
                raise ValueError(f"more than {max_indices} indices")
            step = 1 if stop >= start else -1
            bucket.extend(range(start, stop + step, step))
        layout.append(bucket)
    return layout


def _why_not(ddp: DistributedDataParallel) -> str | None:
    """Why ``ddp``'s reducer cannot be rebuilt with a saved layout (``None``: it can)."""
    if getattr(ddp, "_comm_hooks", None):
        return "it has a communication hook"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "it runs in mixed precision"
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        return "it reduces in Python or after the backward pass"
    helper = getattr(ddp, "_ddp_init_helper", None)
    if (
        helper is None
        or list(inspect.signature(helper).parameters) != _INIT_HELPER_PARAMETERS
        or not hasattr(torch_dist, "_compute_bucket_assignment_by_size")
        or not hasattr(ddp, "_build_params_for_reducer")
        or not hasattr(ddp, "_build_debug_param_to_name_mapping")
    ):
        return "this torch builds DDP's reducer differently"
    return None


def apply_layout(ddp: DistributedDataParallel, layout: list[list[int]]) -> str | None:
    """Rebuild ``ddp``'s reducer with ``layout`` (as :func:`rebuilt_layout` gives it); ``None``
    when done, else why it was left alone."""
    if getattr(ddp, "_has_rebuilt_buckets", False):
        return None  # it stepped already: its own rebuild happened
    why = _why_not(ddp)
    if why is not None:
        return why
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    if sorted(index for bucket in layout for index in bucket) != list(range(len(parameters))) or not all(layout):
        return f"the saved layout does not fit its {len(parameters)} parameters"
    names = ddp._build_debug_param_to_name_mapping(parameters)

    def saved_assignment(*_args: Any, **_kwargs: Any) -> tuple[list[list[int]], list[int]]:
        # DDP reverses the buckets it gets (see DistributedDataParallel._ddp_init_helper)
        return [list(bucket) for bucket in reversed(layout)], [ddp.bucket_bytes_cap] * len(layout)

    # the old reducer's hooks and buffers go first: two reducers' buffers at once could not fit on a device
    ddp.reducer._remove_autograd_hooks()
    ddp.reducer = ddp.logger = None
    with unittest.mock.patch.object(torch_dist, "_compute_bucket_assignment_by_size", saved_assignment):
        ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)
    if ddp.static_graph:  # as DDP.__setstate__ does after the same call
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    return None


def _warn_if_parent(ddp: DistributedDataParallel, modules: dict[int, str]) -> None:
    """Say so when ``ddp`` wraps a module that holds state modules but is none itself: its
    buckets have no state name to be saved under."""
    held = sorted({modules[id(m)] for m in ddp.module.modules() if id(m) in modules})
    if held and dist.rank() == 0:
        log.warning(
            "a DistributedDataParallel wraps a module that holds state %s but is not itself a state entry: its "
            "gradient buckets are not saved, so the first step after a resume may differ from an uninterrupted "
            "run in the last bits on 3 or more ranks (give the Checkpointer the wrapped module, or the DDP, as "
            "one entry)",
            held,
        )


class DDPBucketsState:
    """A ``Stateful`` (rank state) for the bucket layouts of the DDP wrappers of a Checkpointer's
    modules (see the module docstring); a job without DDP saves an empty dict."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state
        self._found: list[tuple[str, weakref.ref[DistributedDataParallel]]] = []
        self._scans = 0
        self._layouts: dict[str, str] = {}  # by state name, as encode_layout writes them

    def state_dict(self) -> dict[str, Any]:
        for name, ddp in self._wrappers():
            if name not in self._layouts:  # fixed once rebuilt (DDP rebuilds once)
                layout = rebuilt_layout(ddp)
                if layout is not None:
                    self._layouts[name] = encode_layout(layout)
        return {"layouts": dict(self._layouts)}

    def load_state_dict(self, saved: Any) -> None:
        layouts = saved.get("layouts") if isinstance(saved, dict) else None
        if not isinstance(layouts, dict):
            log.warning("ignoring the checkpoint's DDP bucket layouts: not a dict")
            return
        wrapped = dict(self._wrappers(scan_again=True))
        for name, text in sorted(layouts.items()):  # none: saved before DDP rebuilt its buckets, or without DDP
            ddp = wrapped.get(name)
            if text is None:
                continue
            if ddp is None:
                why: str | None = "no DistributedDataParallel wraps it now: wrap it before the restore"
            elif not isinstance(text, str):
                why = f"the saved layout is a {type(text).__name__}, not text"
            else:
                try:
                    layout = decode_layout(text, max_indices=len(list(ddp.module.parameters())))
                except ValueError as exc:
                    why = f"the saved layout is not one: {exc}"
                else:
                    why = apply_layout(ddp, layout)
                    if why is None:  # its reducer runs with it now; DDP reports it only after its own rebuild
                        self._layouts[name] = text
            if why is not None and dist.rank() == 0 and dist.world_size() >= 3:  # 2 ranks sum either way alike
                log.warning(
                    "DDP's gradient buckets of state %r are not restored (%s): the first step after this resume "
                    "may differ from an uninterrupted run in the last bits on 3 or more ranks",
                    name,
                    why,
                )

    def _wrappers(self, scan_again: bool = False) -> list[tuple[str, DistributedDataParallel]]:
        """The DDP wrappers of the state's modules, by state name. Looked for by a scan of
        Python's objects (the state holds the module and DDP holds it, not the other way): at the
        first save, and again at a restore while none was found (a job may wrap after it built
        the Checkpointer); never at every save."""
        if not self._found and (self._scans == 0 or (scan_again and self._scans < 2)):
            self._scans += 1
            modules = {id(obj): name for name, obj in self._state.items() if isinstance(obj, nn.Module)}
            if modules and dist.is_distributed():
                for obj in gc.get_objects():
                    if issubclass(type(obj), DistributedDataParallel):  # not isinstance: no __class__ property runs
                        name = modules.get(id(obj), modules.get(id(obj.module)))
                        if name is not None:
                            self._found.append((name, weakref.ref(obj)))
                        else:
                            _warn_if_parent(obj, modules)
        alive = [(name, ref()) for name, ref in self._found]
        return [(name, ddp) for name, ddp in alive if ddp is not None]

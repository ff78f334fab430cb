"""Child process that measures the peak extra memory of one checkpoint action on a training state.

    python -m tests.support.memory_probe ACTION --state-mib 256 --root DIR

builds a float32 model and its AdamW state after one optimizer step (``--state-mib`` MiB of
tensors in all: parameters, ``exp_avg``, ``exp_avg_sq``), prepares the action (objects built,
modules imported, a small warm-up save elsewhere), then measures the action alone with
:mod:`tests.support.peak_memory` and prints one JSON line per measurement: ``{"action", "state_bytes",
"before_bytes", "peak_bytes", "after_bytes", "extra_bytes"}`` (or ``{"action", "error"}`` and exit
status 3 when the action cannot run here). One process per tool: nothing another tool freed or
kept counts (a save and then a restore of the same tool share one, each measured from its own
trimmed baseline).

``benchmarks/checkpoint_vs_peers.py`` runs the same way for its peers (:func:`run_child`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
from collections.abc import Callable

import torch

from tests.support.peak_memory import PeakMemory, PeakMemoryUnavailable, measure

MIB = 2**20
#: Linear layers of the benchmark model; each holds a (d, d) weight and a (d,) bias.
DEFAULT_LAYERS = 16


def build_training_state(
    state_bytes: int, *, layers: int = DEFAULT_LAYERS, seed: int = 0, device: str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A float32 ``Sequential`` of ``layers`` square ``Linear`` layers and its AdamW optimizer
    after one step, sized so that parameters plus AdamW state hold about ``state_bytes`` bytes
    (3 float32 values per parameter, plus one scalar ``step`` per parameter tensor), on ``device``."""
    floats_per_layer = state_bytes / 3 / 4 / layers  # d*d + d of them
    width = max(8, round((math.sqrt(1 + 4 * floats_per_layer) - 1) / 2))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gradients: dict[tuple, torch.Tensor] = {}  # one per shape, shared: allocating 1x the model costs seconds
    for p in model.parameters():
        p.grad = gradients.setdefault(tuple(p.shape), torch.full_like(p, 1e-3))
    optimizer.step()
    for p in model.parameters():
        p.grad = None  # gradients are not saved state
    return model, optimizer


def state_tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor of the model's and the optimizer's state."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for per_param in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def background_saves_available() -> bool:
    """Whether this spotrun has background periodic saves (``background_saves=``, ``wait_for_save``)."""
    import spotrun

    return "background_saves" in inspect.signature(spotrun.Checkpointer).parameters and hasattr(
        spotrun.Checkpointer, "wait_for_save"
    )


def evict_from_page_cache(directory: str) -> None:
    """Drop the (clean) cached pages of every file under ``directory`` (a cold read follows)."""
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _checkpointer(state: dict, root: str, **options):
    import spotrun
    from spotrun.storage import LocalStorage

    return spotrun.Checkpointer(state, storage=LocalStorage(root), handle_signals=False, **options)


def _warm_up(root: str, **options) -> None:
    """One small save in another root: imports and thread pools are not part of a measurement."""
    ckpt = _checkpointer({"warm": {"x": torch.ones(4)}}, os.path.join(root, "warm-up"), **options)
    ckpt.restore()
    if options.get("background_saves"):
        ckpt.end_of_step(1)
        ckpt.wait_for_save()
    else:
        ckpt.save(1)
    ckpt.close()


def _committed_steps(root: str) -> list[int]:
    from spotrun.checkpoint import catalog
    from spotrun.storage import LocalStorage

    return [info.step for info in catalog.list_steps(LocalStorage(root)) if info.status == catalog.COMPLETE]


def known_allocation(model, optimizer, root: str) -> dict[str, PeakMemory]:
    """Calibration: a new tensor as large as the state, filled (every page touched)."""
    size = state_tensor_bytes(model, optimizer)
    _, peak = measure(lambda: torch.ones(size // 4, dtype=torch.float32))
    return {"known-allocation": peak}


def spotrun_sync_save(model, optimizer, root: str) -> dict[str, PeakMemory]:
    """``Checkpointer.save`` of the state as an emergency save (synchronous, durable)."""
    _warm_up(root)
    directory = os.path.join(root, "ck")
    ckpt = _checkpointer({"model": model, "optimizer": optimizer}, directory)
    ckpt.restore()
    _, peak = measure(lambda: ckpt.save(1, reason="emergency"))
    ckpt.close()
    if _committed_steps(directory) != [1]:
        raise RuntimeError("the measured save did not commit step 1")
    return {"spotrun-sync-save": peak}


def spotrun_save_and_restore(model, optimizer, root: str) -> dict[str, PeakMemory]:
    """:func:`spotrun_sync_save`, then ``Checkpointer.restore`` of that step into the live
    model and optimizer, cold (measured from a new baseline: the save's garbage is not counted)."""
    peaks = spotrun_sync_save(model, optimizer, root)
    directory = os.path.join(root, "ck")
    ckpt = _checkpointer({"model": model, "optimizer": optimizer}, directory)
    evict_from_page_cache(directory)
    step, peaks["spotrun-restore"] = measure(ckpt.restore)
    if step != 1:
        raise RuntimeError(f"restore returned step {step}, not 1")
    return peaks


def spotrun_background_save(model, optimizer, root: str) -> dict[str, PeakMemory]:
    """Two background periodic saves (the first allocates the staging buffers, the second
    reuses them), each from ``end_of_step`` until ``wait_for_save`` returns."""
    if not background_saves_available():
        raise NotImplementedError("this spotrun has no background saves (Checkpointer(background_saves=...))")
    _warm_up(root, interval_steps=1, background_saves=True)
    ckpt = _checkpointer(
        {"model": model, "optimizer": optimizer}, os.path.join(root, "ck"), interval_steps=1, background_saves=True
    )
    ckpt.restore()

    def two_saves() -> None:
        for step in (1, 2):
            ckpt.end_of_step(step)
            ckpt.wait_for_save()

    _, peak = measure(two_saves)
    ckpt.close()
    if _committed_steps(os.path.join(root, "ck")) != [1, 2]:
        raise RuntimeError("the measured background saves did not commit steps 1 and 2")
    return {"spotrun-background-save": peak}


#: Most tensor bytes per file of the measured ``spotrun export`` (``--max-shard-size``).
EXPORT_SHARD_BYTES = 8 * MIB


def spotrun_export_hf(model, optimizer, root: str) -> dict[str, PeakMemory]:
    """``spotrun export --format hf`` of a saved step's model (its parameters only, a third of
    the state) in files of at most :data:`EXPORT_SHARD_BYTES`, cold; a small export elsewhere
    first, so that imports are not counted."""
    from spotrun.export.hf import export_hf
    from spotrun.storage import LocalStorage

    directory = os.path.join(root, "ck")
    for where, state in ((os.path.join(root, "warm-up"), {"x": torch.ones(4)}), (directory, model)):
        ckpt = _checkpointer({"model": state}, where)
        ckpt.restore()
        ckpt.save(1)
        ckpt.close()
    export_hf(LocalStorage(os.path.join(root, "warm-up")), LocalStorage(os.path.join(root, "warm-up-hf")))
    evict_from_page_cache(directory)
    result, peak = measure(
        lambda: export_hf(
            LocalStorage(directory), LocalStorage(os.path.join(root, "hf")), max_shard_size_bytes=EXPORT_SHARD_BYTES
        )
    )
    if len(result.plan.shards) < 2:
        raise RuntimeError("the measured export wrote one file: the model is not larger than a file")
    return {"spotrun-export-hf": peak}


#: Action name -> function(model, optimizer, scratch root) -> {measurement name: PeakMemory}.
ACTIONS: dict[str, Callable[..., dict[str, PeakMemory]]] = {
    "known-allocation": known_allocation,
    "spotrun-sync-save": spotrun_sync_save,
    "spotrun-save-and-restore": spotrun_save_and_restore,
    "spotrun-background-save": spotrun_background_save,
    "spotrun-export-hf": spotrun_export_hf,
}


def run_child(actions: dict[str, Callable[..., dict[str, PeakMemory]]], argv: list[str] | None = None) -> int:
    """Parse ``ACTION --state-mib N --root DIR``, build the state, run the action, print one
    JSON line per measurement it makes."""
    parser = argparse.ArgumentParser(description="measure one action's peak extra memory")
    parser.add_argument("action", choices=sorted(actions))
    parser.add_argument("--state-mib", type=float, required=True)
    parser.add_argument("--root", required=True, help="scratch directory for the action's files")
    args = parser.parse_args(argv)
    model, optimizer = build_training_state(int(args.state_mib * MIB))
    state_bytes = state_tensor_bytes(model, optimizer)
    try:
        peaks = actions[args.action](model, optimizer, args.root)
    except (NotImplementedError, PeakMemoryUnavailable) as exc:
        print(json.dumps({"action": args.action, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 3
    for name, peak in peaks.items():
        print(
            json.dumps(
                {
                    "action": name,
                    "state_bytes": state_bytes,
                    "before_bytes": peak.before_bytes,
                    "peak_bytes": peak.peak_bytes,
                    "after_bytes": peak.after_bytes,
                    "extra_bytes": peak.extra_bytes,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_child(ACTIONS))

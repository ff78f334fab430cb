"""torchrun worker for tests/unit/checkpoint/test_sharded_memory.py: the peak extra memory, on each rank, of
saving and restoring FSDP2 state (issue 10, item 6).

``torchrun --nproc-per-node 2 sharded_memory_job.py --root DIR --out FILE``

1. *Replicated (DDP-style) save, not measured*: every rank builds the whole model (seed 1)
   and its AdamW state after one step and saves step 7 under ``DIR/ddp``; each rank records
   the SHA-256 of each row half of every tensor (the boxes FSDP2 gives the ranks later).
2. *FSDP2*: the same model (seed 0) under ``fully_shard`` (each layer, then the root) on all
   ranks, AdamW after one step. A small warm-up save and restore elsewhere first (imports,
   thread pools, process groups are not part of a measurement). Then, each measured with
   :func:`tests.support.peak_memory.measure` (garbage collected and the C heap trimmed, ``VmHWM``
   reset through ``/proc/self/clear_refs``, the action, ``VmHWM`` read):

   - ``known_allocation``: a new tensor as large as the rank's local share (calibration);
   - ``sync_save``: ``Checkpointer.save(1)`` with ``background_saves=False`` (``DIR/fsdp``);
   - ``restore_same_layout``: every local tensor zeroed in place, then ``restore()`` of that
     step into the live model and optimizer (checked: the saved values are back);
   - ``restore_other_layout``: ``restore()`` of the replicated step 7 into the FSDP2 model
     (checked: each rank's local tensors equal its row half of the replicated values);
   - ``background_save``: two background periodic saves (``end_of_step`` then
     ``wait_for_save``; the first allocates the staging buffers, the second reuses them);
   - ``restore_at_start``: a new FSDP2 model and an AdamW that has not stepped (a job that
     starts and resumes), ``restore()`` of step 1 (checked: the saved values are back).

Rank 0 writes to ``--out`` a JSON list, one object per rank: ``local_share_bytes`` (bytes
of the rank's local tensors: its chunks of the parameters and of the optimizer state),
``full_state_bytes`` (the global tensors' bytes), ``largest_tensor_bytes`` (the largest global
tensor), ``local_optimizer_bytes`` (the rank's chunks of the optimizer state), and for each
measurement ``{"before_bytes", "peak_bytes", "after_bytes", "extra_bytes", "kept_bytes"}``
plus the checks' outcomes (``step``, ``bytes_read``, ``exact``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown
from torch import nn

import spotrun
from spotrun.storage import LocalStorage
from tests.support.peak_memory import PeakMemory, measure, status_bytes, trim_heap

LAYERS, WIDTH = 4, 2048  # 4 x 16 MiB of float32 weights: 192 MiB with AdamW's two moments


def build(seed: int, fsdp: bool, step: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its AdamW optimizer, after one step (so the optimizer state exists) unless
    ``step`` is false (a job that starts and restores: no optimizer state yet)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if not step:
        return model, opt
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def named_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor (as the module and optimizer hold them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = {f"model/{n}": p for n, p in model.named_parameters()}
    for param, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                found[f"optimizer/{names[id(param)]}/{key}"] = value
    return found


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    return hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).hexdigest()[:16]


def row_half_digests(tensors: dict[str, torch.Tensor], ranks: int) -> dict[str, list[str]]:
    """name -> digest of each rank's box under FSDP2 (``torch.chunk`` of dim 0), 0-d tensors whole."""
    return {
        n: [digest(t)] * ranks if t.dim() == 0 else [digest(c) for c in torch.chunk(t.detach(), ranks)]
        for n, t in tensors.items()
    }


def checkpointer(model: nn.Module, opt: torch.optim.Optimizer, root: str, **options) -> spotrun.Checkpointer:
    return spotrun.Checkpointer(
        {"model": model, "optimizer": opt}, storage=LocalStorage(root), handle_signals=False, **options
    )


def warm_up(root: str) -> None:
    """A tiny save (synchronous and background) and restore: imports, thread pools and process
    groups exist before any measurement."""
    for background in (False, True):
        tiny = {"x": torch.ones(4)}
        where = os.path.join(root, f"background-{background}")
        ckpt = spotrun.Checkpointer(
            {"warm": tiny},
            storage=LocalStorage(where),
            handle_signals=False,
            interval_steps=1,
            background_saves=background,
        )
        ckpt.restore()
        ckpt.end_of_step(1)
        ckpt.wait_for_save()
        ckpt.close()
        ckpt = spotrun.Checkpointer({"warm": tiny}, storage=LocalStorage(where), handle_signals=False)
        assert ckpt.restore() == 1
        ckpt.close()


def fields(peak: PeakMemory) -> dict[str, int]:
    """The measurement, and ``kept_bytes``: what the action still holds once garbage is
    collected and the C heap trimmed (resident now minus resident before it)."""
    trim_heap()
    return {
        "before_bytes": peak.before_bytes,
        "peak_bytes": peak.peak_bytes,
        "after_bytes": peak.after_bytes,
        "extra_bytes": peak.extra_bytes,
        "kept_bytes": status_bytes("VmRSS") - peak.before_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank}

    # 1. the replicated layout: every rank holds everything; saved as step 7, not measured
    model, opt = build(seed=1, fsdp=False)
    replicated_halves = {n: h[rank] for n, h in row_half_digests(named_tensors(model, opt), ranks).items()}
    ckpt = checkpointer(model, opt, os.path.join(args.root, "ddp"), background_saves=False)
    ckpt.restore()
    ckpt.save(7)
    ckpt.close()
    del model, opt, ckpt
    gc.collect()

    # 2. FSDP2
    model, opt = build(seed=0, fsdp=True)
    tensors = named_tensors(model, opt)
    result["local_share_bytes"] = sum(local(t).numel() * local(t).element_size() for t in tensors.values())
    result["full_state_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    result["tensors"] = len(tensors)
    result["largest_tensor_bytes"] = max(t.numel() * t.element_size() for t in tensors.values())
    result["local_optimizer_bytes"] = sum(
        local(t).numel() * local(t).element_size() for n, t in tensors.items() if n.startswith("optimizer/")
    )
    warm_up(os.path.join(args.root, "warm-up"))

    allocated, peak = measure(lambda: torch.ones(result["local_share_bytes"] // 4))
    result["known_allocation"] = fields(peak)
    del allocated

    saved = {n: digest(local(t)) for n, t in tensors.items()}
    ckpt = checkpointer(model, opt, os.path.join(args.root, "fsdp"), background_saves=False)
    ckpt.restore()
    _, peak = measure(lambda: ckpt.save(1))
    ckpt.close()
    result["sync_save"] = fields(peak)

    with torch.no_grad():  # so that a restore that reads nothing cannot pass
        for t in tensors.values():
            local(t).zero_()
    ckpt = checkpointer(model, opt, os.path.join(args.root, "fsdp"), background_saves=False)
    step, peak = measure(ckpt.restore)
    result["restore_same_layout"] = {
        **fields(peak),
        "step": step,
        "bytes_read": ckpt.restore_bytes_read,
        "exact": {n: digest(local(t)) for n, t in tensors.items()} == saved,
    }
    ckpt.close()

    ckpt = checkpointer(model, opt, os.path.join(args.root, "ddp"), background_saves=False)
    step, peak = measure(ckpt.restore)
    tensors = named_tensors(model, opt)  # the restore keeps the optimizer's tensors, but look again
    result["restore_other_layout"] = {
        **fields(peak),
        "step": step,
        "bytes_read": ckpt.restore_bytes_read,
        "exact": {n: digest(local(t)) for n, t in tensors.items()} == replicated_halves,
    }
    ckpt.close()

    ckpt = checkpointer(model, opt, os.path.join(args.root, "background"), interval_steps=1, background_saves=True)
    ckpt.restore()

    def two_saves() -> None:
        for step in (1, 2):
            ckpt.end_of_step(step)
            ckpt.wait_for_save()

    _, peak = measure(two_saves)
    result["background_save"] = {**fields(peak), "last_saved_step": ckpt.last_saved_step}
    ckpt.close()
    del model, opt, ckpt, tensors

    # a new start: a new FSDP2 model and an optimizer that has not stepped (its state is created
    # by the restore, and kept), restoring the step saved in the same layout
    model, opt = build(seed=2, fsdp=True, step=False)
    ckpt = checkpointer(model, opt, os.path.join(args.root, "fsdp"), background_saves=False)
    step, peak = measure(ckpt.restore)
    tensors = named_tensors(model, opt)
    result["restore_at_start"] = {
        **fields(peak),
        "step": step,
        "bytes_read": ckpt.restore_bytes_read,
        "exact": {n: digest(local(t)) for n, t in tensors.items()} == saved,
    }
    ckpt.close()

    results: list = [None] * ranks
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)

"""One rank of ``sharded_vs_dcp.py`` (started by torchrun): the FSDP2 state, spotrun and DCP
on it, and what each rank measures.

Phases (``--phase``):

* ``save`` (2 ranks, FSDP2 ``Shard(0)``): rounds of spotrun ``Checkpointer.save`` and DCP
  ``save`` (interleaved, the order rotating each round), then cold restores of both into the
  same layout; keeps the last round's checkpoints for the other phases, and writes the SHA-256
  of every tensor gathered to full (``saved-digests.json``).
* ``restore``: a new process group and the same model, built with another seed and stepped
  once (so nothing of the saved values is there before a restore), sharded by ``--layout``:
  ``plain`` (no DTensors), ``fsdp0`` (FSDP2, ``Shard(0)``) or ``fsdp1`` (FSDP2, rowwise
  ``Shard(1)`` weights); rounds of cold spotrun ``restore`` and DCP ``load`` + ``set_state_dict``.

Before each timed restore every state tensor is zeroed and every checkpoint file is evicted from
the page cache (``posix_fadvise(DONTNEED)``); timings run from a barrier to a barrier (rank 0's
clock). Bytes read per rank: the growth of ``rchar`` in ``/proc/self/io`` across the restore
(bytes this process passed through ``read``/``pread``/``preadv`` and the like, every thread:
the files each tool reads, plus the few KiB of the collectives' socket reads), ``read_bytes``
(what the kernel fetched from the device for it, read-ahead included), and spotrun's own
``restore_bytes_read``. Each rank writes ``DIR/result-PHASE-LAYOUT-rRANK.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")

WIDTH = 2048


def build(size_mib: float, layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Square ``Linear(WIDTH, WIDTH)`` layers (with biases), enough that parameters plus
    AdamW state hold ``size_mib`` MiB, sharded by ``layout``, after one AdamW step."""
    layers = max(1, math.ceil(size_mib * 2**20 / (3 * 4 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    if layout != "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        dim = 1 if layout == "fsdp1" else 0

        def placement(p):
            return Shard(dim if p.dim() > 1 else 0)

        for layer in model:
            fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {f"model/{n}": p for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        tensors.update({f"optimizer/{names[id(param)]}/{k}": v for k, v in state.items()})
    return tensors


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """SHA-256 of every state tensor gathered to full (a collective)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in state_tensors(model, optimizer).items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = hashlib.sha256(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return out


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def evict(*roots: str) -> None:
    """Drop the cached pages of every file under ``roots`` (a cold read follows)."""
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


class Tools:
    """spotrun and DCP on one live state; checkpoints under ``root``."""

    def __init__(self, model, optimizer, root: str) -> None:
        import spotrun

        self.model, self.optimizer, self.root = model, optimizer, root
        self.spotrun_root = f"{root}/spotrun"
        self.ckpt = spotrun.Checkpointer(
            {"model": model, "optimizer": optimizer},
            uri=self.spotrun_root,
            handle_signals=False,
            background_saves=False,
        )

    def dcp_dir(self, step: int) -> str:
        return f"{self.root}/dcp-{step:04d}"

    def spotrun_save(self, step: int) -> None:
        self.ckpt.save(step)

    def dcp_save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=self.dcp_dir(step))

    def spotrun_restore(self, step: int) -> None:
        if self.ckpt.restore() != step:
            raise RuntimeError(f"spotrun restored another step than {step}")

    def dcp_load(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=self.dcp_dir(step))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def zero(self) -> None:
        with torch.no_grad():
            for t in state_tensors(self.model, self.optimizer).values():
                local(t).zero_()


def collective(fn) -> float:
    """Seconds from a barrier before ``fn`` to a barrier after it."""
    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def timed_restores(tools: Tools, step: int, rounds: int) -> tuple[dict, dict]:
    """``rounds`` cold restores by each tool, interleaved; per figure: seconds and this rank's
    byte counts per round; and each tool's digests after its last restore."""
    figures: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    after: dict[str, dict[str, str]] = {}
    runs = [("spotrun restore", tools.spotrun_restore), ("DCP load", tools.dcp_load)]
    for fn in (tools.spotrun_restore, tools.dcp_load):  # warm-up: imports, thread pools
        fn(step)
    for index in range(rounds):
        for figure, fn in runs[index % 2 :] + runs[: index % 2]:
            tools.zero()
            evict(tools.root)
            before = io_counters()
            figures[figure]["seconds"].append(collective(lambda: fn(step)))
            now = io_counters()
            figures[figure]["rchar"].append(now["rchar"] - before["rchar"])
            figures[figure]["read_bytes"].append(now["read_bytes"] - before["read_bytes"])
            if figure == "spotrun restore":
                figures[figure]["counter"].append(tools.ckpt.restore_bytes_read)
            if index == rounds - 1:
                after[figure] = digests(tools.model, tools.optimizer)
    return figures, after


def save_phase(root: str, size_mib: float, rounds: int) -> dict:
    model, optimizer = build(size_mib, "fsdp0", seed=0)
    tools = Tools(model, optimizer, root)
    tools.ckpt.restore()  # an empty root: claims this start's incarnation
    figures: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    runs = [("spotrun save", tools.spotrun_save), ("DCP save", tools.dcp_save)]
    for step in range(1, rounds + 2):  # round 1: warm-up, not counted
        for figure, fn in runs[step % 2 :] + runs[: step % 2]:
            before = io_counters()
            seconds = collective(lambda: fn(step))
            if step > 1:
                figures[figure]["seconds"].append(seconds)
                figures[figure]["wchar"].append(io_counters()["wchar"] - before["wchar"])
        dist.barrier()
        if dist.get_rank() == 0 and step > 1:  # keep the last round's checkpoints only
            shutil.rmtree(f"{tools.spotrun_root}/step-{step - 1:09d}")
            shutil.rmtree(tools.dcp_dir(step - 1))
    saved = digests(model, optimizer)
    if dist.get_rank() == 0:
        with open(f"{root}/saved-digests.json", "w") as f:
            json.dump(saved, f)
    restores, after = timed_restores(tools, rounds + 1, rounds)
    figures.update(restores)
    return {
        "figures": figures,
        "identical": {k: v == saved for k, v in after.items()},
        "local_bytes": local_state_bytes(model, optimizer),
    }


def restore_phase(root: str, size_mib: float, rounds: int, layout: str) -> dict:
    with open(f"{root}/saved-digests.json") as f:
        saved = json.load(f)
    step = int(sorted(n for n in os.listdir(f"{root}/spotrun") if n.startswith("step-"))[-1][5:])
    model, optimizer = build(size_mib, layout, seed=1)
    tools = Tools(model, optimizer, root)
    figures, after = timed_restores(tools, step, rounds)
    return {
        "figures": figures,
        "identical": {k: v == saved for k, v in after.items()},
        "local_bytes": local_state_bytes(model, optimizer),
    }


def local_state_bytes(model, optimizer) -> int:
    """Bytes of this rank's own part of every state tensor (its share)."""
    return sum(local(t).numel() * t.element_size() for t in state_tensors(model, optimizer).values())


def main(root: str, phase: str, layout: str, size_mib: float, rounds: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if phase == "save":
        result = save_phase(root, size_mib, rounds)
    else:
        result = restore_phase(root, size_mib, rounds, layout)
    with open(f"{root}/result-{phase}-{layout}-r{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()

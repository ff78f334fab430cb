"""An FSDP2 model and its AdamW state saved to, or restored from, S3 on any number of ranks;
run by tests/unit/checkpoint/test_sharded_s3.py with real torchrun and gloo.

``python sharded_s3_job.py --mode save|restore --uri s3://... --width W --out-dir DIR
[--storage-options JSON] [--save-steps 1,2]``

Each rank first points ``AWS_ENDPOINT_URL`` at entry ``RANK`` of the comma-separated
``SPOTRUN_TEST_RANK_ENDPOINTS`` when that is set (one counting proxy per rank), so that
every byte a rank reads from S3 passes through a proxy of its own; for another store,
``SPOTRUN_TEST_RANK_ENV`` (a JSON list) gives each rank the variables of entry ``RANK``
(``STORAGE_EMULATOR_HOST``, an Azure connection string).

* ``save``: trains one step (AdamW state exists), saves it as step 1 (or, with ``--save-steps``,
  one training step before each of the steps given); ``--storage-options`` are
  ``open_storage``'s keyword arguments (``{"key_layout": "spread"}``).
* ``restore``: builds the same model sharded over this world size, restores, and does
  nothing else with storage (the proxies see the restore's traffic only).

Each rank writes ``rank-R.json``: ``tensors`` (name -> SHA-256 of the full tensor's bytes,
gathered over the ranks), ``shards`` (name -> {"box": [offset, length] along dimension 0
or ``None`` for a tensor this rank holds whole, "shape", "itemsize"}: what this rank holds,
read off the live DTensors), ``restored`` (step) and ``restore_bytes_read`` (spotrun's own
count).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown
from torch import nn


def build(width: int) -> nn.Module:
    """Two Linear layers ``width -> 2*width -> width`` with biases, FSDP2 over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def named_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, by the name spotrun stores it under."""
    tensors = {f"model/{n}": p for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in opt.state.items():
        for key, value in state.items():
            tensors[f"optimizer/state/{names[id(param)]}/{key}"] = value
    return tensors


def describe(tensor: torch.Tensor) -> dict:
    """What this rank holds of ``tensor``: its box along dimension 0 (``None``: all of it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return {"box": None, "shape": list(tensor.shape), "itemsize": tensor.element_size()}
    chunks = tensor.__create_chunk_list__()  # torch's own sharding arithmetic (offsets, sizes)
    assert len(chunks) == 1 and all(o == 0 for o in chunks[0].offsets[1:]), chunks
    return {
        "box": [chunks[0].offsets[0], chunks[0].sizes[0]],
        "shape": list(tensor.shape),
        "itemsize": tensor.element_size(),
    }


def digest(tensor: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return hashlib.sha256(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("save", "restore"), required=True)
    parser.add_argument("--uri", required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument("--save-steps", default="1")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    endpoints = os.environ.get("SPOTRUN_TEST_RANK_ENDPOINTS")
    if endpoints:
        os.environ["AWS_ENDPOINT_URL"] = endpoints.split(",")[rank]
    rank_env = os.environ.get("SPOTRUN_TEST_RANK_ENV")  # another store's variables, one JSON object per rank
    if rank_env:
        os.environ.update(json.loads(rank_env)[rank])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)

    import spotrun
    from spotrun.storage import open_storage

    model = build(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = spotrun.Checkpointer(
        {"model": model, "optimizer": opt},
        storage=open_storage(args.uri, **json.loads(args.storage_options)),
        handle_signals=False,
        background_saves=False,
    )
    restored = ckpt.restore()
    if args.mode == "save":
        g = torch.Generator().manual_seed(1)
        for step in [int(s) for s in args.save_steps.split(",")]:
            x = torch.randn(4, args.width, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x).backward()
            opt.step()
            ckpt.save(step)
    ckpt.close()
    tensors = named_state(model, opt)
    report = {
        "restored": restored,
        "restore_bytes_read": ckpt.restore_bytes_read,
        "tensors": {name: digest(t) for name, t in tensors.items()},
        "shards": {name: describe(t) for name, t in tensors.items()},
    }
    with open(os.path.join(args.out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)

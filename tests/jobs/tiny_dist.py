"""torchrun worker for test_distributed_save: a replicated state small enough that rank 1
owns none of its tensors, saved and loaded through the collective save path.

Mode ``split``: many small tensors of several dtypes (replicated and per rank) saved with
small ShardLimits, so every rank writes several files, then loaded back on every rank.

Usage: torchrun --nproc-per-node 2 tiny_dist.py CKPT_DIR save|load|fail-rank1|split OUT_DIR
(each rank writes its JSON result to OUT_DIR/rank-R.json)
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from spotrun.checkpoint.restore import load_committed
from spotrun.checkpoint.save import SaveContext, save_step
from spotrun.checkpoint.shard import ShardLimits
from spotrun.errors import CheckpointSaveError, StorageError
from spotrun.storage import LocalStorage

ckpt_dir, mode, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
storage = LocalStorage(ckpt_dir)
replicated = {"w": {"only": torch.arange(4, dtype=torch.float32)}, "meta": {"epoch": 1}}
context = SaveContext(reason="test", run_id="r", incarnation=0)


def report(doc):
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(doc, f)


if mode == "save":
    save_step(storage, 3, replicated, {}, context)
    report({"rank": rank, "saved": 3})
elif mode == "load":
    loaded = load_committed(storage, 3, rank, dist.get_world_size())
    report({"rank": rank, "w": loaded.replicated["w"]["only"].tolist(), "meta": loaded.replicated["meta"]})
elif mode == "fail-rank1":
    if rank == 1:

        def broken_put_stream(key, source, **kwargs):
            raise StorageError(5, f"injected write failure for {key}")

        storage.put_stream = broken_put_stream
    try:
        save_step(storage, 4, replicated, {}, context)
        report({"rank": rank, "error": None})
    except CheckpointSaveError as exc:
        report({"rank": rank, "error": str(exc)})
elif mode == "split":

    def many(seed):
        gen = torch.Generator().manual_seed(seed)
        state = {f"t{i}": torch.randn(1 + i % 9, generator=gen) for i in range(300)}
        state.update({f"s{i}": torch.randn(4, generator=gen).to(torch.float8_e8m0fnu) for i in range(40)})
        return state

    replicated = {"model": many(0)}
    own = {"mine": many(100 + rank)}
    save_step(storage, 5, replicated, own, context, ShardLimits(max_file_size_bytes=4096, max_header_bytes=4096))
    loaded = load_committed(storage, 5, rank, dist.get_world_size())

    def same(a, b):
        return a.keys() == b.keys() and all(
            a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
        )

    report(
        {
            "rank": rank,
            "replicated_exact": same(loaded.replicated["model"], replicated["model"]),
            "own_exact": same(loaded.rank_local["mine"], own["mine"]),
        }
    )
dist.barrier()  # no rank tears gloo down while a peer still receives
dist.destroy_process_group()
from exit_without_teardown import exit_without_teardown

exit_without_teardown(0)

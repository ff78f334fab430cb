"""torchrun worker for test_fast_tier_settings: each rank plays a node of its own
(LOCAL_WORLD_SIZE=1), and the nodes' fast-tier settings differ as MODE says; every rank must
agree to run with storage only, never wait for a collective the others skip.

Usage: torchrun --standalone --nproc-per-node 2 mixed_tier_nodes.py MODE WORK_DIR
MODE: ``one-without`` (rank 1's node has no fast tier), ``intervals`` (the nodes' intervals
differ), ``neither`` (no node has one). Each rank writes WORK_DIR/rank-R.json.
"""

import json
import os
import sys

mode, work = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
os.environ["LOCAL_WORLD_SIZE"] = "1"  # every rank its own node
has_tier = mode == "intervals" or (mode == "one-without" and rank == 0)
if has_tier:
    tier = os.path.join(work, f"tier-{rank}")
    os.makedirs(os.path.join(tier, "steps"), exist_ok=True)
    with open(os.path.join(tier, "secret"), "w") as file:
        file.write((b"k" * 32).hex())
    os.environ.update(
        SPOTRUN_MEMORY_DIR=os.path.join(tier, "steps"),
        SPOTRUN_MEMORY_INTERVAL_STEPS=str(2 if rank == 0 else 4),
        SPOTRUN_MEMORY_NODE=f"node-{rank}",
        SPOTRUN_MEMORY_PEER_ADDRESS="127.0.0.1:9",
        SPOTRUN_MEMORY_SECRET_FILE=os.path.join(tier, "secret"),
    )

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import spotrun  # noqa: E402
from spotrun.storage import LocalStorage  # noqa: E402

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
ckpt = spotrun.Checkpointer({"model": model}, storage=LocalStorage(os.path.join(work, "ck")), handle_signals=False)
start = ckpt.restore()
for step in range(start + 1, 7):
    model.weight.data.add_(1.0)
    ckpt.end_of_step(step)
ckpt.close()
tier_files = [f for root, _, files in os.walk(work) if "tier-" in root for f in files if f != "secret"]
with open(os.path.join(work, f"rank-{rank}.json"), "w") as file:
    json.dump({"tier": ckpt._tier is not None, "tier_files": tier_files}, file)
dist.destroy_process_group()

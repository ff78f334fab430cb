"""Worker for test_kill_mid_shard_write.py (field case C06): commit step 100, then stall
half-way through step 200's shard.

Usage: stalled_shard_writer.py CKPT_DIR MARKER_FILE  -> saves 100, starts 200, writes MARKER_FILE
       when half of the shard bytes are on disk, then waits to be SIGKILLed.
       stalled_shard_writer.py CKPT_DIR --resume     -> prints the restored step.
"""

import os
import sys
import threading

import torch

import spotrun
from spotrun.storage import LocalStorage

ckpt_dir = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(512, 512)  # ~1 MiB of float32
storage = LocalStorage(ckpt_dir, write_chunk_bytes=64 * 1024)
ckpt = spotrun.Checkpointer({"model": model}, storage=storage)

if sys.argv[2] == "--resume":
    print(ckpt.restore(), flush=True)
    sys.exit(0)

marker = sys.argv[2]
ckpt.save(100)
original_write_chunks = LocalStorage._write_chunks


def write_half_then_stall(self, fd, data):
    if threading.current_thread().name == "spotrun-event-log":  # the event log's own writes go on
        return original_write_chunks(self, fd, data)
    half = len(data) // 2
    original_write_chunks(self, fd, data[:half])
    os.fsync(fd)
    with open(marker, "w") as f:
        f.write(str(half))
    threading.Event().wait()  # the test SIGKILLs us here


LocalStorage._write_chunks = write_half_then_stall
with torch.no_grad():
    model.weight.add_(1.0)
ckpt.save(200)

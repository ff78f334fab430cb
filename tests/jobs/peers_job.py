"""The cooperative restore's transport (spotrun.checkpoint.cooperative) on its own, with real
torchrun and gloo; run by tests/unit/checkpoint/test_cooperative_transport.py.

``python peers_job.py --mode share|stall --out-dir DIR``

* ``share``: rounds of ``ROUND_BYTES`` = 3,000 bytes (set here, so that a few KiB take several
  rounds): every rank builds the same groups of boxes of odd sizes (pieces that span boxes, boxes
  that span pieces), fills the boxes it reads with bytes that say who read what, shares them,
  and reports whether every box it received holds the reader's bytes, and the bytes received.
* ``stall``: ``Peers`` with a 2 s timeout; rank 1 never sends what rank 0 waits for (it sleeps,
  then leaves); rank 0 reports the error and how long it waited; then both close the group.

Each rank writes ``rank-R.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown

from spotrun.checkpoint import cooperative
from spotrun.checkpoint.cooperative import PeerError, Peers, share
from spotrun.checkpoint.share_plan import Need, ShareGroup

#: Box sizes of a group (bytes): smaller and larger than a piece, none a multiple of another.
SIZES = [1000, 7, 2500, 13, 4096, 1, 999, 3001]


def content(need: Need) -> torch.Tensor:
    """What a box holds: bytes derived from its name, the same on every rank."""
    seed = sum(need.name.encode())
    return (torch.arange(need.nbytes, dtype=torch.int64) * 31 + seed).remainder(251).to(torch.uint8)


def groups_for(world_size: int) -> list[ShareGroup]:
    """A group of every rank and, with 3 ranks or more, one of ranks 0 and 2, in plan order."""
    every = tuple(range(world_size))
    needs = tuple(Need(f"all/t{i}", (0,), (n,), n) for i, n in enumerate(SIZES))
    groups = [ShareGroup(every, needs, tuple(i % world_size for i in range(len(needs))))]
    if world_size >= 3:
        pair = tuple(Need(f"pair/t{i}", (0,), (n,), n) for i, n in enumerate(reversed(SIZES)))
        groups.append(ShareGroup((0, 2), pair, tuple(2 if i % 3 else 0 for i in range(len(pair)))))
    return sorted(groups, key=lambda g: g.ranks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("share", "stall"), required=True)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    report: dict = {}
    if args.mode == "share":
        cooperative.ROUND_BYTES = 3000
        cooperative.MIN_PIECE_BYTES = 100
        peers = Peers.open()
        mine = [g for g in groups_for(world_size) if rank in g.ranks]
        tensors = {}
        for group in mine:
            for need, reader in zip(group.needs, group.readers):
                tensors[need] = content(need) if reader == rank else torch.zeros(need.nbytes, dtype=torch.uint8)
        report["received"] = share(peers, mine, tensors)
        report["expected"] = sum(n.nbytes for g in mine for n, r in zip(g.needs, g.readers) if r != rank)
        report["exact"] = all(torch.equal(t, content(n)) for n, t in tensors.items())
        peers.close()
    else:
        peers = Peers.open(timeout_s=2.0)
        if rank == 0:
            started = time.monotonic()
            try:
                peers.exchange([], [(1, 0, torch.empty(16, dtype=torch.uint8))])
            except PeerError as exc:
                report["error"] = str(exc)
            report["waited_s"] = time.monotonic() - started
        else:
            time.sleep(6.0)
        peers.close()
    with open(os.path.join(args.out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
    exit_without_teardown(0)

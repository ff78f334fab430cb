"""torchrun worker for tests/unit/tools/test_bounded_collectives.py: one of spotrun's bounded
collectives on 3 gloo ranks, first with every rank there, then with one rank stopped (SIGSTOP)
or killed (SIGKILL) by its own hand just before it.

Usage: torchrun --nproc-per-node 3 stopped_rank.py OUT_DIR COLLECTIVE stop|kill VICTIM TIMEOUT_S

COLLECTIVE: gather, broadcast, allreduce or transfer.

``transfer``: point-to-point transfers on a bounded group of its own (a cooperative restore's):
every rank sends its rank to each other rank and receives theirs, in one phase per call.

Each rank writes OUT_DIR/pid-rank-R (its pid, before anything else: the test's teardown ends a
stopped rank with it) and, unless it is the victim, OUT_DIR/rank-R.json: the happy collective's
result, then what the bounded one raised ({"error", "ranks", "what", "elapsed_s"}) and what a
second collective on the same group raised ({"again", "again_elapsed_s"}). SIGTERM is ignored:
torchrun sends it as soon as the killed rank is gone, and the test wants the others' reports.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from spotrun.errors import CollectiveTimeoutError
from spotrun.tools import collectives
from spotrun.tools import dist as sdist

out_dir, collective, how, victim, timeout_s = (
    sys.argv[1],
    sys.argv[2],
    sys.argv[3],
    int(sys.argv[4]),
    float(sys.argv[5]),
)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.path.join(out_dir, f"pid-rank-{rank}"), "w") as f:
    f.write(str(os.getpid()))


group = collectives.new_group("test", timeout_s=timeout_s, what="the test") if collective == "transfer" else None


def transfer(what):
    """Every rank's rank, sorted, as this rank has it after the phase's transfers."""
    phase = group.begin_transfers(what)
    received = {peer: torch.empty(1, dtype=torch.int64) for peer in range(3) if peer != rank}
    sends = [(peer, phase, torch.tensor([rank])) for peer in received]
    group.transfer(
        sends, [(peer, phase, t) for peer, t in received.items()], phase=phase, timeout_s=timeout_s, what=what
    )
    return sorted([rank] + [int(t.item()) for t in received.values()])


def run(value, what):
    if collective == "transfer":
        return transfer(what)
    if collective == "gather":
        return sdist.all_gather_json(value, timeout_s=timeout_s, what=what)
    if collective == "broadcast":
        return sdist.broadcast_json(value if rank == 2 else None, 2, timeout_s=timeout_s, what=what)
    return sdist.start_any_rank_each([rank == value, False], timeout_s=timeout_s, what=what).wait()


report = {"happy": run({"rank": rank} if collective != "allreduce" else 1, "the happy collective")}
if rank == victim:
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
started_s = time.monotonic()
try:
    run({"rank": rank} if collective != "allreduce" else 1, "the test's collective")
    report["error"] = None
except CollectiveTimeoutError as exc:
    report.update(error=str(exc), ranks=exc.ranks, what=exc.what, elapsed_s=time.monotonic() - started_s)
started_s = time.monotonic()
try:
    run(0, "the collective after it")
    report["again"] = None
except CollectiveTimeoutError as exc:
    report.update(again=str(exc), again_elapsed_s=time.monotonic() - started_s)
with open(os.path.join(out_dir, f"rank-{rank}.json.tmp"), "w") as f:
    json.dump(report, f)
os.replace(os.path.join(out_dir, f"rank-{rank}.json.tmp"), os.path.join(out_dir, f"rank-{rank}.json"))
os._exit(0)  # no teardown: the group's peers are gone

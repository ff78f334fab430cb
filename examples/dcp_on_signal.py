"""A plain PyTorch job that saves its own torch.distributed.checkpoint (DCP) on a preemption notice.

No spotrun.Checkpointer: the script keeps its own checkpoints and its own resume logic, and
spotrun (``spotrun run``) only watches the notices and restarts it::

    spotrun run --grace-period-s 60 -- \\
        torchrun --nproc-per-node 2 examples/dcp_on_signal.py --ckpt-dir runs/dcp --steps 1000

How it hears the notice (``--notice``):

* ``signal`` (default): its own handler for ``--save-signal`` (SIGTERM by default, e.g. SIGUSR1 for
  SLURM's ``--signal=USR1@90``) sets a flag. Under ``spotrun run`` in foreign-saver mode the
  supervisor sends that signal to the worker processes at once on a notice.
* ``poll``: ``spotrun.preemption_notice()`` at every step boundary (a few microseconds), which
  also tells the supervisor that this job listens, so it sends no signal.

Either way every rank acts on the same step: at each step boundary one all-reduce (MAX) of a
one-element flag (a CPU tensor on gloo; it would be a CUDA tensor on nccl). When set, every
rank saves that step with ``dcp.save`` into ``<ckpt-dir>/step-<N>/``, rank 0 writes the marker
file ``COMPLETE`` into it after ``dcp.save`` returned (``dcp.save`` returns only once every
rank's files and the metadata are written), and every rank exits 0.

On start it resumes from the newest ``step-<N>`` directory that has the marker (a directory
without one is an interrupted save and is ignored), so running the same command again
continues where the notice stopped it. ``--save-every K`` also saves every K steps.

``--log-file`` gets JSON lines (appended, by every rank): ``{"event": "start", "rank", "pid",
"resumed_step"}``, ``{"event": "step", "rank": 0, "step", "loss"}`` (rank 0 only),
``{"event": "signal", "rank", "signal", "received_unix_s"}``, ``{"event": "notice", "rank",
"reason", "seconds_left", "seen_unix_s"}``, ``{"event": "saved", "rank", "step"}``, ``{"event": "done", "rank",
"step"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

MARKER = "COMPLETE"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True, help="directory of this job's DCP checkpoints")
    parser.add_argument("--steps", type=int, default=100, help="train until this step")
    parser.add_argument("--log-file", default=None, help="JSON lines of steps, signals and saves")
    parser.add_argument(
        "--notice",
        choices=["signal", "poll"],
        default="signal",
        help="hear the notice as a signal or by polling spotrun.preemption_notice()",
    )
    parser.add_argument("--save-signal", default="SIGTERM", help="the signal that asks for a save (signal mode)")
    parser.add_argument("--save-every", type=int, default=0, help="also save every K steps (0: never)")
    parser.add_argument("--step-sleep-s", type=float, default=0.0, help="pretend a step takes longer")
    return parser.parse_args(argv)


class Flag:
    """Set by the signal handler; read at the step boundary."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_unix_s: float | None = None

    def handler(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name, self.received_unix_s = signal.Signals(signum).name, time.time()


def main(argv=None) -> int:
    args = parse_args(argv)
    flag = Flag()
    if args.notice == "signal":
        # Before `import torch` (a second or more): a signal that arrives while it loads is
        # then a save request at the first step boundary, not the end of the process.
        signal.signal(signal.Signals[args.save_signal], flag.handler)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.nn.parallel import DistributedDataParallel

    class TrainState(Stateful):
        """Model, optimizer and step, in the shape DCP saves and loads in place."""

        def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
            self.model, self.optimizer, self.step = model, optimizer, 0

        def state_dict(self) -> dict:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            return {"model": model_state, "optim": optim_state, "step": torch.tensor(self.step)}

        def load_state_dict(self, state: dict) -> None:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            self.step = int(state["step"])

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = open(args.log_file, "a", buffering=1) if args.log_file else None

    def record(event: str, **fields) -> None:
        if log is not None:
            log.write(json.dumps({"event": event, "rank": rank, **fields}) + "\n")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, optimizer)

    newest = newest_complete(args.ckpt_dir)
    if newest is not None:
        dcp.load({"train": state}, checkpoint_id=os.path.join(args.ckpt_dir, step_dir(newest)))
    record("start", pid=os.getpid(), resumed_step=newest)

    def save() -> None:
        path = os.path.join(args.ckpt_dir, step_dir(state.step))
        dcp.save({"train": state}, checkpoint_id=path)
        if rank == 0:  # dcp.save returned: every rank's data and the metadata are written
            with open(os.path.join(path, MARKER), "w") as f:
                f.flush()
                os.fsync(f.fileno())
        record("saved", step=state.step)

    if args.notice == "poll":
        import spotrun  # no torch import of its own; polling costs microseconds per step

    while state.step < args.steps:
        state.step += 1
        inputs, targets = batch(state.step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            record("step", step=state.step, loss=loss.item())
        time.sleep(args.step_sleep_s)

        notice = spotrun.preemption_notice() if args.notice == "poll" else None
        asked = torch.tensor([1 if notice is not None or flag.signal_name else 0])  # CPU: gloo
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if asked.item():
            if flag.signal_name:
                record("signal", signal=flag.signal_name, received_unix_s=flag.received_unix_s)
            if notice is None and args.notice == "poll":  # a peer saw this node's request first: read it too
                notice = spotrun.preemption_notice()
            if notice is not None:
                record("notice", reason=notice.reason, seconds_left=notice.seconds_left(), seen_unix_s=time.time())
            if notice is None or notice.save:
                save()
            dist.barrier()  # no rank leaves while a peer still takes part in the last collective
            return 0  # no destroy_process_group(): see the end of this file
        if args.save_every and state.step % args.save_every == 0:
            save()

    record("done", step=state.step)
    dist.barrier()
    return 0


def batch(step: int, rank: int):
    """This rank's (inputs (8, 16), targets (8, 1)) of ``step``: the same in every run."""
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    inputs = torch.randn(8, 16, generator=g)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def newest_complete(ckpt_dir: str) -> int | None:
    """The newest step whose directory has the marker, or ``None``."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return None
    steps = [
        int(n[len("step-") :])
        for n in names
        if n.startswith("step-") and n[len("step-") :].isdigit() and os.path.exists(os.path.join(ckpt_dir, n, MARKER))
    ]
    return max(steps, default=None)


if __name__ == "__main__":
    exit_code = main()
    # Skip gloo's teardown and interpreter finalization: destroy_process_group() and freeing
    # gloo's threads at interpreter exit can hang or abort a process after its save when a
    # peer has already gone (pytorch/pytorch#179291). Every rank passed the barrier after the
    # last collective, and everything is written and flushed: nothing is left to tear down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

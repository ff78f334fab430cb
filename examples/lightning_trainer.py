"""Lightning ``Trainer`` that saves its own checkpoint on a preemption notice and resumes from it.

spotrun watches the notices and restarts the command; Lightning keeps its own checkpoints
(``<ckpt-dir>/step-<global_step>.ckpt``)::

    spotrun run --grace-period-s 60 --notify-signal SIGUSR1 -- \\
        torchrun --nproc-per-node 2 examples/lightning_trainer.py --ckpt-dir runs/pl --max-steps 1000

Lightning takes SIGTERM for itself (from 2.x it stops before the next batch and exits 0,
with no checkpoint), so this recipe listens for SIGUSR1 (``--save-signal``; Lightning uses
SIGUSR1 only for SLURM's auto-requeue), which spotrun's ``--notify-signal SIGUSR1`` sends to
the workers on a notice; or it polls ``spotrun.preemption_notice()`` (``--notice poll``: no
signal at all).

:class:`SaveOnNotice` is the part to copy. At each batch end every rank agrees on one decision
(``strategy.reduce_boolean_decision(..., all=False)``: one all-reduce, any rank asked), then
every rank calls ``trainer.save_checkpoint`` (rank 0 writes, all wait for it) into a temporary
name that rank 0 renames into place: a ``step-<N>.ckpt`` is always whole. Training stops
(``trainer.should_stop``) and the script exits 0. On start, ``trainer.fit(ckpt_path=...)``
resumes from the newest ``step-<N>.ckpt``; ``global_step`` continues from there.

The model is a tiny MLP on seeded random data, so the recipe runs anywhere on CPU. Its plain
``DataLoader`` restarts the interrupted epoch's shuffled order on resume (Lightning warns about
it); for the exact next batch give Lightning a resumable loader (``state_dict`` /
``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``).
``--log-file`` gets JSON lines: ``{"event": "start", "rank", "pid", "resumed_step"}``,
``{"event": "step", "step", "loss"}`` (rank 0), ``{"event": "signal", "rank", "signal",
"received_unix_s"}``, ``{"event": "saved", "rank", "step"}``, ``{"event": "done", "rank", "step"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True, help="directory of this job's Lightning checkpoints")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--log-file", default=None, help="JSON lines of steps, signals and saves")
    parser.add_argument("--notice", choices=["signal", "poll"], default="signal")
    parser.add_argument("--save-signal", default="SIGUSR1", help="the signal that asks for a save (signal mode)")
    parser.add_argument("--step-sleep-s", type=float, default=0.0, help="pretend a step takes longer")
    return parser.parse_args(argv)


class SignalFlag:
    """Set by the signal handler, read at a batch end."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_unix_s: float | None = None

    def handler(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name, self.received_unix_s = signal.Signals(signum).name, time.time()


def main(argv=None) -> int:
    opts = parse_args(argv)
    flag = SignalFlag()
    if opts.notice == "signal":
        # Before the imports below (seconds): a signal that comes meanwhile is a save request.
        signal.signal(signal.Signals[opts.save_signal], flag.handler)

    import lightning.pytorch as pl
    import torch
    from torch import nn

    rank = int(os.environ.get("RANK", "0"))
    log = open(opts.log_file, "a", buffering=1) if opts.log_file else None

    def record(event: str, **fields) -> None:
        if log is not None:
            log.write(json.dumps({"event": event, "rank": rank, **fields}) + "\n")

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return nn.functional.mse_loss(self.net(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class SaveOnNotice(pl.Callback):
        """On a notice: every rank saves the same step, then training stops."""

        def __init__(self) -> None:
            self.stopped = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if trainer.is_global_zero:
                record("step", step=step, loss=float(outputs["loss"]))
                time.sleep(opts.step_sleep_s)
            notice = None
            if opts.notice == "poll":
                import spotrun  # no torch import of its own; a few microseconds per call

                notice = spotrun.preemption_notice()
            asked = notice is not None or flag.signal_name is not None
            if not trainer.strategy.reduce_boolean_decision(asked, all=False):  # one all-reduce
                return
            if flag.signal_name:
                record("signal", signal=flag.signal_name, received_unix_s=flag.received_unix_s)
            if notice is None or notice.save:
                path = os.path.join(opts.ckpt_dir, f"step-{step}.ckpt")
                trainer.save_checkpoint(path + ".tmp")  # every rank; returns once rank 0 wrote it
                if trainer.is_global_zero:
                    os.replace(path + ".tmp", path)
                record("saved", step=step)
            trainer.should_stop = True
            self.stopped = True

    dataset = torch.utils.data.TensorDataset(*random_data(512))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    callback = SaveOnNotice()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp" if world_size > 1 else "auto",
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // world_size,
        max_steps=opts.max_steps,
        callbacks=[callback],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = Regression()
    resume = newest_checkpoint(opts.ckpt_dir)
    record("start", pid=os.getpid(), resumed_step=None if resume is None else int(resume[1]))
    trainer.fit(model, loader, ckpt_path=None if resume is None else resume[0])
    if not callback.stopped:
        record("done", step=trainer.global_step)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank is past its last collective: see __main__
    return 0


def random_data(n: int):
    """(inputs (n, 16), targets (n, 1)) float32, the same in every run."""
    import torch

    inputs = torch.randn(n, 16, generator=torch.Generator().manual_seed(1))
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def newest_checkpoint(ckpt_dir: str) -> tuple[str, int] | None:
    """(path, step) of the newest ``step-<N>.ckpt``, or ``None``."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return None
    steps = [int(m.group(1)) for m in map(re.compile(r"^step-(\d+)\.ckpt$").match, names) if m]
    return (os.path.join(ckpt_dir, f"step-{max(steps)}.ckpt"), max(steps)) if steps else None


if __name__ == "__main__":
    exit_code = main()
    # Skip gloo's teardown at interpreter exit: freeing its threads there aborted a rank after a
    # finished fit on a loaded machine ("terminate called without an active exception",
    # pytorch/pytorch#179291). Every rank passed the barrier and Lightning wrote its checkpoints.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

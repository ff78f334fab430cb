"""Train the byte-level GPT on the standard library's source, with spotrun checkpoints.

Single process: ``python -m spotrun.examples.train_gpt --steps 100``; data parallel under the
supervisor: ``spotrun run -- torchrun --nproc-per-node 2 -m spotrun.examples.train_gpt``.
``--fsdp`` and ``--tp N`` spread the model otherwise (:mod:`spotrun.examples.parallel`);
``--batch-size`` is the global batch. A fresh start is reproducible, and ``--log-file`` writes
one JSON line per step (what ``spotrun drill`` compares): ``docs/design/internals.md`` (Examples).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import lr_scheduler

import spotrun
from spotrun.errors import ConfigError
from spotrun.examples.gpt import GPT, GPTConfig
from spotrun.examples.keyed_dropout import SampleKeys
from spotrun.examples.parallel import Layout, Parallel
from spotrun.examples.samples import IndexedSamples, global_batch, samples_digest
from spotrun.examples.stdlib_text import StdlibText
from spotrun.examples.train_options import parse_args
from spotrun.tools.logs import configure_logging

log = logging.getLogger("spotrun.examples.train_gpt")

#: Gradient-norm clipping threshold.
GRAD_CLIP_NORM = 1.0


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: ``rank`` of ``world_size``, on ``device``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def setup_runtime() -> Runtime:
    """Join the process group if started by torchrun (``WORLD_SIZE``/``RANK`` set), pick the device.

    Backend ``nccl`` with device ``cuda:LOCAL_RANK`` when CUDA is available, else
    ``gloo`` on CPU. Without torchrun: world size 1, no process group.
    """
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return Runtime(0, 1, 0, torch.device("cuda" if cuda else "cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if cuda else "gloo", device_id=device if cuda else None)
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (not biases, not LayerNorm)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def build_scheduler(
    opt: torch.optim.Optimizer, schedule: str, steps: int, warmup_steps: int
) -> lr_scheduler.LRScheduler:
    """The LR schedule over ``steps`` optimizer steps, peaking at the optimizer's ``lr``.

    Built from torch's schedulers without lambdas, so ``state_dict()`` holds only JSON
    values. ``onecycle``: :class:`~torch.optim.lr_scheduler.OneCycleLR` rising for
    ``warmup_steps`` (at least 2); ``cosine``: linear warm-up then cosine decay to lr/10; ``constant``:
    linear warm-up then constant.

    Raises:
        ConfigError: unknown ``schedule``, or too few ``steps`` for ``onecycle``.
    """
    peak_lr = opt.param_groups[0]["lr"]
    ramp = (
        lr_scheduler.LinearLR(opt, start_factor=1.0 / (warmup_steps + 1), total_iters=warmup_steps)
        if warmup_steps
        else None
    )
    if schedule == "onecycle":
        rise_steps = max(warmup_steps, 2)  # OneCycleLR divides by (phase length - 1)
        if steps < rise_steps + 2:
            raise ConfigError(f"the onecycle schedule needs at least {rise_steps + 2} steps, got {steps}")
        return lr_scheduler.OneCycleLR(opt, max_lr=peak_lr, total_steps=steps, pct_start=rise_steps / steps)
    if schedule == "cosine":
        decay = lr_scheduler.CosineAnnealingLR(opt, T_max=steps - warmup_steps, eta_min=peak_lr / 10)
        return lr_scheduler.SequentialLR(opt, [ramp, decay], milestones=[warmup_steps]) if ramp else decay
    if schedule == "constant":
        return ramp or lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)
    raise ConfigError(f"unknown schedule {schedule!r}")


def schedule_steps(state: dict) -> int | None:
    """The step a saved LR schedule ends at (its ``--steps``); ``None``: it has no end (constant)."""
    if "total_steps" in state:  # OneCycleLR
        return state["total_steps"]
    if "T_max" in state:  # CosineAnnealingLR alone
        return state["T_max"]
    schedulers, milestones = state.get("_schedulers"), state.get("_milestones")
    if schedulers and milestones:  # SequentialLR: a warm-up, then the decay from the last milestone
        last = schedule_steps(schedulers[-1])
        return None if last is None else milestones[-1] + last
    return None


def _kind(state: dict) -> str:
    """Which torch scheduler saved ``state``, by the keys that tell them apart (others vary by version)."""
    return next((key for key in ("total_steps", "_schedulers", "T_max") if key in state), "no length")


class FixedLengthSchedule:
    """The LR scheduler as checkpointed state (its ``state_dict`` unchanged): a checkpoint whose
    schedule is of another kind, or ends at another step than this run's ``--steps``, is refused
    with :class:`~spotrun.StateMismatchError` before any state is loaded (torch's OneCycleLR
    would fail at the first step past its end, a cosine would silently rise again)."""

    def __init__(self, sched: lr_scheduler.LRScheduler, schedule: str, steps: int) -> None:
        self.sched, self.schedule, self.steps = sched, schedule, steps

    def state_dict(self) -> dict:
        return self.sched.state_dict()

    def load_state_dict(self, state: dict) -> None:
        mine = self.sched.state_dict()
        saved_end = schedule_steps(state)
        if _kind(state) != _kind(mine) or (saved_end is None) != (schedule_steps(mine) is None):
            raise spotrun.StateMismatchError(
                f"the checkpoint's LR schedule is not a --schedule {self.schedule} schedule"
            )
        if saved_end is not None and saved_end != self.steps:
            raise spotrun.StateMismatchError(
                f"the checkpoint's --schedule {self.schedule} LR schedule ends at step {saved_end} (the --steps "
                f"it was started with), not at --steps {self.steps}: a fixed-length schedule cannot be extended "
                f"or shortened (--steps {saved_end} resumes it)"
            )
        self.sched.load_state_dict(state)


def train_step(
    model: nn.Module,
    parallel: Parallel,
    opt: torch.optim.Optimizer,
    sched: lr_scheduler.LRScheduler,
    x: torch.Tensor,
    y: torch.Tensor,
    keys: SampleKeys | None,
) -> tuple[torch.Tensor, float]:
    """One optimizer step on the local batch ``x``, ``y`` (each (B, T)) with ``model`` (the module
    to call: a DDP wrapper or the sharded model); returns (this rank's mean loss, lr used)."""
    lr = sched.get_last_lr()[0]
    _, loss = model(x, y, keys)  # scalar
    opt.zero_grad(set_to_none=True)
    loss.backward()  # DDP and FSDP average gradients over the data-parallel ranks here
    parallel.sync_gradients(model)  # tensor parallel without FSDP: averaged here
    parallel.clip_gradients(model, GRAD_CLIP_NORM)
    opt.step()
    sched.step()
    return loss, lr


class Progress:
    """Per-step metrics line (rank 0, ``--log-file``) and periodic loss + tokens/s on stderr."""

    def __init__(self, args: argparse.Namespace, metrics: TextIO | None) -> None:
        self._metrics = metrics
        self._interval = args.log_interval
        self._tokens_per_step = args.batch_size * args.block_size  # --batch-size is global
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self.first_loss: float | None = None
        self.last_loss: float | None = None

    def record(self, step: int, loss: float, lr: float, samples: str) -> None:
        """Note that ``step`` finished with mean ``loss`` at learning rate ``lr`` on the global
        batch whose digest is ``samples``."""
        if self._metrics is not None:
            self._metrics.write(json.dumps({"step": step, "loss": loss, "lr": lr, "samples": samples}) + "\n")
            self._metrics.flush()
        if self.first_loss is None:
            self.first_loss = loss
            log.info("step %d: loss %.4f (first step of this run)", step, loss)
        self.last_loss = loss
        self._window_steps += 1
        if step % self._interval == 0:
            elapsed_s = time.perf_counter() - self._window_start
            log.info(
                "step %d: loss %.4f, lr %.3g, %.0f tokens/s",
                step,
                loss,
                lr,
                self._window_steps * self._tokens_per_step / elapsed_s,
            )
            self._window_start = time.perf_counter()
            self._window_steps = 0


@dataclass(frozen=True)
class Training:
    """What :func:`train` sets up: the model (raw, and as called), its optimizer, LR schedule and data."""

    layout: Layout
    parallel: Parallel
    model: GPT
    trained: nn.Module  # the module to call: a DDP wrapper or the sharded model
    opt: torch.optim.AdamW
    sched: lr_scheduler.LRScheduler
    loader: spotrun.ResumableDataLoader


def set_up_training(args: argparse.Namespace, rt: Runtime) -> Training:
    """Seed, build the model, spread it over the ranks, and build its optimizer, schedule and data.

    Raises:
        ConfigError: a layout or global batch this world size cannot run.
    """
    layout = Layout(rt.world_size, tp=args.tp, fsdp=args.fsdp)
    layout.check(args.heads, rt.distributed)
    per_rank_batch = layout.per_rank_batch(args.batch_size)
    torch.manual_seed(args.seed)  # identical replicas: every rank draws the same init
    random.seed(args.seed)  # unused here, but saved with every checkpoint: a fresh start is reproducible
    np.random.seed(args.seed)
    config = GPTConfig(
        block_size=args.block_size, width=args.width, depth=args.depth, heads=args.heads, dropout=args.dropout
    )
    model = GPT(config).to(rt.device)
    parallel = Parallel(layout, rt.device)
    trained = parallel.wrap(model, rt.device)  # the module to call; `model` stays the raw one
    opt = build_optimizer(model, args.lr, args.weight_decay)  # after sharding: DTensor parameters
    sched = build_scheduler(opt, args.schedule, args.steps, args.warmup_steps)
    dataset = StdlibText(args.block_size, max_bytes=args.max_bytes)
    loader = spotrun.ResumableDataLoader(
        IndexedSamples(dataset),
        batch_size=per_rank_batch,
        shuffle=True,
        seed=args.seed,
        num_replicas=layout.dp,
        rank=parallel.dp_rank,
        num_workers=args.num_workers,
        pin_memory=rt.device.type == "cuda",
    )
    log.info(
        "model: %d parameters; data: %d bytes, %d samples of %d tokens; %s on %s; "
        "global batch %d, %d per data-parallel rank",
        model.num_parameters(),
        dataset.data.numel(),
        len(dataset),
        args.block_size,
        layout.describe(),
        rt.device,
        args.batch_size,
        per_rank_batch,
    )
    return Training(layout, parallel, model, trained, opt, sched, loader)


def make_checkpointer(args: argparse.Namespace, t: Training) -> spotrun.Checkpointer | None:
    """The checkpointer of the model, optimizer, schedule and data; ``None`` with ``--no-checkpoints``."""
    if args.no_checkpoints:
        return None
    return spotrun.Checkpointer(
        state={
            "model": t.model,
            "optimizer": t.opt,
            "scheduler": FixedLengthSchedule(t.sched, args.schedule, args.steps),
            "data": t.loader,
        },
        uri=args.checkpoint_uri,
        interval_steps=args.save_interval,
        background_saves=not args.sync_saves,
        memory_interval_steps=args.memory_interval_steps,
    )


def train_loop(
    args: argparse.Namespace,
    rt: Runtime,
    t: Training,
    ckpt: spotrun.Checkpointer | None,
    step: int,
    progress: Progress,
) -> int | None:
    """Train from ``step`` up to ``args.steps``; returns the step reached, or ``None`` when
    stopped early after a requested save (or without one, as asked)."""
    while step < args.steps:
        for x, y, indices in t.loader:
            x = x.to(rt.device, non_blocking=True)  # (B, T)
            y = y.to(rt.device, non_blocking=True)  # (B, T)
            keys = SampleKeys(args.seed, step + 1, indices.tolist()) if args.sample_keyed_dropout else None
            loss, lr = train_step(t.trained, t.parallel, t.opt, t.sched, x, y, keys)
            step += 1
            batch = global_batch(indices.to(rt.device), t.parallel.dp_group) if t.layout.dp > 1 else indices.tolist()
            progress.record(step, t.parallel.mean_over_dp(loss), lr, samples_digest(batch))
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            if ckpt and ckpt.end_of_step(step):
                if ckpt.last_saved_step == step:
                    log.info("step %d saved on request; stopping", step)
                else:
                    log.info("stopping after step %d without a save, as asked", step)
                return None
            if step >= args.steps:
                break
    return step


def train(args: argparse.Namespace, rt: Runtime, metrics: TextIO | None) -> None:
    """Run (or resume) training up to ``args.steps``; returns early after a requested save.

    Raises:
        ConfigError: a layout or global batch this world size cannot run (before training).
    """
    t = set_up_training(args, rt)
    ckpt = make_checkpointer(args, t)
    try:
        step = ckpt.restore() if ckpt else 0
        log.info(
            "incarnation %s: %s",
            ckpt.incarnation if ckpt else "-",
            f"resumed from step {step}" if step else "fresh start",
        )
        progress = Progress(args, metrics)
        t.trained.train()
        final_step = train_loop(args, rt, t, ckpt, step, progress)
        if final_step is None:
            return
        if ckpt:
            ckpt.save(final_step, reason="final")
        if progress.first_loss is None:
            log.info("nothing to do: step %d already reached", final_step)
        else:
            log.info(
                "finished at step %d: first loss %.4f, final loss %.4f",
                final_step,
                progress.first_loss,
                progress.last_loss,
            )
    finally:
        if ckpt:
            ckpt.close()


def intra_op_threads(requested: int | None, rt: Runtime) -> tuple[int | None, str]:
    """How many intra-op threads this process uses, and why: (count or None to leave
    torch's choice, reason for the log).

    ``requested`` (``--intra-op-threads``) first, then ``$OMP_NUM_THREADS`` (torchrun sets 1
    when a node runs several processes), then on CPU the CPUs this process may use divided
    by the processes on this node (``$LOCAL_WORLD_SIZE``), at least 1.
    """
    if requested is not None:
        return requested, "--intra-op-threads"
    from_env = os.environ.get("OMP_NUM_THREADS")
    if from_env is not None:
        if from_env.strip().isdigit() and int(from_env) > 0:
            return int(from_env), "OMP_NUM_THREADS"
        return None, f"OMP_NUM_THREADS={from_env!r}, left to torch"
    if rt.device.type != "cpu":
        return None, "torch's default"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cpus // local_processes), f"{cpus} CPU(s) / {local_processes} process(es) on this node"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (0 on completion and after a requested save,
    1 when a newer start of the job took over the checkpoint root, 2 when the options or the
    checkpoint do not fit: found before training)."""
    args = parse_args(argv)
    rt = setup_runtime()
    # text, or one JSON object per line under spotrun run --log-format json ($SPOTRUN_LOG_FORMAT)
    configure_logging(
        logging.INFO if rt.rank == 0 else logging.WARNING, prefix=f"[rank {rt.rank}]", fields={"rank": rt.rank}
    )
    threads, source = intra_op_threads(args.intra_op_threads, rt)
    if threads is not None:
        # Always through torch.set_num_threads, also for a count from $OMP_NUM_THREADS: it
        # switches MKL's dynamic thread choice off, so both ways compute the same.
        torch.set_num_threads(threads)
    log.info("intra-op threads: %d per process (%s)", torch.get_num_threads(), source)
    metrics = None
    if args.log_file and rt.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_file)), exist_ok=True)
        metrics = open(args.log_file, "a", encoding="utf-8")
    try:
        train(args, rt, metrics)
        if dist.is_initialized():
            dist.barrier()  # no rank tears gloo down while a peer still receives the last collective
    except spotrun.FencedError as exc:  # a newer start of this job owns the checkpoints: this copy is an orphan
        log.error("stopping: %s", exc)
        return 1
    except ConfigError as exc:  # found before training started; every rank finds the same
        log.error("cannot train: %s", exc)
        return 2
    except spotrun.StateMismatchError as exc:  # the checkpoint does not fit these settings; every rank finds the same
        log.error(
            "cannot resume: %s (nothing was changed; resume with the settings it was saved with, or "
            "--checkpoint-uri elsewhere; --batch-size is the global batch)",
            exc,
        )
        return 2
    finally:
        if metrics is not None:
            metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_code = main()
    # Skip interpreter finalization: gloo's worker threads can still hold work objects with
    # Python references after destroy_process_group(), and freeing them while the interpreter
    # is torn down aborts the process now and then ("terminate called without an active
    # exception", SIGABRT after training finished; pytorch/pytorch#179291 describes it).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

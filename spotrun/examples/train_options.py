"""The example trainer's command-line options (``python -m spotrun.examples.train_gpt --help``)."""

from __future__ import annotations

import argparse

from spotrun.examples.stdlib_text import DEFAULT_MAX_BYTES

#: The first line of :mod:`spotrun.examples.train_gpt`'s docstring, shown by ``--help``.
DESCRIPTION = "Train the byte-level GPT on the standard library's source, with spotrun checkpoints."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(prog="python -m spotrun.examples.train_gpt", description=DESCRIPTION)
    _add_model_options(p)
    _add_optimizer_options(p)
    _add_checkpoint_options(p)
    _add_run_options(p)
    args = p.parse_args(argv)
    _check_options(p, args)
    return args


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The run's length, the model's shape, the global batch and how the ranks split the model."""
    p.add_argument("--steps", type=int, default=600, help="optimizer steps in total (default: %(default)s)")
    p.add_argument("--width", type=int, default=128, help="embedding width (default: %(default)s)")
    p.add_argument("--depth", type=int, default=2, help="transformer blocks (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per sample (default: %(default)s)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="global batch: samples per step over all data-parallel ranks; must divide by "
        "their number, world size / --tp (default: %(default)s)",
    )
    p.add_argument(
        "--fsdp", action="store_true", help="shard parameters, gradients and optimizer state with FSDP2 instead of DDP"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: ranks that split each block; divides the world size "
        "and --heads (default: %(default)s)",
    )


def _add_optimizer_options(p: argparse.ArgumentParser) -> None:
    """Learning rate, its schedule, weight decay and dropout."""
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument(
        "--schedule",
        choices=("onecycle", "cosine", "constant"),
        default="onecycle",
        help="learning-rate schedule (default: %(default)s)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="steps of LR warm-up; for onecycle, the rising phase (default: 10%% of --steps)",
    )
    p.add_argument(
        "--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default: %(default)s)"
    )
    p.add_argument("--dropout", type=float, default=0.1, help="dropout probability (default: %(default)s)")
    p.add_argument(
        "--sample-keyed-dropout",
        action="store_true",
        help="draw each dropout mask from (seed, sample index, layer, step) instead of the "
        "rank's generator: the same masks at any world size or layout",
    )


def _add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    """The seed, and when and where spotrun saves."""
    p.add_argument("--seed", type=int, default=0, help="seed of the model init and data order (default: %(default)s)")
    p.add_argument(
        "--save-interval",
        type=int,
        default=100,
        help="save every this many steps; 0 = only on request and at the end (default: %(default)s)",
    )
    p.add_argument(
        "--sync-saves",
        action="store_true",
        help="periodic saves block training until they commit (default: written in the background)",
    )
    p.add_argument(
        "--memory-interval-steps",
        type=int,
        default=None,
        help="save to the fast tier in host memory every this many steps (default: spotrun run's "
        "--memory-interval-steps, else off; needs spotrun run's tier or $SPOTRUN_MEMORY_DIR)",
    )
    p.add_argument(
        "--no-checkpoints",
        action="store_true",
        help="train without spotrun: no restore, no saves, no save requests (comparisons only)",
    )
    p.add_argument(
        "--checkpoint-uri",
        default=None,
        help="checkpoint root (directory or s3://...); default $SPOTRUN_CHECKPOINT_URI, else ./checkpoints",
    )


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """Logs, the data loader, the training text and threads."""
    p.add_argument("--log-file", default=None, help="append one JSON line per step here (rank 0)")
    p.add_argument(
        "--log-interval",
        type=int,
        default=25,
        help="report loss and tokens/s to stderr every this many steps (default: %(default)s)",
    )
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes (default: %(default)s)")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="cap on the training text, in bytes (default: %(default)s)",
    )
    p.add_argument(
        "--step-sleep-s",
        type=float,
        default=0.0,
        help="pause after every step, in seconds, to slow a run down for tests (default: %(default)s)",
    )
    p.add_argument(
        "--intra-op-threads",
        type=int,
        default=None,
        help="torch intra-op threads per process (default: $OMP_NUM_THREADS, else on CPU the "
        "CPUs of this process divided by the processes on this node); a resume is "
        "bit-identical to an uninterrupted run only with the same count",
    )


def _check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse values out of range (``p.error`` exits with status 2); fill in ``--warmup-steps``."""
    if args.intra_op_threads is not None and args.intra_op_threads < 1:
        p.error("--intra-op-threads must be at least 1")
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    for name in ("steps", "batch_size", "log_interval", "tp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("warmup_steps", "save_interval", "num_workers", "step_sleep_s", "weight_decay"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    if args.warmup_steps >= args.steps:
        p.error("--warmup-steps must be smaller than --steps")
    if args.schedule == "onecycle" and args.steps < max(args.warmup_steps, 2) + 2:
        p.error("--schedule onecycle needs --steps at least --warmup-steps + 2 (and at least 4)")

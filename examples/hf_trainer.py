"""Hugging Face ``Trainer`` that saves its own checkpoint on a preemption notice and resumes from it.

spotrun watches the notices and restarts the command; the Trainer keeps its own checkpoints
(``<output-dir>/checkpoint-<global_step>/``)::

    spotrun run --grace-period-s 60 -- python examples/hf_trainer.py --output-dir runs/hf --max-steps 1000
    spotrun run --grace-period-s 60 -- torchrun --nproc-per-node 2 examples/hf_trainer.py --output-dir runs/hf

The model is a tiny GPT-2 built from a config (119 K parameters, no download) trained on
random tokens (seeded), so the recipe runs anywhere; put your own model and data in its place.

:class:`SaveOnNotice` is the part to copy. It hears the notice as a signal (``--notice signal``:
its own handler for ``--save-signal``, SIGTERM by default; spotrun's foreign-saver mode sends that
signal to the workers at once) or by polling ``spotrun.preemption_notice()`` at each step end
(``--notice poll``). Under torchrun every rank must save the same step, so at each step end one
all-reduce (MAX) of a one-element flag turns the ranks' answers into one decision (a CPU tensor
on gloo, a CUDA tensor on nccl). Then it sets ``control.should_save`` and
``control.should_training_stop``: the Trainer writes ``checkpoint-<global_step>`` (model,
optimizer, scheduler, RNG and trainer state) and returns from ``train()``, and the script
exits 0.

The Trainer writes a checkpoint directory in place, so one cut by a kill looks like any other
to ``transformers.trainer_utils.get_last_checkpoint``. :class:`SaveOnNotice` therefore writes a
marker file (``COMPLETE``) into each checkpoint after every rank finished it, and the restart
resumes (``trainer.train(resume_from_checkpoint=...)``) from the newest checkpoint with the
marker: ``global_step`` continues from there.

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

MARKER = "COMPLETE"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="the Trainer's output directory (its checkpoints)")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--log-file", default=None, help="JSON lines of steps, signals and saves")
    parser.add_argument("--notice", choices=["signal", "poll"], default="signal")
    parser.add_argument("--save-signal", default="SIGTERM", help="the signal that asks for a save (signal mode)")
    parser.add_argument("--save-steps", type=int, default=0, help="also save every K steps (0: only on a notice)")
    parser.add_argument("--step-sleep-s", type=float, default=0.0, help="pretend a step takes longer")
    return parser.parse_args(argv)


class SignalFlag:
    """Set by the signal handler, read at a step end."""

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
        # Before the imports below (seconds): a signal that comes meanwhile is then a save
        # request at the first step end, not the end of the process.
        signal.signal(signal.Signals[opts.save_signal], flag.handler)

    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    rank = int(os.environ.get("RANK", "0"))
    log = open(opts.log_file, "a", buffering=1) if opts.log_file else None

    def record(event: str, **fields) -> None:
        if log is not None:
            log.write(json.dumps({"event": event, "rank": rank, **fields}) + "\n")

    def agree(asked: bool, device) -> bool:
        """True on every rank when any rank was asked (one all-reduce; none in one process)."""
        if not (dist.is_available() and dist.is_initialized()):
            return asked
        on = device if dist.get_backend() == "nccl" else "cpu"  # nccl: CUDA tensors; gloo: CPU
        value = torch.tensor([1 if asked else 0], device=on)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    class SaveOnNotice(TrainerCallback):
        """On a notice: every rank saves the same step, then training stops."""

        def __init__(self) -> None:
            self.stopped = False

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                time.sleep(opts.step_sleep_s)
            notice = None
            if opts.notice == "poll":
                import spotrun  # no torch import of its own; a few microseconds per call

                notice = spotrun.preemption_notice()
            if agree(notice is not None or flag.signal_name is not None, args.device):
                if flag.signal_name:
                    record("signal", signal=flag.signal_name, received_unix_s=flag.received_unix_s)
                control.should_save = notice is None or notice.save
                control.should_training_stop = True
                self.stopped = True
            return control

        def on_save(self, args, state, control, **kwargs):
            agree(False, args.device)  # a barrier: every rank's part of the checkpoint is written
            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if state.is_world_process_zero:
                with open(os.path.join(path, MARKER), "w") as f:
                    os.fsync(f.fileno())
            record("saved", step=state.global_step)
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                record("step", step=state.global_step, loss=logs["loss"])
            return control

    config = GPT2Config(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=255, eos_token_id=255
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        save_strategy="steps" if opts.save_steps else "no",
        save_steps=opts.save_steps or 500,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    callback = SaveOnNotice()
    trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(256, config), callbacks=[callback])
    resume = newest_complete_checkpoint(opts.output_dir, PREFIX_CHECKPOINT_DIR)
    record("start", pid=os.getpid(), resumed_step=None if resume is None else int(resume.rsplit("-", 1)[1]))
    trainer.train(resume_from_checkpoint=resume)
    if not callback.stopped:
        record("done", step=trainer.state.global_step)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # else gloo's threads may abort the exit (transformers 4.x)
    return 0


class RandomTokens:
    """``n`` samples of random tokens (the same in every run): {"input_ids", "labels"}, each (n_positions,) int64."""

    def __init__(self, n: int, config) -> None:
        import torch

        self._tokens = torch.randint(
            config.vocab_size, (n, config.n_positions), generator=torch.Generator().manual_seed(1)
        )

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self._tokens[i], "labels": self._tokens[i]}


def newest_complete_checkpoint(output_dir: str, prefix: str) -> str | None:
    """The newest ``<prefix>-<step>`` directory with the marker, or ``None``."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)$")
    steps = [
        int(m.group(1))
        for m in map(pattern.match, names)
        if m and os.path.exists(os.path.join(output_dir, m.group(0), MARKER))
    ]
    return os.path.join(output_dir, f"{prefix}-{max(steps)}") if steps else None


if __name__ == "__main__":
    sys.exit(main())

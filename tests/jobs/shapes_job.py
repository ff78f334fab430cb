"""Worker for tests/e2e/test_script_shapes.py: one tiny training script in the shape of a real
user's (``--shape NAME``), checkpointed with spotrun, to be preempted and resumed.

Usage (under ``spotrun run -- torchrun --nproc-per-node 2``):
    python shapes_job.py --shape NAME --steps N --log-file F [--step-sleep-s S]

Shapes: epochs-fork, epochs-spawn-persistent, grad-accum, amp, compile, sequential-lr,
iterable, iterable-global-rng (see SHAPES). Rank 0 appends ``{"step", "loss", "lr"}`` (amp:
and ``"scale"``) per optimizer step to the log file; the run ends with a final save at step
N. The dataset (40 samples, 8 per global batch) is shorter than the run, so every shape
crosses epoch boundaries; a background periodic save every 3 steps is in flight or just done at
those boundaries (field case C18).
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown

import spotrun

SHAPES = (
    "epochs-fork",
    "epochs-spawn-persistent",
    "grad-accum",
    "amp",
    "compile",
    "sequential-lr",
    "iterable",
    "iterable-global-rng",
)
SAMPLES = 40
BATCH_PER_RANK = 4
ACCUMULATION = 3  # micro-batches per optimizer step in grad-accum


class Regression(torch.utils.data.Dataset):
    """A fixed map-style dataset: x in R^4, y = a noisy linear function of x."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Stream(torch.utils.data.IterableDataset):
    """An endless stream drawn from its own generator, with its own position: the state a user
    checkpoints through ``rank_state`` (each rank's stream is its own)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0

    def __iter__(self):
        while True:
            x = torch.randn(4, generator=self.generator)
            self.position += 1
            yield x, (x.sum() + 0.01 * self.position).reshape(1)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.position = state["position"]


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # identical replicas on every rank
    return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--log-file", required=True)
    parser.add_argument("--step-sleep-s", type=float, default=0.0)
    args = parser.parse_args()
    shape = args.shape
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    model = build_model()
    if shape == "compile":
        # aot_eager: the graph capture and autograd tracing of a real compile, without the C++
        # build inductor needs on CPU (tens of seconds per rank on 2 shared cores).
        model = torch.compile(model, backend="aot_eager")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": opt}
    rank_state = {}

    if shape.startswith("iterable"):
        stream = Stream(seed=100 + rank)
        # A plain DataLoader draws a base seed at every iter(): from its own generator if it
        # has one, else from the global torch RNG, which a run resumed mid-stream then draws
        # at another step than the uninterrupted one (iterable-global-rng shows it).
        own = {} if shape == "iterable-global-rng" else {"generator": torch.Generator()}
        loader = torch.utils.data.DataLoader(stream, batch_size=BATCH_PER_RANK, **own)
        rank_state["data"] = stream
    else:
        workers = {
            "epochs-fork": dict(num_workers=2, multiprocessing_context="fork"),
            "epochs-spawn-persistent": dict(num_workers=2, multiprocessing_context="spawn", persistent_workers=True),
        }.get(shape, {})
        loader = spotrun.ResumableDataLoader(Regression(), batch_size=BATCH_PER_RANK, shuffle=True, seed=0, **workers)
        state["data"] = loader
    sched = None
    if shape == "sequential-lr":
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
        decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps - 4)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[4])
        state["scheduler"] = sched
    scaler = None
    if shape == "amp":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        state["scaler"] = scaler

    ckpt = spotrun.Checkpointer(state, rank_state=rank_state or None, interval_steps=3)
    step = ckpt.restore()
    micro = []  # grad-accum: (x, y) micro-batches of the optimizer step being gathered

    def log(loss_value: float) -> None:
        if rank == 0:
            row = {"step": step, "loss": loss_value, "lr": opt.param_groups[0]["lr"]}
            if scaler is not None:  # a scale of 2^k changes no loss: it must be compared itself
                row["scale"] = scaler.get_scale()
            with open(args.log_file, "a") as f:
                f.write(json.dumps(row) + "\n")

    while step < args.steps:
        for x, y in loader:
            if shape == "grad-accum":
                micro.append((x, y))
                if len(micro) < ACCUMULATION:
                    continue
                opt.zero_grad()
                total = 0.0
                for i, (mx, my) in enumerate(micro):
                    if i < ACCUMULATION - 1:
                        with ddp.no_sync():
                            loss = torch.nn.functional.mse_loss(ddp(mx), my) / ACCUMULATION
                            loss.backward()
                    else:
                        loss = torch.nn.functional.mse_loss(ddp(mx), my) / ACCUMULATION
                        loss.backward()
                    total += loss.item()
                micro.clear()
                opt.step()
                loss_value = total
            elif shape == "amp":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                loss_value = loss.item()
            else:
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                loss_value = loss.item()
            if sched is not None:
                sched.step()
            step += 1
            log(loss_value)
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)  # leaves the test time to preempt mid-run
            if ckpt.end_of_step(step):
                raise SystemExit(0)
            if step >= args.steps:
                break
    ckpt.save(step, reason="final")
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)

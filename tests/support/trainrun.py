"""Helpers for end-to-end tests: `spotrun run -- torchrun ... train_gpt` as a user runs it."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

import torch

from spotrun.checkpoint.restore import load_committed
from spotrun.storage import open_storage

#: A small, fast configuration of the example trainer (2 ranks on 2 CPU cores).
TRAIN_ARGS = [
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--dropout",
    "0.1",
    "--max-bytes",
    "300000",
    "--schedule",
    "onecycle",
    "--lr",
    "0.003",
    "--warmup-steps",
    "5",
    "--log-interval",
    "1000",
]

#: Steps and checkpoint interval of the shared uninterrupted reference run (conftest.py).
REFERENCE_STEPS = 30
REFERENCE_SAVE_INTERVAL = 10


def torchrun_command(steps: int, save_interval: int, log_file: pathlib.Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "spotrun.examples.train_gpt",
        "--steps",
        str(steps),
        "--save-interval",
        str(save_interval),
        "--log-file",
        str(log_file),
        *TRAIN_ARGS,
        *extra,
    ]


def start_supervised(
    checkpoint_uri: str,
    command: list[str],
    *,
    grace_period_s: float = 60,
    env: dict | None = None,
    extra_options: list[str] | None = None,
    log_path: pathlib.Path | None = None,
    drop_env: tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start `spotrun run` in its own session; its output goes to ``log_path`` (or is inherited).

    ``env`` adds to this process's environment; ``drop_env`` names variables to leave out.
    """
    out = open(log_path, "ab") if log_path else None
    child_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in drop_env}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            checkpoint_uri,
            "--grace-period-s",
            str(grace_period_s),
            *(extra_options or []),
            "--",
            *command,
        ],
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        env=child_env,
        start_new_session=True,
    )


def rendezvous_port() -> int:
    """A free 127.0.0.1 port for a torchrun rendezvous that several launchers must find.

    Drawn below the kernel's ephemeral range: a port from ``bind(0)`` is free only until the
    launchers bind it seconds later (slower under load), and in between any outgoing connection
    or ``bind(0)`` on the machine may take it; no launcher then hosts the rendezvous and both
    wait as clients. Below the range only another explicit choice can take it.
    """
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # not the tests' seeded generators
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in 10000-{low - 1} for a rendezvous")


def read_log(log_file: pathlib.Path) -> list[dict]:
    if not log_file.exists():
        return []
    rows = []
    for line in log_file.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut by a kill
            continue
    return rows


def last_loss_per_step(log_file: pathlib.Path) -> dict[int, float]:
    """step -> loss of the LAST time that step ran (steps re-run after a resume count last)."""
    return {row["step"]: row["loss"] for row in read_log(log_file)}


def wait_for_step(
    log_file: pathlib.Path,
    step: int,
    proc: subprocess.Popen,
    timeout_s: float = 300,
    outputs: tuple[pathlib.Path, ...] = (),
) -> None:
    """Wait until the training log reaches ``step``; on failure the message ends with the last
    lines of each file in ``outputs`` (supervisor, launcher and worker output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = read_log(log_file)
        if rows and rows[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited with {proc.returncode} before step {step}" + tails(outputs))
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} not reached in {timeout_s} s" + tails(outputs))
        time.sleep(0.05)


def tails(paths: tuple[pathlib.Path, ...], chars: int = 4000) -> str:
    """The last ``chars`` characters of each file, headed by its name (for assertion messages)."""
    parts = []
    for path in paths:
        body = path.read_text(errors="replace")[-chars:] if path.exists() else "(no such file)"
        parts.append(f"\n--- {path.name} (last {chars} characters) ---\n{body}")
    return "".join(parts)


def final_tensors(checkpoint_uri: str, step: int, world_size: int = 2) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of ``step``, by manifest name."""
    loaded = load_committed(open_storage(checkpoint_uri), step, 0, world_size)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, torch.Tensor):
            flat[prefix] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(f"{prefix}/{i}", v)

    for name in ("model", "optimizer"):
        walk(name, loaded.replicated[name])
    return flat


def sigterm(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGTERM)


def ls_json(checkpoint_uri: str) -> list[dict]:
    """What `spotrun ls URI --json` prints, parsed."""
    out = subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", checkpoint_uri, "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(out.stdout)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process below it if it still runs (test clean-up)."""
    if proc.poll() is not None:
        return
    from spotrun.supervisor.process import descendants

    for pid in [proc.pid] + [p.pid for p in descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def assert_same_as_reference(reference, checkpoint_uri: str, log_file: pathlib.Path) -> None:
    """Per-step losses (last run of each step) and every model/optimizer tensor of the last step
    (REFERENCE_STEPS) are bit-identical to the uninterrupted run of the ``reference`` fixture."""
    ref_losses, ref_tensors, _ = reference
    assert last_loss_per_step(log_file) == ref_losses
    got = final_tensors(checkpoint_uri, REFERENCE_STEPS)
    assert sorted(got) == sorted(ref_tensors)
    for name, tensor in ref_tensors.items():
        assert torch.equal(got[name], tensor), f"{name} differs"


def preempt_and_resume_exactly(
    reference,
    checkpoint_uri: str,
    tmp_path: pathlib.Path,
    processes: list,
    *,
    extra_options: list[str] = (),
    drop_env: tuple[str, ...] = (),
    wait_s: float = 600,
) -> int:
    """One preemption-and-resume cycle of the example trainer under `spotrun run`, asserted.

    Starts the REFERENCE_STEPS-step job, SIGTERMs the supervisor at a random step: it must
    exit 143 with exactly one complete emergency checkpoint at or after that step; the same
    command again must resume from it (its first step is the next one), exit 0, and end
    bit-identical to the uninterrupted ``reference`` run (conftest.py). Supervisors are
    appended to ``processes`` (the fixture kills what is left). Returns the emergency step.
    """
    import random

    log_file = tmp_path / "train.jsonl"

    def launch(name: str, *extra: str) -> subprocess.Popen:
        proc = start_supervised(
            checkpoint_uri,
            torchrun_command(REFERENCE_STEPS, REFERENCE_SAVE_INTERVAL, log_file, *extra),
            extra_options=[*extra_options, "--notice", "none"],
            drop_env=drop_env,
            log_path=tmp_path / f"{name}.log",
        )
        processes.append(proc)
        return proc

    preempt_at = random.Random().randint(3, REFERENCE_STEPS - 4)
    print(f"preempting at step {preempt_at}")
    proc = launch("first", "--step-sleep-s", "0.05")
    wait_for_step(log_file, preempt_at, proc)
    sigterm(proc)
    assert proc.wait(timeout=wait_s) == 143, (tmp_path / "first.log").read_text()[-3000:]
    listed = subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", checkpoint_uri, "--json", *extra_options],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in drop_env},
    )
    assert listed.returncode == 0, listed.stderr
    emergency = [row for row in json.loads(listed.stdout) if row["reason"] == "emergency"]
    assert [row["status"] for row in emergency] == ["complete"]
    emergency_step = emergency[0]["step"]
    assert emergency_step >= preempt_at

    ran_before = len(read_log(log_file))
    proc = launch("second")
    assert proc.wait(timeout=wait_s) == 0, (tmp_path / "second.log").read_text()[-3000:]
    resumed = [row["step"] for row in read_log(log_file)[ran_before:]]
    assert resumed == list(range(emergency_step + 1, REFERENCE_STEPS + 1))
    assert_same_as_reference(reference, checkpoint_uri, log_file)
    return emergency_step


def restart_resumes_exactly(
    reference,
    tmp_path: pathlib.Path,
    processes: list,
    checkpoint_uri: str,
    log_file: pathlib.Path,
    command: list[str],
    resumed_step: int,
) -> None:
    """Run ``command`` again under a supervisor: it must resume at ``resumed_step + 1``, finish
    (exit 0) and end bit-identical to the uninterrupted ``reference`` run."""
    logged_before_restart = len(read_log(log_file))
    proc = start_supervised(checkpoint_uri, command, log_path=tmp_path / "second.log")
    processes.append(proc)
    assert proc.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert read_log(log_file)[logged_before_restart]["step"] == resumed_step + 1
    assert_same_as_reference(reference, checkpoint_uri, log_file)

"""A torchrun job whose every rank writes a JSON report (``OUT_DIR/rank-R.json``): run it with a
bound, kill its whole process group if it hangs, and read the reports."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

#: A hang fails the test after this, not after gloo's 30 minutes.
TORCHRUN_TIMEOUT_S = 300


def run_ranks(
    ranks: int,
    worker: pathlib.Path,
    args: list[str],
    out_dir: pathlib.Path,
    env: dict[str, str] | None = None,
    timeout_s: float = TORCHRUN_TIMEOUT_S,
) -> tuple[list[dict], str]:
    """Run ``worker args`` on ``ranks`` ranks under ``torchrun --standalone`` (``out_dir`` is made
    first; ``env`` is added to this process's): each rank's report by rank, and torchrun's output.
    A job that fails, or runs past ``timeout_s`` (then killed), fails the test with its output."""
    out_dir.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        + [str(worker), *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a hang is killed whole
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"workers hung for {timeout_s} s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, output[-4000:]
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(ranks)], output

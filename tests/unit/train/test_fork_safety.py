"""A training script forks while spotrun's threads, process group, exit hooks and signal
handlers exist: its children never act on them (field case C18, spotrun.tools.process_local)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from spotrun.checkpoint import catalog
from spotrun.storage import open_storage
from tests.support.paths import JOBS

WORKERS = str(JOBS)


@pytest.mark.slow
def test_a_script_that_forks_in_every_way_during_background_saves_trains_to_its_end(tmp_path):
    """C18: loader workers by fork, forkserver and spawn, persistent or not (spotrun's loader
    and torch's), a fork Pool and a subprocess, over two epochs, with a background save at
    every step on 2 gloo ranks: every child ends cleanly, training reaches its last step, and
    the save still in flight at exit commits in the rank itself."""
    out = tmp_path / "out"
    out.mkdir()
    ckpt = tmp_path / "ck"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            f"{WORKERS}/forking_job.py",
            str(ckpt),
            str(out),
            "--epochs",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        output, _ = job.communicate(timeout=280)
    finally:  # a hung job: its ranks and their loader workers go too, not torchrun alone
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    proc = subprocess.CompletedProcess(job.args, job.returncode)
    assert proc.returncode == 0, output[-4000:]
    for rank in (0, 1):
        assert json.loads((out / f"result-rank-{rank}.json").read_text()) == {"steps": 60}
    for symptom in (
        "Aborted",
        "segmentation fault",
        "killed by signal",
        "system_error",
        "Traceback",
        "still being written",
    ):  # the saver's exit hook ran in a child
        assert symptom not in output, output[-4000:]
    assert catalog.newest_complete(open_storage(str(ckpt))).step == 60


def _run_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)


def test_exit_hooks_run_in_the_registering_process_only(tmp_path):
    """C18's mechanism: a child forked by multiprocessing (which runs the early exit hooks when
    it ends) or by os.fork and ending through sys.exit never runs spotrun's exit hooks; the
    process that registered them does, once each."""
    proc = _run_script(
        tmp_path,
        """
        import multiprocessing, os, sys
        from spotrun.tools import process_local
        log = os.path.join(sys.argv[1], "ran")
        def note(kind):
            with open(log, "a") as f:
                f.write(f"{kind} {os.getpid()}\\n")
        process_local.at_exit(note, "early", before_thread_pools=True)
        process_local.at_exit(note, "late")
        if __name__ == "__main__":
            child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
            child.start(); child.join()
            assert child.exitcode == 0
            pid = os.fork()
            if pid == 0:
                sys.exit(0)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
            print("parent", os.getpid())
    """,
    )
    assert proc.returncode == 0, proc.stderr
    parent = proc.stdout.split("parent ")[1].strip()
    assert sorted((tmp_path / "ran").read_text().splitlines()) == [f"early {parent}", f"late {parent}"]


def test_a_forked_child_has_the_signal_handlers_it_would_have_had_without_spotrun(tmp_path):
    """C18: a Checkpointer's SIGTERM/SIGINT handlers stay in the rank; a forked child gets back
    the ones before it, so Process.terminate() ends a forked child and a Pool's exit
    (which terminates its workers) returns."""
    proc = _run_script(
        tmp_path,
        """
        import multiprocessing, os, signal, sys, time
        import torch, spotrun
        def sleep_long():
            time.sleep(600)
        def square(x):
            return x * x
        if __name__ == "__main__":
            ckpt = spotrun.Checkpointer({"w": torch.zeros(2)}, uri=os.path.join(sys.argv[1], "ck"))
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL  # spotrun's, in the rank
            fork = multiprocessing.get_context("fork")
            child = fork.Process(target=sleep_long)
            child.start()
            child.terminate()
            child.join(60)
            print("child exit", child.exitcode)
            for _ in range(5):
                with fork.Pool(2) as pool:  # __exit__ terminates the workers
                    assert pool.map(square, range(8)) == [x * x for x in range(8)]
            print("pools done")
            ckpt.close()
    """,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"child exit {-15}" in proc.stdout
    assert "pools done" in proc.stdout

"""Issue 9, item 4: a save's peak extra memory is bounded (a functional bound, never a timing).

Each measurement runs in a fresh child process (``python -m tests.support.memory_probe``) that builds a
256 MiB training state (a float32 model and its AdamW state after one step), prepares the save
(objects built, a small warm-up save elsewhere so imports and thread pools are not counted),
then reads the process's resident memory around the save: ``VmHWM`` (peak RSS, reset to the
current RSS through ``/proc/self/clear_refs`` after collecting garbage and trimming the C heap)
minus ``VmRSS`` before. Written files sit in the page cache, which is not the process's RSS;
torch's CPU allocator caches nothing (it calls the C heap, which is trimmed before the baseline).

Bounds (issue 9, item 4):

* a synchronous (emergency) save holds at most a bounded buffer: extra <= 0.25x the state;
* a background save holds its staging copy plus a bounded buffer: extra <= 1.1x the state,
  measured over the first save (which allocates the staging buffers) and a second (which
  reuses them).

A first test checks the method itself on a known allocation, so that a broken probe cannot
make the bounds pass vacuously.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

REPO_ROOT = str(REPO)
STATE_MIB = 256
#: Issue 9, item 4 and its targets.
SYNC_SAVE_BOUND = 0.25
BACKGROUND_SAVE_BOUND = 1.1
#: Generous: a child builds a 256 MiB state and saves it, on a loaded 2-core machine.
PROBE_TIMEOUT_S = 600

pytestmark = pytest.mark.slow


def probe(action: str, root) -> dict:
    """Run one measurement in a child process; its JSON result."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.memory_probe",
            action,
            "--state-mib",
            str(STATE_MIB),
            "--root",
            str(root),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPOTRUN_")},
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, f"probe {action} printed no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = results[-1]
    assert "error" not in result, f"probe {action} could not run: {result['error']}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result


def describe(result: dict) -> str:
    mib = 2**20
    return (
        f"{result['action']}: {result['extra_bytes'] / mib:.1f} MiB extra at peak "
        f"({result['extra_bytes'] / result['state_bytes']:.2f}x the {result['state_bytes'] / mib:.1f} MiB state; "
        f"RSS {result['before_bytes'] / mib:.0f} MiB before, peak {result['peak_bytes'] / mib:.0f} MiB)"
    )


def test_4_the_probe_counts_a_known_allocation(tmp_path):
    result = probe("known-allocation", tmp_path)
    print(describe(result))
    assert result["state_bytes"] == pytest.approx(STATE_MIB * 2**20, rel=0.02)
    assert result["extra_bytes"] == pytest.approx(result["state_bytes"], rel=0.05), describe(result)


def test_4_emergency_save_holds_at_most_a_quarter_of_the_state_beyond_it(tmp_path):
    result = probe("spotrun-sync-save", tmp_path)
    print(describe(result))
    assert result["extra_bytes"] <= SYNC_SAVE_BOUND * result["state_bytes"], describe(result)


def test_4_background_save_holds_its_staging_copy_and_a_bounded_buffer(tmp_path):
    result = probe("spotrun-background-save", tmp_path)
    print(describe(result))
    assert result["extra_bytes"] <= BACKGROUND_SAVE_BOUND * result["state_bytes"], describe(result)

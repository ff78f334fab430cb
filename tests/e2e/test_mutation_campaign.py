"""A damaged or hostile checkpoint never crashes, hangs or trains (issue 21, item 5): the
mutation campaign of tests/support/mutation_campaign.py (edits: tests/support/mutation_edits.py) against a
replicated and an FSDP2 (2 ranks, torchrun + gloo) format-4 root, for the restore and for
``spotrun ls``, ``verify``, ``export --format hf`` and ``gc --dry-run``, each edit in a child
under a 2 GiB address-space limit and a time bound. It reports (in the run's figures) how many edits it tried and how
many fell back, were refused or were harmless, and every failure grouped by its kind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.slow  # two saves (one under torchrun) and ~140 forked children

MIN_EDITS = 40
CAMPAIGN_TIMEOUT_S = 280  # under pytest-timeout's 300 s


def failure_kind(failure: str) -> str:
    """``"restore: KeyError"``, ``"verify: traceback"``: a failure without its details."""
    tool, _, rest = failure.partition(": ")
    return f"{tool}: {rest.split(':')[0].split(' (')[0][:60]}"


def test_every_edit_of_the_newest_step_falls_back_or_is_harmless_for_restore_and_every_tool(tmp_path, figures):
    """Issue 21: >= 40 edits of a format-4 step's manifest, rank index and safetensors header
    (digests recomputed), and links or a FIFO in place of its files: the restore resumes the
    previous step bit-exactly or the untouched values, the tools exit with their documented
    codes and one-line reasons, nothing exceeds 2 GiB of address space, hangs or crashes."""
    result = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.mutation_campaign",
            "--work",
            str(tmp_path / "work"),
            "--result",
            str(result),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=CAMPAIGN_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"the campaign itself failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = json.loads(result.read_text())
    failed = [row for row in summary["rows"] if row["failures"]]
    groups: dict[str, list[str]] = defaultdict(list)
    for row in failed:
        for failure in row["failures"]:
            groups[failure_kind(failure)].append(f"{row['state']}: {row['edit']}: {failure}")
    figures(
        f"mutation campaign: {summary['tried']} edits tried ({summary['edits']} distinct, on 2 roots): "
        f"{summary['fell back']} fell back, {summary['refused']} refused, {summary['harmless']} harmless, "
        f"{summary['failed']} failed; largest child {summary['max_rss_mib']} MiB resident; "
        f"{summary['seconds']} s ({summary['save_seconds']} s saving)"
    )
    details = "\n".join(
        f"  {len(lines)} x {kind}\n" + "\n".join(f"      {line[:300]}" for line in lines)
        for kind, lines in sorted(groups.items(), key=lambda item: -len(item[1]))
    )
    assert summary["edits"] >= MIN_EDITS
    assert summary["tried"] == 2 * summary["edits"]
    assert not failed, f"{len(failed)} of {summary['tried']} edits broke a promise:\n{details}"

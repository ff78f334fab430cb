"""A damaged or hostile newest step under `spotrun run` (issue 21): one start resumes the
previous step bit-exactly, the start's output says once why step 2 was not resumed, nothing
prints a traceback, the supervisor and the job stay within a 2 GiB address space, and
`spotrun ls` lists step 2 as corrupt afterwards. Edits the listing finds (a manifest nested
100,000 deep, a data file that is a link) and edits only a load finds (a repeated key in the
rank index, a header dtype changed with every digest recomputed) alike."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import pytest

from tests.support.step_edits import edit_header, redigest
from tests.unit.checkpoint.test_bounded_parsing import (
    index_repeated_key,
    limited,
    manifest_state_nested_deep,
    save_two_steps,
)

pytestmark = pytest.mark.slow  # a supervisor and a job per edit


def header_dtype_changed(root: pathlib.Path) -> None:
    def edit(header: dict) -> None:
        header["model/weight"]["dtype"] = "I32"

    edit_header(root, 2, 0, edit)
    redigest(root, 2)


def data_file_linked_outside(root: pathlib.Path) -> None:
    [data] = (root / "step-000000002").glob("rank-*[0-9].safetensors")
    copy = root.parent / "elsewhere" / data.name
    copy.parent.mkdir()
    shutil.copy2(data, copy)
    data.unlink()
    data.symlink_to(copy)


@pytest.mark.parametrize(
    "edit",
    [manifest_state_nested_deep, data_file_linked_outside, index_repeated_key, header_dtype_changed],
    ids=lambda edit: edit.__name__,
)
def test_spotrun_run_on_a_damaged_newest_step_resumes_the_previous_one_in_one_start(tmp_path, edit):
    root = tmp_path / "ck"
    at_1 = save_two_steps(root)
    edit(root)
    run = limited(
        [
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            str(root),
            "--notice",
            "none",
            "--",
            sys.executable,
            "tests/jobs/bounded_restore.py",
            str(root),
        ],
        timeout_s=240,
    )
    out, err = run.stdout.decode(), run.stderr.decode()
    assert run.returncode == 0 and "Traceback" not in out + err, (out + err)[-4000:]
    [restored] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert restored == {"step": 1, **at_1, "epoch": 1}
    said = [
        line
        for line in (out + err).splitlines()
        if "step 2" in line and ("corrupt" in line or "failed verification" in line)
    ]
    assert len(said) == 1, said

    listed = limited(["-m", "spotrun", "ls", str(root), "--json"], timeout_s=120)
    assert listed.returncode == 0, listed.stderr.decode()
    statuses = {row["step"]: row["status"] for row in json.loads(listed.stdout)}
    assert statuses == {1: "complete", 2: "corrupt"}, statuses

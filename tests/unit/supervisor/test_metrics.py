"""`spotrun run --metrics-port / --metrics-textfile`: a real supervisor around a real
Checkpointer job (tests/jobs/metrics_job.py: one process, no torchrun), scraped over HTTP
while it runs, and its textfile read after it exited."""

from __future__ import annotations

import json
import pathlib
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spotrun.checkpoint import catalog
from spotrun.control import files as control
from spotrun.storage import LocalStorage
from spotrun.supervisor.metrics import SupervisorMetrics
from tests.support.fake_launch import FAST, Spotrun
from tests.support.paths import JOBS

JOB = JOBS / "metrics_job.py"
#: The job's periodic saves: >= 1.25 s apart (steps of >= 50 ms), so that the 5 saves saves.json keeps
#: always hold every save since the supervisor's previous read (1 s before).
SAVE_INTERVAL = 25


@pytest.fixture
def spotrun_run(tmp_path):
    """Starts `spotrun run` processes (tests/support/fake_launch.py's Spotrun); kills what is
    left at the end."""
    started: list[Spotrun] = []

    def start(options, command, **kwargs) -> Spotrun:
        started.append(Spotrun(tmp_path, options, command, **kwargs))
        return started[-1]

    yield start
    for run in started:
        run.kill_everything()


def samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="value"}': value} (labels sorted; no braces without labels)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def complete_steps(ckpt: pathlib.Path) -> list[catalog.StepInfo]:
    return [s for s in catalog.list_steps(LocalStorage(str(ckpt))) if s.status == catalog.COMPLETE]


def start_job(spotrun_run, tmp_path, options: list[str], job_options: list[str] = ()) -> Spotrun:
    out = tmp_path / "out"
    out.mkdir()
    return spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ck"), "--notice", "none", *FAST, *options],
        [sys.executable, JOB, out, "--interval", str(SAVE_INTERVAL), *job_options],
    )


def test_metrics_while_running_and_the_textfile_after_a_notice(spotrun_run, tmp_path):
    """Scraped while running, the metrics show the newest step and the restart; after a notice
    the textfile names the exit, the source and the saves."""
    textfile = tmp_path / "spotrun.prom"
    run = start_job(
        spotrun_run,
        tmp_path,
        [
            "--metrics-port",
            "0",
            "--metrics-address",
            "127.0.0.1",
            "--metrics-textfile",
            str(textfile),
            "--max-restarts",
            "1",
            "--restart-backoff-s",
            "0",
        ],
        ["--crash-after-save"],
    )  # saves step 25, exits 3, is restarted from step 25
    run.wait_until(lambda: re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", run.log()), "the endpoint")
    url = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", run.log()).group(1)
    scraped: dict[str, float] = {}

    def scrape_shows_a_save_of_the_restart() -> bool:
        scraped.update(samples(urllib.request.urlopen(url, timeout=30).read().decode()))
        return scraped.get("spotrun_newest_complete_step", 0) >= 2 * SAVE_INTERVAL

    run.wait_until(scrape_shows_a_save_of_the_restart, "the endpoint to show a save of the restarted launch")
    on_disk = {s.step for s in complete_steps(tmp_path / "ck")}
    assert scraped["spotrun_newest_complete_step"] in on_disk
    assert scraped["spotrun_newest_complete_step_age_seconds"] >= 0
    assert scraped["spotrun_restarts_total"] == 1
    assert scraped["spotrun_launches_total"] == 2
    assert scraped["spotrun_incarnation"] == 1
    assert scraped["spotrun_resumed_step"] == SAVE_INTERVAL
    assert scraped["spotrun_last_command_exit_code"] == 3  # the crash
    assert scraped["spotrun_last_restore_read_bytes"] > 0
    assert "spotrun_exit_code" not in scraped  # still running

    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 143, run.log()
    found = samples(textfile.read_text())
    steps = complete_steps(tmp_path / "ck")
    emergency, periodic = steps[-1], [s for s in steps if s.reason == "periodic"]
    assert emergency.reason == "emergency"
    assert found["spotrun_exit_code"] == 143
    assert found['spotrun_exit_reason{reason="preempted_saved"}'] == 1
    assert found['spotrun_notices_total{source="signal"}'] == 1
    assert found['spotrun_emergency_save_decisions_total{decision="save"}'] == 1
    assert found["spotrun_newest_complete_step"] == emergency.step
    assert found['spotrun_saves_total{reason="emergency"}'] == 1
    assert found['spotrun_saves_total{reason="periodic"}'] == len(periodic)  # each counted once, none missed
    assert found["spotrun_save_duration_seconds_count"] == len(periodic) + 1
    assert found["spotrun_last_save_size_bytes"] == sum(f.size_bytes for f in emergency.manifest.files)
    assert found["spotrun_saved_bytes_total"] == sum(f.size_bytes for s in steps for f in s.manifest.files)
    assert found["spotrun_last_save_duration_seconds"] > 0


def test_each_save_is_counted_once_however_often_the_measurements_are_read(tmp_path):
    metrics = SupervisorMetrics(clock=lambda: 1000.0)
    metrics.event(
        "launch",
        {"attempt": 0, "incarnation": 0, "resumed_step": None, "control_dir": str(tmp_path), "time_unix_s": 900.0},
    )
    first = control.SaveRecord(
        step=10, reason="periodic", size_bytes=100, duration_s=2.0, committed_unix_s=990.0, stall_s=0.5, background=True
    )
    second = control.SaveRecord(
        step=20,
        reason="periodic",
        size_bytes=100,
        duration_s=3.0,
        committed_unix_s=995.0,
        stall_s=0.25,
        background=True,
    )
    scrape = lambda: samples(generate_latest(metrics.registry).decode())  # noqa: E731
    assert "spotrun_newest_complete_step" not in scrape()  # none known yet, not "step 0"
    control.write_save_stats(str(tmp_path), control.SaveStats(in_progress=None, recent=(first,), step_time_s=0.1))
    scrape()
    control.write_save_stats(
        str(tmp_path), control.SaveStats(in_progress=None, recent=(first, second), step_time_s=0.1)
    )
    found = scrape()
    assert found['spotrun_saves_total{reason="periodic"}'] == 2
    assert (found["spotrun_save_duration_seconds_count"], found["spotrun_save_duration_seconds_sum"]) == (2, 5.0)
    assert found["spotrun_save_stall_seconds_sum"] == 0.75
    assert found["spotrun_saved_bytes_total"] == 200
    assert (found["spotrun_newest_complete_step"], found["spotrun_newest_complete_step_age_seconds"]) == (20, 5.0)
    assert "spotrun_exit_code" not in found
    metrics.event("exit", {"code": 1, "reason": "failed", "step": None, "time_unix_s": 1000.0})
    found = scrape()
    assert (found["spotrun_exit_code"], found['spotrun_exit_reason{reason="failed"}']) == (1, 1)
    assert found['spotrun_saves_total{reason="periodic"}'] == 2


# --- the fast tier -------------------------------------------------------------------------------


def bytes_under(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_fast_tier_age_and_size_are_read_from_the_tier_directory(tmp_path):
    """The newest complete step (an incomplete newer one does not count), seconds since it was
    committed, the bytes the tier holds; after the tier is released: 0 bytes and no step."""
    import os

    from spotrun.storage.tier_dir import create_tier, release_tier
    from tests.jobs.fakeckpt import write_step

    tier = create_tier(str(tmp_path / "mem"), str(tmp_path / "ck"))
    write_step(tier.steps_root, 24, reason="memory", shard_bytes=1000)
    write_step(tier.steps_root, 26, reason="memory", shard_bytes=1000)
    write_step(tier.steps_root, 28, reason="memory", shard_bytes=1000, commit=False)  # being written
    for step in (24, 26):  # committed at 988 and 990 (the newest file's time: the manifest is written last)
        for f in (pathlib.Path(tier.steps_root) / f"step-{step:09d}").iterdir():
            os.utime(f, (964.0 + step, 964.0 + step))
    metrics = SupervisorMetrics(clock=lambda: 1000.0)
    scrape = lambda: samples(generate_latest(metrics.registry).decode())  # noqa: E731
    metrics.event("launch", {"attempt": 0, "incarnation": 0, "resumed_step": None, "time_unix_s": 900.0})
    assert not [name for name in scrape() if name.startswith("spotrun_fast_tier")]  # a run without a tier

    launch = {"attempt": 0, "incarnation": 0, "resumed_step": None, "fast_tier_dir": tier.steps_root}
    metrics.event("launch", {**launch, "time_unix_s": 900.0})
    found = scrape()
    assert found["spotrun_fast_tier_newest_complete_step"] == 26
    assert found["spotrun_fast_tier_age_seconds"] == 1000.0 - (964.0 + 26)
    assert found["spotrun_fast_tier_size_bytes"] == bytes_under(pathlib.Path(tier.steps_root))
    assert found["spotrun_fast_tier_size_bytes"] > 3 * 1000

    release_tier(tier)
    found = scrape()
    assert found["spotrun_fast_tier_size_bytes"] == 0
    assert "spotrun_fast_tier_newest_complete_step" not in found and "spotrun_fast_tier_age_seconds" not in found


def test_a_supervisor_with_a_fast_tier_exports_its_newest_step_and_size(spotrun_run, tmp_path):
    """A real `spotrun run --memory-interval-steps`: scraped while running, the fast tier's newest step is
    one its directory holds complete, and `spotrun ls` lists it; the textfile after exit says the tier was
    released (0 bytes). The root is given relative: the tier records it as the workers get it (absolute)."""
    from spotrun.storage.tier_dir import list_tiers

    textfile, memory_dir, out = tmp_path / "spotrun.prom", tmp_path / "mem", tmp_path / "out"
    out.mkdir()
    run = spotrun_run(
        ["--checkpoint-uri", "ck", "--notice", "none", *FAST]
        + ["--metrics-port", "0", "--metrics-address", "127.0.0.1", "--metrics-textfile", str(textfile)]
        + ["--memory-interval-steps", "4", "--memory-dir", str(memory_dir)],
        [sys.executable, JOB, out, "--interval", str(SAVE_INTERVAL)],
        cwd=tmp_path,
    )
    run.wait_until(lambda: re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", run.log()), "the endpoint")
    url = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", run.log()).group(1)
    scraped: dict[str, float] = {}

    def scrape_shows_a_fast_tier_step_past_the_first() -> bool:
        scraped.clear()
        scraped.update(samples(urllib.request.urlopen(url, timeout=30).read().decode()))
        return scraped.get("spotrun_fast_tier_newest_complete_step", 0) >= 8

    run.wait_until(scrape_shows_a_fast_tier_step_past_the_first, "the endpoint to show a fast-tier step")
    [tier] = list_tiers(str(memory_dir))
    held = {s.step for s in complete_steps(pathlib.Path(tier.steps_root))}
    assert scraped["spotrun_fast_tier_newest_complete_step"] % 4 == 0
    assert scraped["spotrun_fast_tier_newest_complete_step"] <= max(held)  # the tier only grows while running
    assert scraped["spotrun_fast_tier_age_seconds"] >= 0
    assert scraped["spotrun_fast_tier_size_bytes"] > 0
    assert tier.checkpoint_uri == str(tmp_path / "ck")
    listed = subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", str(tmp_path / "ck"), "--json", "--memory-dir", str(memory_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    in_memory = [r["step"] for r in json.loads(listed.stdout) if r["tier"] == "memory"]
    assert in_memory and max(in_memory) >= scraped["spotrun_fast_tier_newest_complete_step"]

    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 143, run.log()
    found = samples(textfile.read_text())
    assert found["spotrun_fast_tier_size_bytes"] == 0 and list_tiers(str(memory_dir)) == []
    assert "spotrun_fast_tier_newest_complete_step" not in found

"""`spotrun run --metrics-port / --metrics-textfile`: a real supervisor around a real
Checkpointer job (tests/workers/metrics_job.py: one process, no torchrun), scraped over HTTP
while it runs, and its textfile read after it exited."""

from __future__ import annotations

import pathlib
import re
import signal
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from spotrun.checkpoint import catalog
from spotrun.storage import LocalStorage
from tests.test_supervisor import FAST, Spotrun, spotrun_run  # noqa: F401  (fixture)

JOB = pathlib.Path(__file__).resolve().parent / "workers" / "metrics_job.py"
SAVE_INTERVAL = 10  # the job's periodic saves


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
    return spotrun_run(["--checkpoint-uri", str(tmp_path / "ck"), "--notice", "none", *FAST, *options],
                       [sys.executable, JOB, out, "--interval", str(SAVE_INTERVAL), *job_options])


def test_endpoint_shows_the_newest_complete_step_and_the_restart_while_it_runs(spotrun_run, tmp_path):
    run = start_job(spotrun_run, tmp_path, ["--metrics-port", "0", "--metrics-address", "127.0.0.1",
                                            "--max-restarts", "1", "--restart-backoff-s", "0"],
                    ["--crash-after-save"])  # saves step 10, exits 3, is restarted from step 10
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


def test_textfile_after_a_notice_names_the_exit_reason_the_notice_source_and_the_saves(spotrun_run, tmp_path):
    textfile = tmp_path / "spotrun.prom"
    run = start_job(spotrun_run, tmp_path, ["--metrics-textfile", str(textfile)])
    run.wait_until(lambda: f"committed step {SAVE_INTERVAL} (periodic)" in run.log(), "a periodic save")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 143, run.log()

    found = samples(textfile.read_text())
    emergency = complete_steps(tmp_path / "ck")[-1]
    assert emergency.reason == "emergency"
    assert found["spotrun_exit_code"] == 143
    assert found['spotrun_exit_reason{reason="preempted_saved"}'] == 1
    assert found['spotrun_notices_total{source="signal"}'] == 1
    assert found['spotrun_emergency_save_decisions_total{decision="save"}'] == 1
    assert found["spotrun_newest_complete_step"] == emergency.step
    assert found['spotrun_saves_total{reason="emergency"}'] == 1
    periodic = [s for s in complete_steps(tmp_path / "ck") if s.reason == "periodic"]
    assert found['spotrun_saves_total{reason="periodic"}'] == len(periodic)
    assert found["spotrun_save_duration_seconds_count"] == len(periodic) + 1
    assert found["spotrun_last_save_size_bytes"] == sum(f.size_bytes for f in emergency.manifest.files)
    assert found["spotrun_saved_bytes_total"] == sum(f.size_bytes for s in periodic + [emergency]
                                                     for f in s.manifest.files)
    assert found["spotrun_last_save_duration_seconds"] > 0

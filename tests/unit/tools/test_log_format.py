"""`--log-format json`: one JSON object per line on stderr, from spotrun and from workers that
configure their logging with spotrun.tools.logs (the format travels in $SPOTRUN_LOG_FORMAT)."""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from spotrun.errors import ConfigError
from spotrun.supervisor.config_file import load_run_config
from spotrun.tools.logs import JsonFormatter

UTC_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
#: A launch command that logs one line the way the example trainer does, then exits 0.
WORKER = (
    "import logging; from spotrun.tools.logs import configure_logging; "
    "configure_logging(logging.INFO, prefix='[rank 0]', fields={'rank': 0}); "
    "logging.getLogger('spotrun.worker').info('hello from the worker', extra={'step': 7})"
)


def json_lines(stderr: str) -> list[dict]:
    lines = stderr.splitlines()
    assert lines
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys(), record
        assert UTC_MS.match(record["time"]), record
    return records


def test_json_lines_carry_utc_time_level_logger_message_extra_fields_and_the_traceback():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter({"rank": 3}))
    logger = logging.getLogger("spotrun.test_log_format")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        before_s = time.time()
        logger.warning("saved step %d", 5, extra={"step": 5, "path": pathlib.Path("/ck")})
        try:
            raise ValueError("bad byte")
        except ValueError:
            logger.exception("restore failed")
    finally:
        logger.removeHandler(handler)
    first, second = json_lines(stream.getvalue())
    assert first["message"] == "saved step 5"
    assert (first["level"], first["logger"], first["rank"], first["step"], first["path"]) == (
        "WARNING",
        "spotrun.test_log_format",
        3,
        5,
        "/ck",
    )
    assert first["time"] >= time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(before_s)))
    assert second["level"] == "ERROR"
    assert "ValueError: bad byte" in second["exception"]


def test_every_stderr_line_of_spotrun_run_is_json_and_so_are_the_workers_lines(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--log-format",
            "json",
            "--notice",
            "none",
            "--checkpoint-uri",
            str(tmp_path / "ck"),
            "--",
            sys.executable,
            "-c",
            WORKER,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    records = json_lines(done.stderr)
    assert any(r["logger"].startswith("spotrun.supervisor") and r["level"] == "INFO" for r in records)
    [worker] = [r for r in records if r["logger"] == "spotrun.worker"]
    assert (worker["message"], worker["rank"], worker["step"]) == ("hello from the worker", 0, 7)


def test_a_spotrun_error_is_a_json_line_too_when_the_environment_asks_for_json(tmp_path):
    missing = tmp_path / "missing"
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPOTRUN_LOG_FORMAT": "json"},
    )
    assert done.returncode == 2
    [record] = json_lines(done.stderr)
    assert record["level"] == "ERROR" and str(missing) in record["message"]


def test_config_file_takes_the_log_format_and_the_metrics_options(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "log_format: json\nmetrics_port: 9464\nmetrics_address: 127.0.0.1\n"
        "metrics_textfile: /var/lib/node_exporter/spotrun.prom\n"
    )
    assert load_run_config(config) == {
        "log_format": "json",
        "metrics_port": 9464,
        "metrics_address": "127.0.0.1",
        "metrics_textfile": "/var/lib/node_exporter/spotrun.prom",
    }
    config.write_text("log_format: xml\n")
    with pytest.raises(ConfigError, match="log_format must be one of text, json"):
        load_run_config(config)

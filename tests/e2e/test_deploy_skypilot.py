"""deploy/skypilot/task.yaml: loaded by SkyPilot itself, and its run command as the nodes run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from spotrun.supervisor.config_file import load_run_config
from spotrun.supervisor.torchrun_command import read_torchrun_command
from tests.support.paths import REPO

ROOT = REPO
TASK = ROOT / "deploy" / "skypilot" / "task.yaml"

#: Run in a child process: ``import sky`` sets up logging and more, none of it for this process.
#: Loads the task and a copy with ``use_spot`` misspelt, which SkyPilot must refuse.
_LOAD_WITH_SKYPILOT = textwrap.dedent("""\
    import json, sys
    import importlib.metadata
    import sky

    task = sky.Task.from_yaml(sys.argv[1])
    (resources,) = task.resources
    try:
        sky.Task.from_yaml_str(open(sys.argv[1]).read().replace("use_spot:", "use_spto:"))
        refused = None
    except ValueError as exc:
        refused = str(exc)
    print(json.dumps({
        "version": importlib.metadata.version("skypilot"), "num_nodes": task.num_nodes,
        "use_spot": resources.use_spot, "job_recovery": resources.job_recovery,
        "accelerators": resources.accelerators, "envs": task.envs, "run": task.run,
        "misspelt_refused": refused,
    }))
    """)


def skypilot_python() -> str:
    """The Python that has SkyPilot: this one, or ``$SPOTRUN_SKYPILOT_PYTHON``. SkyPilot cannot
    live in the test environment (it requires click<8.2, transformers' huggingface_hub click>=8.4):
    ``python3 -m venv .venv-sky && .venv-sky/bin/pip install 'skypilot>=0.14'``."""
    given = os.environ.get("SPOTRUN_SKYPILOT_PYTHON")
    if given:
        return given
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('sky') is None)"],
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(
            "SkyPilot's parser did not run: skypilot is not installed here (it requires click<8.2, the "
            "test extra's transformers click>=8.4); set SPOTRUN_SKYPILOT_PYTHON to a venv's python "
            "that has skypilot>=0.14"
        )
    return sys.executable


def test_task_is_valid_for_skypilot(tmp_path, record_property):
    # HOME: SkyPilot writes its state under ~/.sky. No cloud credentials or network needed
    # (strace shows no connection); its usage reports are switched off all the same.
    env = {**os.environ, "HOME": str(tmp_path), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}
    result = subprocess.run(
        [skypilot_python(), "-c", _LOAD_WITH_SKYPILOT, str(TASK)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, f"skypilot: sky.Task.from_yaml refused deploy/skypilot/task.yaml:\n{result.stderr}"
    task = json.loads(result.stdout.splitlines()[-1])
    tool = f"skypilot {task['version']}"
    record_property("tool", f"{tool} (sky.Task.from_yaml)")
    assert task["misspelt_refused"] and "use_spto" in task["misspelt_refused"], f"{tool} accepted a misspelt key"
    # Spot VMs, recovered by SkyPilot: a preempted-and-saved exit (143) costs no restart.
    assert task["use_spot"] is True
    recovery = task["job_recovery"]
    assert recovery["strategy"] in ("FAILOVER", "EAGER_NEXT_REGION")
    assert recovery["max_restarts_on_errors"] > 0 and recovery["recover_on_exit_codes"] == [143]
    assert task["num_nodes"] >= 2
    print(f"deploy/skypilot/task.yaml: valid with {tool} (sky.Task.from_yaml)")


def test_task_config_writes_checkpoints_to_the_bucket_of_its_envs():
    task = yaml.safe_load(TASK.read_text(encoding="utf-8"))
    envs = task["envs"]
    config = load_run_config(ROOT / envs["SPOTRUN_CONFIG"], environ=envs)
    assert config["checkpoint_uri"] == f"s3://{envs['SPOTRUN_BUCKET']}/{envs['SPOTRUN_PREFIX']}/checkpoints"
    assert "file_mounts" not in task  # spotrun talks S3 itself: a mounted bucket has no conditional writes


def test_run_starts_spotrun_with_a_torchrun_spanning_the_nodes(tmp_path):
    """The run script as SkyPilot runs it on node 1 of 2 (bash, its variables set), with a
    stand-in spotrun that records the command line it gets."""
    task = yaml.safe_load(TASK.read_text(encoding="utf-8"))
    venv_bin = tmp_path / "spotrun-venv" / "bin"
    venv_bin.mkdir(parents=True)
    spotrun = venv_bin / "spotrun"
    spotrun.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    spotrun.chmod(0o755)
    env = {
        **os.environ,
        **task["envs"],
        "HOME": str(tmp_path),
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NODE_IPS": "head-node\nnode-1\n",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    }
    result = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    separator = argv.index("--")
    assert argv[:separator] == ["run", "--config", task["envs"]["SPOTRUN_CONFIG"]]
    command = argv[separator + 1 :]
    assert command[0] == str(venv_bin / "torchrun")
    launch = read_torchrun_command(command)  # spotrun's own reading of the command
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (2, 2, 8)
    assert not launch.standalone
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--node-rank"] == "1" and options["--master-addr"] == "head-node"

"""``spotrun run --config FILE``: the YAML loader, the example configs and the deploy files."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from spotrun.errors import ConfigError
from spotrun.supervisor.config import SupervisorConfig, option_specs
from spotrun.supervisor.config_file import load_run_config
from tests.support.paths import REPO

ROOT = REPO
EXAMPLE_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DEPLOY_YAML = sorted((ROOT / "deploy").rglob("*.yaml"))
#: What the example configs read from the environment, as a user would set it.
EXAMPLE_ENV = {"SPOTRUN_BUCKET": "my-bucket"}


def write(tmp_path: Path, text: str, name: str = "spotrun.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_valid_file_gives_typed_defaults(tmp_path):
    path = write(
        tmp_path,
        """\
        checkpoint_uri: s3://bucket/run-1
        grace_period_s: 110        # an integer is accepted for a number
        safety_margin_s: 12.5
        stop_timeout_s: 10
        max_restarts: 3
        restart_backoff_s: 0
        s3_endpoint_url: http://127.0.0.1:9000
        notice: aws
        notice_file: /run/spotrun/notice
        log_level: debug
        """,
    )
    cfg = load_run_config(path, environ={})
    assert cfg == {
        "checkpoint_uri": "s3://bucket/run-1",
        "grace_period_s": 110.0,
        "safety_margin_s": 12.5,
        "stop_timeout_s": 10.0,
        "max_restarts": 3,
        "restart_backoff_s": 0.0,
        "s3_endpoint_url": "http://127.0.0.1:9000",
        "notice": "aws",
        "notice_file": "/run/spotrun/notice",
        "log_level": "debug",
    }
    assert isinstance(cfg["grace_period_s"], float) and isinstance(cfg["max_restarts"], int)


def test_only_given_keys_are_returned_and_empty_file_is_empty(tmp_path):
    assert load_run_config(write(tmp_path, "grace_period_s: 20\n"), environ={}) == {"grace_period_s": 20.0}
    assert load_run_config(write(tmp_path, "# nothing set yet\n", "empty.yaml"), environ={}) == {}


def test_command_line_overrides_the_file(tmp_path):
    """The way the CLI applies the file: set_defaults, then parse."""
    cfg = load_run_config(write(tmp_path, "grace_period_s: 110\nmax_restarts: 2\n"), environ={})
    parser = argparse.ArgumentParser()
    parser.add_argument("--grace-period-s", type=float, default=30.0)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--stop-timeout-s", type=float, default=5.0)
    parser.set_defaults(**cfg)
    args = parser.parse_args(["--max-restarts", "7"])
    assert (args.grace_period_s, args.max_restarts, args.stop_timeout_s) == (110.0, 7, 5.0)


def test_unknown_key_names_it_and_lists_the_valid_ones(tmp_path):
    path = write(tmp_path, "grace-period-s: 30\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(path, environ={})
    message = str(err.value)
    assert str(path) in message and "'grace-period-s'" in message
    assert "did you mean 'grace_period_s'" in message
    assert all(spec.name in message for spec in option_specs())


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("grace_period_s: thirty", "grace_period_s must be a number"),
        ("grace_period_s: '30'", "grace_period_s must be a number"),
        ("grace_period_s: true", "grace_period_s must be a number"),
        ("grace_period_s: .inf", "grace_period_s must be a finite number"),
        ("max_restarts: 2.5", "max_restarts must be an integer"),
        ("checkpoint_uri: 42", "checkpoint_uri must be a string"),
        ("checkpoint_uri: [a, b]", "checkpoint_uri must be a string"),
        ("checkpoint_uri: ''", "checkpoint_uri must not be empty"),
        ("checkpoint_uri: null", "checkpoint_uri must be a string"),
        ("notice: gce", "notice must be auto, none or a comma-separated list of aws, gcp, azure, signal, file"),
        ("notice: auto,aws", "notice must be auto, none or a comma-separated list"),
        ("notice: [aws, 3]", "notice must be a string"),
        ("log_level: loud", "log_level must be one of debug, info, warning, error"),
    ],
)
def test_wrong_type_or_value_names_key_and_expected_type(tmp_path, line, expected):
    path = write(tmp_path, line + "\n")
    with pytest.raises(ConfigError, match=expected) as err:
        load_run_config(path, environ={})
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("notice: none", "none"),
        ("notice: azure,signal", "azure,signal"),
        ("notice: [aws, signal]", "aws,signal"),  # a YAML list is joined as on the command line
    ],
)
def test_notice_values(tmp_path, line, expected):
    assert load_run_config(write(tmp_path, line + "\n"), environ={}) == {"notice": expected}


def test_null_means_default_for_optional_strings(tmp_path):
    cfg = load_run_config(write(tmp_path, "s3_endpoint_url: null\nlog_level: ~\nnotice_file: ''\n"), environ={})
    assert cfg == {"s3_endpoint_url": None, "log_level": None, "notice_file": None}


def test_bad_yaml_reports_path_and_line(tmp_path):
    path = write(tmp_path, "checkpoint_uri: ./ckpt\ngrace_period_s: [30\nmax_restarts: 1\n")
    with pytest.raises(ConfigError, match=r"invalid YAML: line \d+, column \d+") as err:
        load_run_config(path, environ={})
    assert str(path) in str(err.value)


@pytest.mark.parametrize("text", ["- grace_period_s: 30\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="top level must be a mapping") as err:
        load_run_config(path, environ={})
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found") as err:
        load_run_config(path)
    assert str(path) in str(err.value)


def test_env_expansion(tmp_path):
    path = write(
        tmp_path,
        """\
        checkpoint_uri: s3://${BUCKET}/${PREFIX:-default-prefix}/ckpt-$$HOME
        s3_endpoint_url: ${ENDPOINT:-}
        grace_period_s: ${GRACE_S:-25}
        max_restarts: ${RESTARTS}
        notice: ${NOTICE:-auto}
        """,
    )
    cfg = load_run_config(path, environ={"BUCKET": "b1", "PREFIX": "", "RESTARTS": "4", "NOTICE": "aws"})
    assert cfg == {
        "checkpoint_uri": "s3://b1/default-prefix/ckpt-$HOME",  # empty PREFIX -> default, $$ -> $
        "s3_endpoint_url": None,  # empty -> standard AWS settings
        "grace_period_s": 25.0,
        "max_restarts": 4,
        "notice": "aws",
    }
    cfg = load_run_config(
        path,
        environ={"BUCKET": "b2", "PREFIX": "p", "ENDPOINT": "http://minio:9000", "GRACE_S": "12.5", "RESTARTS": "0"},
    )
    assert cfg["checkpoint_uri"] == "s3://b2/p/ckpt-$HOME"
    assert cfg["s3_endpoint_url"] == "http://minio:9000"
    assert (cfg["grace_period_s"], cfg["max_restarts"], cfg["notice"]) == (12.5, 0, "auto")


def test_env_expansion_uses_os_environ_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTRUN_TEST_BUCKET", "from-env")
    cfg = load_run_config(write(tmp_path, "checkpoint_uri: s3://${SPOTRUN_TEST_BUCKET}/x\n"))
    assert cfg["checkpoint_uri"] == "s3://from-env/x"


@pytest.mark.parametrize(
    ("line", "env", "expected"),
    [
        ("checkpoint_uri: s3://${BUCKET}/x", {}, "checkpoint_uri: environment variable BUCKET is not set"),
        ("checkpoint_uri: s3://${BUCKET/x", {}, "unterminated"),
        ("checkpoint_uri: s3://${1BUCKET}/x", {}, "bad variable reference"),
        ("grace_period_s: ${GRACE_S}", {"GRACE_S": "soon"}, "grace_period_s must be a number"),
        ("max_restarts: ${N}", {"N": "1.5"}, "max_restarts must be an integer"),
        ("notice: ${NOTICE}", {"NOTICE": "gce"}, "notice must be auto, none or a comma-separated list"),
    ],
)
def test_env_expansion_errors(tmp_path, line, env, expected):
    path = write(tmp_path, line + "\n")
    with pytest.raises(ConfigError, match=expected) as err:
        load_run_config(path, environ=env)
    assert str(path) in str(err.value)


def test_a_lone_dollar_is_kept(tmp_path):
    cfg = load_run_config(write(tmp_path, "checkpoint_uri: ./ckpt$1\n"), environ={})
    assert cfg["checkpoint_uri"] == "./ckpt$1"


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_example_configs_load_and_make_a_valid_supervisor_config(path):
    cfg = load_run_config(path, environ=EXAMPLE_ENV)
    assert cfg, f"{path.name} sets nothing"
    supervisor_fields = {f.name for f in dataclasses.fields(SupervisorConfig)}
    options = {k: v for k, v in cfg.items() if k in supervisor_fields}
    assert {"checkpoint_uri", "grace_period_s", "safety_margin_s", "stop_timeout_s"} <= options.keys()
    config = SupervisorConfig(command=("torchrun", "train.py"), **options)
    # Stopping a late command must fit inside the grace period (run.py warns otherwise).
    assert config.safety_margin_s >= config.stop_timeout_s


def test_example_and_deploy_files_exist():
    assert {"local.yaml", "aws-spot.yaml", "gke-spot.yaml", "azure-spot.yaml"} <= {p.name for p in EXAMPLE_CONFIGS}
    assert {"job.yaml", "pytorchjob.yaml", "jobset.yaml", "task.yaml"} <= {p.name for p in DEPLOY_YAML}
    for name in ("container/Dockerfile", "vm/spotrun-train.service", "vm/startup.sh", "README.md"):
        assert (ROOT / "deploy" / name).is_file(), name


def test_vm_startup_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "deploy" / "vm" / "startup.sh")], check=True, timeout=60)


@pytest.mark.parametrize("path", DEPLOY_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_deploy_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)
    if "kubernetes" in path.parts:
        assert all("apiVersion" in d and "kind" in d for d in docs)


def _k8s_docs(name: str) -> dict[str, dict]:
    path = ROOT / "deploy" / "kubernetes" / name
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d}


def test_kubernetes_job_fits_spotrun(tmp_path):
    docs = _k8s_docs("job.yaml")
    job, config_map = docs["Job"], docs["ConfigMap"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    # The spotrun config in the ConfigMap loads, and the pod gives spotrun its grace period.
    (config_text,) = config_map["data"].values()
    cfg = load_run_config(write(tmp_path, config_text), environ=EXAMPLE_ENV)
    assert cfg == load_run_config(ROOT / "configs" / "gke-spot.yaml", environ=EXAMPLE_ENV)
    assert pod["terminationGracePeriodSeconds"] >= cfg["grace_period_s"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    preempted = [
        r
        for r in rules
        if r.get("onExitCodes", {}).get("operator") == "In" and {142, 143} & set(r["onExitCodes"]["values"])
    ]
    assert {c for r in preempted for c in r["onExitCodes"]["values"]} >= {142, 143}
    assert any(
        c.get("type") == "DisruptionTarget" and r["action"] == "Ignore"
        for r in rules
        for c in r.get("onPodConditions", [])
    )


def _with_fast_tier_uncommented(text: str) -> str:
    """``text`` with its commented ``# memory_interval_steps: K`` line turned on (exactly one)."""
    lines = text.splitlines()
    found = [i for i, line in enumerate(lines) if line.strip().startswith("# memory_interval_steps:")]
    assert len(found) == 1, "expected one commented memory_interval_steps line"
    (index,) = found
    lines[index] = lines[index].replace("# memory_interval_steps:", "memory_interval_steps:", 1)
    return textwrap.dedent("\n".join(lines)) + "\n"


@pytest.mark.parametrize("source", [*EXAMPLE_CONFIGS, "job.yaml ConfigMap"], ids=lambda p: getattr(p, "name", p))
def test_the_commented_fast_tier_setting_turns_it_on_when_uncommented(source, tmp_path):
    """Every example config shows the fast tier commented out; uncommented, it is a valid setting."""
    if isinstance(source, Path):
        text = source.read_text(encoding="utf-8")
    else:
        (text,) = _k8s_docs("job.yaml")["ConfigMap"]["data"].values()
    assert "memory_interval_steps" not in load_run_config(write(tmp_path, text), environ=EXAMPLE_ENV)
    cfg = load_run_config(write(tmp_path, _with_fast_tier_uncommented(text), "on.yaml"), environ=EXAMPLE_ENV)
    supervisor_fields = {f.name for f in dataclasses.fields(SupervisorConfig)}
    config = SupervisorConfig(
        command=("torchrun", "train.py"), **{k: v for k, v in cfg.items() if k in supervisor_fields}
    )
    assert config.memory_interval_steps > 0
    assert config.max_restarts > 0 or source.name == "local.yaml"  # the tier serves crash restarts


def _gibibytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    number, unit = quantity[:-2], quantity[-2:]
    return float(number) * units[unit] / 2**30 if unit in units else float(quantity) / 2**30


def test_the_one_node_job_gives_dev_shm_host_memory_for_the_fast_tier():
    """A container's /dev/shm is 64 MiB: job.yaml mounts a memory-backed emptyDir with a size limit there."""
    pod = _k8s_docs("job.yaml")["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert _gibibytes(volume["emptyDir"]["sizeLimit"]) >= 8

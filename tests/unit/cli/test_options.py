"""``spotrun run``'s options are defined once, as fields of ``SupervisorConfig``: the flags, the
YAML keys and the defaults are derived from them, and each is documented."""

from __future__ import annotations

import dataclasses

import pytest

from spotrun.cli import _build_parser
from spotrun.errors import ConfigError
from spotrun.supervisor.config import SupervisorConfig, option_specs
from spotrun.supervisor.config_file import load_run_config

#: Every option with a value a file may give it, written out so that a dropped or renamed option fails.
EXPECTED = {
    "checkpoint_uri": ("s3://bucket/job", "s3://bucket/job"),
    "s3_endpoint_url": ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
    "grace_period_s": ("110", 110.0),
    "safety_margin_s": ("12.5", 12.5),
    "stop_timeout_s": ("10", 10.0),
    "max_restarts": ("3", 3),
    "restart_backoff_s": ("0", 0.0),
    "rerun_finished": ("true", True),
    "notice": ("[aws, signal]", "aws,signal"),
    "notice_signals": ("TERM,USR1", "TERM,USR1"),
    "notify_signal": ("USR1", "USR1"),
    "announce_timeout_s": ("30", 30.0),
    "notice_file": ("/run/spotrun/notice", "/run/spotrun/notice"),
    "aws_metadata_endpoint": ("http://127.0.0.1:1338", "http://127.0.0.1:1338"),
    "gcp_metadata_host": ("127.0.0.1:8080", "127.0.0.1:8080"),
    "azure_metadata_endpoint": ("http://127.0.0.1:1339", "http://127.0.0.1:1339"),
    "azure_vm_name": ("vm-1", "vm-1"),
    "metrics_port": ("9464", 9464),
    "metrics_address": ("127.0.0.1", "127.0.0.1"),
    "metrics_textfile": ("/var/lib/node_exporter/spotrun.prom", "/var/lib/node_exporter/spotrun.prom"),
    "keep_last": ("5", 5),
    "keep_every": ("100", 100),
    "memory_interval_steps": ("10", 10),
    "memory_dir": ("/dev/shm/job", "/dev/shm/job"),
    "memory_budget_bytes": ("8000000000", 8000000000),
    "memory_replicas": ("2", 2),
    "memory_replica_address": ("10.0.0.5", "10.0.0.5"),
    "memory_replica_rate_bytes_s": ("100000000", 100000000),
    "memory_replica_secret_file": ("/run/secrets/spotrun-tier", "/run/secrets/spotrun-tier"),
    "memory_failure_domain": ("us-east-1a", "us-east-1a"),
    "memory_peer_timeout_s": ("5", 5.0),
    "key_layout": ("spread", "spread"),
    "log_level": ("debug", "debug"),
    "log_format": ("json", "json"),
}
#: The shared options, on every subcommand's parser rather than only on run's.
EVERY_COMMAND = {"log_level", "log_format"}


def _subparser(name: str):
    parser = _build_parser()
    [sub] = [a for a in parser._actions if a.dest == "subcommand"]
    return sub.choices[name]


def _long_flags(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_every_field_is_documented():
    for f in dataclasses.fields(SupervisorConfig):
        doc = f.metadata["option"]["help"] if "option" in f.metadata else f.metadata.get("doc")
        assert doc and doc.strip() and "\n" not in doc, f"{f.name} has no one-line doc"


def test_the_options_are_exactly_the_expected_ones():
    assert [spec.name for spec in option_specs()] == list(EXPECTED)
    assert {spec.name for spec in option_specs() if spec.every_command} == EVERY_COMMAND


def test_run_flags_are_derived_from_the_fields():
    flags = {"--" + name.replace("_", "-") for name in EXPECTED}
    assert _long_flags(_subparser("run")) == flags | {"--help", "--config"}
    for command in ("ls", "gc", "verify", "export", "report", "preflight"):
        assert {"--log-level", "--log-format", "--s3-endpoint-url"} <= _long_flags(_subparser(command)), command


def test_every_yaml_key_loads_with_the_options_type(tmp_path):
    path = tmp_path / "all.yaml"
    path.write_text("".join(f"{key}: {text}\n" for key, (text, _) in EXPECTED.items()), encoding="utf-8")
    loaded = load_run_config(path, environ={})
    assert loaded == {key: value for key, (_, value) in EXPECTED.items()}
    assert all(type(loaded[key]) is type(value) for key, (_, value) in EXPECTED.items())


def test_unknown_key_suggests_the_closest_option(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("keep_lst: 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="unknown key 'keep_lst' \\(did you mean 'keep_last'\\?\\)"):
        load_run_config(path, environ={})


def test_no_option_given_means_the_fields_defaults():
    args = _build_parser().parse_args(["run", "--", "true"])
    assert SupervisorConfig.from_args(args, ["true"], log_format=None) == SupervisorConfig(command=("true",))
    for spec in option_specs():
        assert getattr(args, spec.name) == spec.default, spec.name


def test_command_line_wins_over_the_file_which_wins_over_the_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("grace_period_s: 110\nmax_restarts: 2\n", encoding="utf-8")
    parser = _build_parser(run_defaults=load_run_config(path, environ={}))
    args = parser.parse_args(["run", "--max-restarts", "7", "--", "true"])
    config = SupervisorConfig.from_args(args, ["true"], log_format=None)
    assert (config.grace_period_s, config.max_restarts, config.stop_timeout_s) == (110.0, 7, 5.0)


def test_notice_options_come_from_the_flat_fields():
    config = SupervisorConfig(
        command=("true",),
        aws_metadata_endpoint="http://127.0.0.1:1338",
        gcp_metadata_host="127.0.0.1:8080",
        azure_vm_name="vm-1",
        notice_file="/n",
    )
    options = config.notice_options
    assert (
        options.aws_endpoint,
        options.gcp_host,
        options.azure_endpoint,
        options.azure_vm_name,
        options.notice_file,
    ) == ("http://127.0.0.1:1338", "127.0.0.1:8080", None, "vm-1", "/n")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"notify_signal": "KILL"}, "--notify-signal: SIGKILL cannot tell a job to save"),
        ({"notify_signal": "STOP"}, "--notify-signal: SIGSTOP cannot tell a job to save"),
        ({"notify_signal": "CHLD"}, "--notify-signal: SIGCHLD cannot tell a job to save"),
        ({"notify_signal": "SEGV"}, "--notify-signal: SIGSEGV reports a fault"),
        ({"notify_signal": "FOO"}, "--notify-signal: 'FOO' is not a signal name"),
        ({"announce_timeout_s": float("inf")}, "announce timeout must be a finite number >= 0 s"),
        ({"announce_timeout_s": -1.0}, "announce timeout must be a finite number >= 0 s"),
    ],
)
def test_a_notify_signal_no_script_could_save_on_is_refused(changes, expected):
    """A signal that cannot be caught (KILL, STOP) or that does nothing by default (CHLD)
    would kill or miss every worker: refused before anything starts, as on the command line."""
    with pytest.raises(ConfigError, match=expected):
        SupervisorConfig(command=["torchrun", "train.py"], **changes)


def test_a_notify_signal_a_script_can_catch_is_accepted():
    for name in ("TERM", "SIGUSR1", "usr2", "HUP", "INT", "RTMIN+2"):
        assert SupervisorConfig(command=["python", "train.py"], notify_signal=name).notify_signal_number > 0

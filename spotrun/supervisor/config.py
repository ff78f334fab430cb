"""The options of ``spotrun run``, each defined once: a field of :class:`SupervisorConfig`.

A field made with :func:`option` is an option: its name is the YAML key of ``--config`` files
(:mod:`spotrun.supervisor.config_file`) and, with ``-`` for ``_``, the command-line flag
(``grace_period_s`` -> ``--grace-period-s``); its type (``float``, ``int``, ``str``, or one of
them ``| None``; or ``bool``: a flag) is the flag's and the key's; its default is both; its ``help`` is the
``--help`` text (``%(default)s`` names the default). Adding an option is one field here, plus
its use.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field

from spotrun.checkpoint.retention import RetentionPolicy
from spotrun.control import env as spotrun_env
from spotrun.control.env import DEFAULT_CHECKPOINT_URI, default_safety_margin_s
from spotrun.errors import ConfigError
from spotrun.notices import SOURCE_NAMES, NoticeOptions, parse_notice_option
from spotrun.notices.signals import DEFAULT_NOTICE_SIGNALS, parse_notice_signals, parse_notify_signal
from spotrun.storage import StorageLocation, parse_location
from spotrun.storage.location import check_endpoint_url
from spotrun.storage.options import KEY_LAYOUTS
from spotrun.storage.tier_dir import DEFAULT_MEMORY_DIR
from spotrun.supervisor.option_spec import OptionSpec, option
from spotrun.tools.logs import LOG_FORMATS, LOG_LEVELS

#: Upper bound of the wait before a crash restart, in seconds.
MAX_RESTART_BACKOFF_S = 300.0


def _check_notice_in_file(value: str) -> None:
    try:
        parse_notice_option(value)
    except ConfigError:
        raise ConfigError(
            f"notice must be auto, none or a comma-separated list of {', '.join(SOURCE_NAMES)}; got {value!r}"
        ) from None


def _check_signals_in_file(value: str) -> None:
    parse_notice_signals(value)


def _check_signal_in_file(value: str) -> None:
    parse_notify_signal(value)


@dataclass(frozen=True)
class SupervisorConfig:
    """The launch command and the options of ``spotrun run`` (see the module docstring).

    Raises:
        ConfigError: an empty command or an out-of-range value.
    """

    command: tuple[str, ...] = field(metadata={"doc": "the launch command and its arguments (torchrun ...)"})
    checkpoint_uri: str = option(
        DEFAULT_CHECKPOINT_URI,
        "checkpoint root: local dir, file://, s3://, gs:// or az://bucket/prefix (default %(default)s)",
        metavar="URI",
    )
    s3_endpoint_url: str | None = option(
        None,
        "S3 endpoint for s3:// URIs, e.g. http://minio:9000 (default: the standard AWS settings such as "
        "AWS_ENDPOINT_URL); run passes it on to the workers",
        metavar="URL",
    )
    grace_period_s: float = option(
        30.0,
        "seconds from a notice to the hard kill (default %(default)s, as Kubernetes); the emergency "
        "checkpoint must commit by notice + grace period - safety margin",
        metavar="S",
    )
    # None: computed from the grace period (spotrun.control.env.default_safety_margin_s); a file gives a number.
    safety_margin_s: float | None = option(
        None,
        "seconds kept free before the end of the grace period (default 5, or half the grace period when that is less)",
        metavar="S",
        null_in_file=False,
    )
    stop_timeout_s: float = option(
        5.0,
        "seconds between SIGTERM and SIGKILL when stopping the command (default %(default)s); after a "
        "notice SIGKILL comes halfway through the safety margin at the latest",
        metavar="S",
    )
    max_restarts: int = option(0, "restarts after a crash without a notice (default %(default)s)", metavar="N")
    restart_backoff_s: float = option(
        10.0, "wait before the first restart, doubled each time, at most 300 s (default %(default)s)", metavar="S"
    )
    rerun_finished: bool = option(
        False,
        "start the command even if this command line already finished on this root and its newest "
        "complete checkpoint is unchanged since (by default spotrun then exits 0 without starting it)",
    )
    notice: str = option(
        "auto",
        "preemption notice sources besides the notice signals (always on): auto (default: probe only a "
        "cloud that the DMI facts under /sys/class/dmi/id name or whose endpoint is set; nothing off a cloud), "
        "none, or a comma-separated list of aws, gcp, azure, file, signal (signals are on anyway)",
        metavar="auto|none|LIST",
        list_in_file=True,
        check_in_file=_check_notice_in_file,
    )
    notice_signals: str = option(
        DEFAULT_NOTICE_SIGNALS,
        "signals to spotrun that are preemption notices, comma-separated, or none "
        "(default %(default)s: SLURM's --signal=USR1@N and submitit's USR2 included); every other signal that "
        "would end spotrun (ALRM, PIPE, QUIT, RTMIN+N, ...) is logged and ignored",
        metavar="LIST",
        list_in_file=True,
        check_in_file=_check_signals_in_file,
    )
    notify_signal: str | None = option(
        None,
        "for a job that saves with its own framework: deliver every notice at once as this signal "
        "(TERM, USR1, ...) to the worker processes (the ranks of torch's elastic agent, never the launcher); "
        "default: SIGTERM, "
        "and only to workers that never announced spotrun's protocol (a Checkpointer or "
        "spotrun.preemption_notice())",
        metavar="SIGNAL",
        check_in_file=_check_signal_in_file,
    )
    announce_timeout_s: float = option(
        10.0,
        "seconds a worker may run without announcing spotrun's protocol before a notice reaches it as "
        "a signal (default %(default)s; a notice before that waits for the announcement or this age)",
        metavar="S",
    )
    notice_file: str | None = option(
        None, "drill: a notice when this file appears (its JSON may set deadline_unix_s)", metavar="PATH"
    )
    aws_metadata_endpoint: str | None = option(
        None,
        "AWS IMDS base URL (default $AWS_EC2_METADATA_SERVICE_ENDPOINT, else http://169.254.169.254)",
        metavar="URL",
    )
    gcp_metadata_host: str | None = option(
        None, "GCP metadata server (default $GCE_METADATA_HOST, else metadata.google.internal)", metavar="HOST[:PORT]"
    )
    azure_metadata_endpoint: str | None = option(
        None, "Azure IMDS base URL (default http://169.254.169.254)", metavar="URL"
    )
    azure_vm_name: str | None = option(
        None, "this VM's name in Azure Scheduled Events (default: asked from IMDS)", metavar="NAME"
    )
    metrics_port: int | None = option(
        None,
        "serve Prometheus metrics on http://ADDRESS:PORT/metrics while spotrun runs (0: a free port, named in the log)",
        metavar="PORT",
    )
    metrics_address: str | None = option(
        None,
        "address of the metrics endpoint (default 0.0.0.0: every interface, as a Prometheus scraping "
        "pods needs; 127.0.0.1 keeps it to this machine)",
        metavar="ADDRESS",
    )
    metrics_textfile: str | None = option(
        None,
        "write the metrics to this .prom file for node_exporter's textfile collector (atomically, at "
        "every event, every 15 s and at exit: it keeps the exit code)",
        metavar="PATH",
    )
    keep_last: int | None = option(
        None,
        "retention: the workers keep the N newest complete steps and delete older ones after each "
        "commit (default: keep every step; passed as SPOTRUN_KEEP_LAST)",
        metavar="N",
    )
    keep_every: int | None = option(
        None,
        "retention: also keep every step divisible by M (with --keep-last; passed as SPOTRUN_KEEP_EVERY)",
        metavar="M",
    )
    memory_interval_steps: int = option(
        0,
        "the fast tier: the workers also save to this node's memory every K steps, and a restart after a "
        "crash resumes from there when it is newer than storage (default %(default)s: off; passed as "
        "SPOTRUN_MEMORY_INTERVAL_STEPS)",
        metavar="K",
    )
    memory_dir: str = option(
        DEFAULT_MEMORY_DIR,
        "where the fast tier lives: a directory in host memory (tmpfs); each run makes its own tier in it, "
        "removes it at exit, and removes those that killed runs left (default %(default)s)",
        metavar="DIR",
    )
    memory_budget_bytes: int | None = option(
        None,
        "most bytes the fast tier of this node may hold (two steps of its ranks); a tier that does not fit "
        "is said at the first save and the job runs with storage only (default: the free space of --memory-dir)",
        metavar="N",
    )
    memory_replicas: int | None = option(
        None,
        "fast tier on several nodes: how many other nodes also hold each node's fast-tier step, copied "
        "between the supervisors in the background (default: 1, or 0 on one node; passed as SPOTRUN_MEMORY_REPLICAS)",
        metavar="R",
    )
    memory_replica_address: str | None = option(
        None,
        "where this node's supervisor serves its fast tier to the job's other nodes (default: the address "
        "this node reaches torchrun's rendezvous from; 127.0.0.1 for a rendezvous on loopback)",
        metavar="HOST",
    )
    memory_replica_rate_bytes_s: int = option(
        256 * 1024 * 1024,
        "most bytes per second this node sends to replicate its fast tier, so that copies leave the "
        "training's network alone (default %(default)s)",
        metavar="N",
    )
    memory_replica_secret_file: str | None = option(
        None,
        "a file holding the job's secret that the nodes' fast-tier servers prove to each other "
        "(default: one generated per node and shared through the job's own process group)",
        metavar="PATH",
    )
    memory_failure_domain: str | None = option(
        None,
        "fast tier on several nodes: this node's failure domain (a zone, a rack, a host of several "
        "simulated nodes); each node's replicas go to nodes of other domains first (passed to the workers)",
        metavar="LABEL",
    )
    memory_peer_timeout_s: float = option(
        10.0,
        "most seconds one request to another node's fast tier may take before that node is skipped "
        "(default %(default)s)",
        metavar="S",
    )
    key_layout: str | None = option(
        None,
        "where a checkpoint's ranks put their files on an object store: auto (a key prefix per rank from 256 "
        "ranks on), spread or step (the step's prefix); default $SPOTRUN_KEY_LAYOUT, else auto (to the workers)",
        choices=KEY_LAYOUTS,
    )
    log_level: str | None = option(
        None,
        "log verbosity on stderr (default: info for run and drill, warning for the other commands)",
        choices=LOG_LEVELS,
        every_command=True,
    )
    log_format: str | None = option(
        None,
        "log lines on stderr: text, or json (one object per line: time, level, logger, message, ...); "
        "default $SPOTRUN_LOG_FORMAT, else text. run passes it to the launch command as $SPOTRUN_LOG_FORMAT",
        choices=LOG_FORMATS,
        every_command=True,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command or not self.command[0]:
            raise ConfigError("no launch command given: use spotrun run -- COMMAND...")
        if not self.grace_period_s > 0 or self.grace_period_s == float("inf"):
            raise ConfigError(f"grace period must be > 0 s, got {self.grace_period_s}")
        if self.safety_margin_s is None:
            object.__setattr__(self, "safety_margin_s", default_safety_margin_s(self.grace_period_s))
        if not 0 <= self.safety_margin_s < self.grace_period_s:
            raise ConfigError(
                f"safety margin must be >= 0 and < the grace period ({self.grace_period_s} s), "
                f"got {self.safety_margin_s}"
            )
        if not self.stop_timeout_s > 0:
            raise ConfigError(f"stop timeout must be > 0 s, got {self.stop_timeout_s}")
        if self.max_restarts < 0:
            raise ConfigError(f"max restarts must be >= 0, got {self.max_restarts}")
        if not self.restart_backoff_s >= 0:
            raise ConfigError(f"restart backoff must be >= 0 s, got {self.restart_backoff_s}")
        check_endpoint_url(self.s3_endpoint_url)  # the URI itself is checked by the preflight, as it opens it
        parse_notice_option(self.notice)
        parse_notice_signals(self.notice_signals)
        if self.notify_signal is not None:
            parse_notify_signal(self.notify_signal)
        if not 0 <= self.announce_timeout_s < math.inf:
            raise ConfigError(f"announce timeout must be a finite number >= 0 s, got {self.announce_timeout_s}")
        RetentionPolicy(keep_last=self.keep_last, keep_every=self.keep_every)
        if self.memory_interval_steps < 0:
            raise ConfigError(f"memory interval must be >= 0 steps, got {self.memory_interval_steps}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 0:
            raise ConfigError(f"memory budget must be >= 0 bytes, got {self.memory_budget_bytes}")
        if self.memory_interval_steps and not self.memory_dir:
            raise ConfigError("--memory-interval-steps needs a --memory-dir")
        if self.memory_replicas is not None and self.memory_replicas < 0:
            raise ConfigError(f"memory replicas must be >= 0, got {self.memory_replicas}")
        if self.memory_replica_rate_bytes_s <= 0:
            raise ConfigError(f"memory replica rate must be > 0 bytes/s, got {self.memory_replica_rate_bytes_s}")
        if not 0 < self.memory_peer_timeout_s < math.inf:
            raise ConfigError(f"memory peer timeout must be a finite number > 0 s, got {self.memory_peer_timeout_s}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, command: Iterable[str], *, log_format: str | None) -> SupervisorConfig:
        """The config of parsed ``spotrun run`` arguments (``args.<name>``), with the log format in
        effect (the flag, the file or ``$SPOTRUN_LOG_FORMAT``); raises ConfigError as the constructor."""
        values = {spec.name: getattr(args, spec.name) for spec in option_specs()}
        return cls(command=tuple(command), **{**values, "log_format": log_format})

    @property
    def location(self) -> StorageLocation:
        """Where the checkpoints are (:attr:`checkpoint_uri`, :attr:`s3_endpoint_url`); raises
        ConfigError for an empty URI or an unsupported scheme."""
        return parse_location(self.checkpoint_uri, endpoint_url=self.s3_endpoint_url)

    @property
    def notice_options(self) -> NoticeOptions:
        """The notice sources' endpoints, Azure VM name, drill file and notice signals."""
        return NoticeOptions(
            aws_endpoint=self.aws_metadata_endpoint,
            gcp_host=self.gcp_metadata_host,
            azure_endpoint=self.azure_metadata_endpoint,
            azure_vm_name=self.azure_vm_name,
            notice_file=self.notice_file,
            notice_signals=self.notice_signal_numbers,
        )

    def fast_tier_env(self, steps_root: str) -> dict[str, str]:
        """The fast tier's variables for the launch command, its root being ``steps_root``."""
        env = {
            spotrun_env.MEMORY_DIR: steps_root,
            spotrun_env.MEMORY_INTERVAL_STEPS: str(self.memory_interval_steps),
        }
        if self.memory_budget_bytes is not None:
            env[spotrun_env.MEMORY_BUDGET_BYTES] = str(self.memory_budget_bytes)
        return env

    def option_env(self) -> dict[str, str]:
        """The retention and key layout variables for the launch command (only those given)."""
        given = {
            spotrun_env.KEEP_LAST: self.keep_last,
            spotrun_env.KEEP_EVERY: self.keep_every,
            spotrun_env.KEY_LAYOUT: self.key_layout,
        }
        return {name: str(value) for name, value in given.items() if value is not None}

    @property
    def notify_signal_number(self) -> int:
        """The signal for workers that do not speak spotrun's protocol (SIGTERM by default)."""
        return parse_notify_signal(self.notify_signal) if self.notify_signal is not None else signal.SIGTERM

    @property
    def notice_signal_numbers(self) -> frozenset[int]:
        """The signal numbers of :attr:`notice_signals`."""
        return parse_notice_signals(self.notice_signals)


def option_specs() -> tuple[OptionSpec, ...]:
    """Every option of :class:`SupervisorConfig`, in field order."""
    hints = typing.get_type_hints(SupervisorConfig)
    specs = []
    for f in dataclasses.fields(SupervisorConfig):
        meta = f.metadata.get("option")
        if meta is None:
            continue
        kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        null_in_file = meta["null_in_file"]
        if null_in_file is None:
            null_in_file = type(None) in typing.get_args(hints[f.name])
        specs.append(
            OptionSpec(name=f.name, kind=kinds[0], default=f.default, **{**meta, "null_in_file": null_in_file})
        )
    return tuple(specs)


def add_options(parser: argparse.ArgumentParser, *, every_command: bool) -> None:
    """Add the options of ``spotrun run`` (``every_command=False``) or those every subcommand
    shares (``True``: the log options) to ``parser``, in field order."""
    for spec in option_specs():
        if spec.every_command == every_command:
            spec.add_to(parser)


def add_option(parser: argparse.ArgumentParser, name: str) -> None:
    """Add one option (``"s3_endpoint_url"``) to another subcommand's ``parser``."""
    [spec] = [s for s in option_specs() if s.name == name]
    spec.add_to(parser)

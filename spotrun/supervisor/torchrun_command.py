"""What a launch command says about the ranks it starts: torchrun's node count (a number or an
elastic range ``MIN:MAX``), processes per node and rendezvous.

Only for the start log, a warning about a range torchrun will not treat as elastic, and the
scaling of an emergency-save estimate. torchrun's own parser reads the options, but a command
line of torchrun's full option names is read without importing torch (seconds in the
supervisor). Details: ``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from spotrun.errors import ConfigError

log = logging.getLogger("spotrun.supervisor.run")  # the supervisor's own log lines

#: Seconds the c10d rendezvous waits, once ``MIN`` nodes joined, for more to join
#: (torch's default ``last_call_timeout``).
DEFAULT_LAST_CALL_TIMEOUT_S = 30.0
#: Python interpreter options that take a value (``python -X dev -m torch.distributed.run``).
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-X", "-W", "--check-hash-based-pycs"})
_TORCHRUN_MODULES = frozenset({"torch.distributed.run"})


@dataclass(frozen=True)
class TorchrunLaunch:
    """The rank count a torchrun command asks for.

    Attributes:
        min_nodes: ``MIN`` of ``--nnodes MIN:MAX`` (= ``max_nodes`` for a fixed count).
        max_nodes: ``MAX``.
        nproc_per_node: processes per node, or ``None`` when torchrun chooses it on each node
            (``auto``, ``cpu``, ``gpu``, ``xpu``).
        nproc_text: ``--nproc-per-node`` as given (``"8"``, ``"auto"``).
        rdzv_backend: ``static``, ``c10d``, ``etcd``, ... (``c10d`` with ``--standalone``).
        standalone: ``--standalone`` (a rendezvous on this node only).
        last_call_timeout_s: seconds a dynamic rendezvous waits for more nodes once ``MIN``
            joined (``--rdzv-conf last_call_timeout=N``, else 30).
        rendezvous_host: the host of ``--rdzv-endpoint`` (else ``--master-addr``), ``None``
            without one (the fast tier's server listens where this node reaches it).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int | None
    nproc_text: str
    rdzv_backend: str
    standalone: bool
    last_call_timeout_s: float
    rendezvous_host: str | None = None

    @property
    def elastic(self) -> bool:
        """Whether the node count is a range (``MIN < MAX``)."""
        return self.min_nodes < self.max_nodes

    @property
    def min_ranks(self) -> int | None:
        """The fewest ranks this command can start (``None`` when torchrun picks the per-node count)."""
        return None if self.nproc_per_node is None else self.min_nodes * self.nproc_per_node

    @property
    def max_ranks(self) -> int | None:
        """The most ranks this command can start (``None`` when torchrun picks the per-node count)."""
        return None if self.nproc_per_node is None else self.max_nodes * self.nproc_per_node

    def describe(self) -> str:
        """How many ranks, for the start log: ``"2 nodes x 4 processes = 8 ranks"``,
        ``"1 to 2 nodes x 1 process = 1 to 2 ranks (torchrun --nnodes 1:2: ...)"``."""
        nodes = _count(self.min_nodes, self.max_nodes, "node")
        if self.nproc_per_node is None:
            text = f"{nodes} x {self.nproc_text} processes per node (chosen by torchrun on each node)"
        else:
            text = (
                f"{nodes} x {_plural(self.nproc_per_node, 'process', 'processes')} = "
                f"{_count(self.min_ranks, self.max_ranks, 'rank')}"
            )
        if not self.elastic:
            return text
        if self.rdzv_backend == "static" and not self.standalone:
            return text + (
                f" (torchrun --nnodes {self.min_nodes}:{self.max_nodes} with the static rendezvous: "
                f"it waits for all {self.max_nodes} nodes)"
            )
        return text + (
            f" (torchrun --nnodes {self.min_nodes}:{self.max_nodes}: the count is known after the "
            f"rendezvous, which waits up to {self.last_call_timeout_s:g} s for more nodes once "
            f"{self.min_nodes} joined; the workers log it)"
        )

    def warnings(self) -> list[str]:
        """Ways this command is not elastic although it gives a range (one log line each)."""
        if not self.elastic:
            return []
        if self.standalone:
            return [
                f"torchrun --standalone --nnodes {self.min_nodes}:{self.max_nodes}: a standalone rendezvous "
                "runs on this node only, so no other node can join; give --rdzv-backend c10d "
                "--rdzv-endpoint HOST:PORT --rdzv-id ID instead for an elastic job"
            ]
        if self.rdzv_backend == "static":
            return [
                f"torchrun --nnodes {self.min_nodes}:{self.max_nodes} with the static rendezvous (torchrun's "
                f"default without --rdzv-backend) is not elastic: it waits for all {self.max_nodes} nodes; "
                "give --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID for an elastic job"
            ]
        return []


def read_torchrun_command(command: Sequence[str]) -> TorchrunLaunch | None:
    """The rank count ``command`` asks for, or ``None`` when it is not a torchrun command or
    its options cannot be read here (logged: the supervisor's torch may be another version
    than the one the command runs, so it is not refused for that).

    ``PET_NNODES`` and torchrun's other environment defaults are read from ``os.environ``,
    which the launch command inherits.

    Raises:
        ConfigError: a torchrun command whose ``--nnodes`` torchrun would refuse (not ``N``
            or ``MIN:MAX`` with ``0 < MIN <= MAX``) or whose ``--nproc-per-node`` is below 1:
            refused before anything is launched.
    """
    args = _torchrun_args(command)
    if args is None:
        return None
    options = _parse_common(args)
    if options is None:
        try:
            options = _parse(args)
        except _ParseError as exc:
            log.warning(
                "cannot read the torchrun options of the launch command (%s): the number of ranks "
                "is known to the workers only",
                str(exc).strip(),
            )
            return None
    nnodes = str(options.nnodes)
    try:
        min_nodes, max_nodes = _min_max_nodes(nnodes)
    except ValueError as exc:
        raise ConfigError(f"torchrun --nnodes {nnodes}: not a number of nodes or a range MIN:MAX ({exc})") from exc
    if not 0 < min_nodes <= max_nodes:
        raise ConfigError(f"torchrun --nnodes {nnodes}: the range needs 0 < MIN <= MAX")
    nproc_text = str(options.nproc_per_node)
    try:
        nproc = int(nproc_text)
    except ValueError:
        nproc = None
    if nproc is not None and nproc < 1:
        raise ConfigError(f"torchrun --nproc-per-node {nproc_text}: needs at least 1 process per node")
    backend = "c10d" if options.standalone else str(options.rdzv_backend)
    return TorchrunLaunch(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        nproc_text=nproc_text,
        rdzv_backend=backend,
        standalone=bool(options.standalone),
        last_call_timeout_s=_last_call_timeout_s(str(options.rdzv_conf)),
        rendezvous_host=_rendezvous_host(options),
    )


def _rendezvous_host(options: argparse.Namespace) -> str | None:
    """``HOST`` of ``--rdzv-endpoint HOST[:PORT]`` (``[v6]:PORT`` too), else ``--master-addr``."""
    endpoint = getattr(options, "rdzv_endpoint", None) or ""
    if endpoint:
        if endpoint.startswith("["):
            return endpoint[1:].partition("]")[0] or None
        return endpoint.rpartition(":")[0] if endpoint.count(":") == 1 else endpoint
    return getattr(options, "master_addr", None) or None


def is_torchrun(argv: Sequence[str]) -> bool:
    """Whether a running process's ``argv`` (``/proc/<pid>/cmdline``) is torchrun: the forms
    :func:`read_torchrun_command` recognises, and the console script as the kernel runs it
    (``python /venv/bin/torchrun ...``)."""
    if _torchrun_args(argv) is not None:
        return True
    return len(argv) >= 2 and os.path.basename(argv[0]).startswith("python") and os.path.basename(argv[1]) == "torchrun"


def _torchrun_args(command: Sequence[str]) -> list[str] | None:
    """The words after ``torchrun`` / ``python -m torch.distributed.run``; ``None`` for another command."""
    if not command:
        return None
    program = os.path.basename(command[0])
    if program == "torchrun":
        return list(command[1:])
    if not program.startswith("python"):
        return None
    i = 1
    while i < len(command):
        word = command[i]
        if word == "-m":
            module = command[i + 1] if i + 1 < len(command) else ""
            return list(command[i + 2 :]) if module in _TORCHRUN_MODULES else None
        if word.startswith("-m") and len(word) > 2:  # python -mtorch.distributed.run
            return list(command[i + 1 :]) if word[2:] in _TORCHRUN_MODULES else None
        if not word.startswith("-") or word in ("-c", "-"):
            return None  # a script, -c code or stdin: not torchrun
        i += 2 if word in _PYTHON_OPTIONS_WITH_VALUE else 1
    return None


class _ParseError(Exception):
    pass


#: torchrun's options (torch 2.13's ``get_args_parser``) and whether each takes a value; the
#: destination is the long name with dashes as underscores.
_OPTION_TAKES_VALUE: dict[str, bool] = {
    **{
        f"--{name}": True
        for name in (
            "nnodes",
            "nproc-per-node",
            "rdzv-backend",
            "rdzv-endpoint",
            "rdzv-id",
            "rdzv-conf",
            "max-restarts",
            "monitor-interval",
            "start-method",
            "event-log-handler",
            "role",
            "log-dir",
            "redirects",
            "tee",
            "local-ranks-filter",
            "duplicate-stdout-filters",
            "duplicate-stderr-filters",
            "node-rank",
            "master-addr",
            "master-port",
            "local-addr",
            "logs-specs",
            "numa-binding",
            "signals-to-handle",
            "shutdown-timeout",
        )
    },
    **{f"--{name}": False for name in ("standalone", "module", "no-python", "run-path", "virtual-local-rank")},
}
_SHORT_OPTIONS = {"-m": "--module", "-r": "--redirects", "-t": "--tee"}
_DEFAULTS = {"nnodes": "1:1", "nproc_per_node": "1", "rdzv_backend": "static", "rdzv_conf": "", "standalone": False}


def _parse_common(args: list[str]) -> argparse.Namespace | None:
    """The fields :func:`read_torchrun_command` uses, read without importing torch; ``None``
    for anything this reading does not cover (then torchrun's own parser decides)."""
    if any(name.startswith("PET_") for name in os.environ):
        return None
    values: dict[str, object] = dict(_DEFAULTS)
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("-") or word == "-":
            return argparse.Namespace(**values)  # the training script: torchrun's options end here
        name, eq, value = word.partition("=")
        if not name.startswith("--"):
            if eq or name not in _SHORT_OPTIONS:
                return None
            name = _SHORT_OPTIONS[name]
        spelled = "--" + name[2:].replace("_", "-")
        takes_value = _OPTION_TAKES_VALUE.get(spelled)
        if takes_value is None or (eq and not takes_value):
            return None
        if takes_value and not eq:
            if i + 1 >= len(args):
                return None
            i += 1
            value = args[i]
        dest = spelled[2:].replace("-", "_")
        values[dest] = value if takes_value else True
        i += 1
    return None  # no training script: torchrun's parser says what is wrong


def _min_max_nodes(nnodes: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2), ``"1:4"`` -> (1, 4), as torchrun reads ``--nnodes``.

    Raises:
        ValueError: not an integer or two integers separated by one colon.
    """
    parts = nnodes.split(":")
    if len(parts) == 1:
        return int(parts[0]), int(parts[0])
    if len(parts) == 2:
        return int(parts[0]), int(parts[1])
    raise ValueError(f"nnodes={nnodes!r} is not N or MIN:MAX")


def _parse(args: list[str]) -> argparse.Namespace:
    """torchrun's own parser over ``args``.

    Raises:
        _ParseError: torchrun's parser refuses the options.
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise _ParseError(message)

    parser.error = refuse  # never print usage or exit from inside the supervisor
    parser.exit = lambda status=0, message=None: refuse(message or f"exit {status}")
    return parser.parse_args(args)


def _last_call_timeout_s(rdzv_conf: str) -> float:
    for item in rdzv_conf.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "last_call_timeout":
            try:
                return float(value)
            except ValueError:
                return DEFAULT_LAST_CALL_TIMEOUT_S
    return DEFAULT_LAST_CALL_TIMEOUT_S


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _count(low: int, high: int, noun: str) -> str:
    """``"2 nodes"`` or ``"1 to 2 nodes"``."""
    return _plural(low, noun) if low == high else f"{low} to {high} {noun}s"

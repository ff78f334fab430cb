"""How a notice reaches the workers of one launch: spotrun's request file, or a signal.

A job whose ranks run a :class:`~spotrun.Checkpointer` (or poll
:func:`spotrun.preemption_notice`) announces itself in the control directory and reads the
request file; it never gets a signal, which would kill it before it saves. A job that saves
with its own framework never announces itself: it gets ``--notify-signal`` (default SIGTERM),
sent to its worker processes themselves, never their launcher. How long a starting job may take
to announce itself, and how workers are found: ``docs/design/internals.md``
(Supervisor and control channel).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spotrun.control.listeners import read_listeners
from spotrun.notices.signals import signal_name
from spotrun.supervisor import process
from spotrun.supervisor.torchrun_command import is_torchrun

log = logging.getLogger(__name__)


class Delivery(enum.Enum):
    """How the workers of a launch hear of a notice."""

    REQUEST_FILE = "request file"  # a Checkpointer announced itself: spotrun's protocol
    POLL = "polled"  # the job polls spotrun.preemption_notice(); it saves by itself
    SIGNAL = "signal"  # no announcement: the workers get the notify signal
    UNDECIDED = "undecided"  # no announcement yet, workers still young (or none started)


@dataclass(frozen=True)
class DeliveryChoice:
    """The answer of :func:`choose_delivery`; ``recheck_in_s`` only when undecided."""

    delivery: Delivery
    recheck_in_s: float | None = None

    @property
    def foreign(self) -> bool:
        """The job saves with its own framework: spotrun cannot verify its checkpoint."""
        return self.delivery in (Delivery.POLL, Delivery.SIGNAL)


#: Of the time left before the deadline when a notice comes, the most spent waiting for the
#: workers of a launch to announce themselves.
ANNOUNCE_WAIT_SHARE = 0.25


def choose_delivery(
    kinds: Sequence[str],
    *,
    signal_forced: bool,
    oldest_worker_age_s: float | None,
    announce_timeout_s: float,
    decide_in_s: float | None = None,
) -> DeliveryChoice:
    """Pure decision: how to deliver a notice now.

    Args:
        kinds: the ``kind`` of every announcement in the control directory
            (``"checkpointer"``, ``"poll"``).
        signal_forced: the user set ``--notify-signal``: signal unless a Checkpointer announced.
        oldest_worker_age_s: seconds the oldest worker process has run; None: none running.
        announce_timeout_s: how long a worker may run before it counts as foreign.
        decide_in_s: seconds the notice may still wait for an announcement (None: no limit);
            below 0.05 s a silent job counts as foreign whatever its workers' age.
    """
    if "checkpointer" in kinds:
        return DeliveryChoice(Delivery.REQUEST_FILE)
    if signal_forced:
        return DeliveryChoice(Delivery.SIGNAL)
    if "poll" in kinds:
        return DeliveryChoice(Delivery.POLL)
    if oldest_worker_age_s is not None and oldest_worker_age_s >= announce_timeout_s:
        return DeliveryChoice(Delivery.SIGNAL)
    if decide_in_s is not None and decide_in_s < _MIN_RECHECK_S:  # (a timer may wake a little early)
        return DeliveryChoice(Delivery.SIGNAL)
    age_s = oldest_worker_age_s if oldest_worker_age_s is not None else 0.0
    recheck_in_s = announce_timeout_s - age_s if decide_in_s is None else min(announce_timeout_s - age_s, decide_in_s)
    return DeliveryChoice(Delivery.UNDECIDED, recheck_in_s=max(_MIN_RECHECK_S, recheck_in_s))


#: The shortest wait before an undecided delivery is looked at again.
_MIN_RECHECK_S = 0.05


def describe_delivery(notify_signal: int | None, announce_timeout_s: float) -> str:
    """The start-up log line saying how notices will reach the workers (``notify_signal``:
    the ``--notify-signal`` number, or None when not given)."""
    if notify_signal is not None:
        return (
            f"--notify-signal {signal_name(notify_signal)}: every notice goes at once as that signal to the "
            "worker processes, unless they run a spotrun Checkpointer"
        )
    return (
        f"workers that have not announced spotrun's protocol after {announce_timeout_s:.1f} s get a notice as SIGTERM"
    )


#: What torch's elastic agent (``LocalElasticAgent``, run by torchrun, ``python -m
#: torch.distributed.run``, ``accelerate launch --multi_gpu`` and other launchers) puts in the
#: environment of each worker it starts, and not in its own.
ELASTIC_WORKER_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
#: Which agent started a worker. A rank's own children (DataLoader workers, any subprocess)
#: inherit these values unchanged; the workers of another agent (one that a rank started, or
#: the job's own when spotrun itself runs inside an elastic worker) differ in them.
ELASTIC_AGENT_VARIABLES = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")


def elastic_agent_of(env: Mapping[str, str] | None) -> tuple[str | None, ...] | None:
    """The agent that started a process with environment ``env``, as the values of
    :data:`ELASTIC_AGENT_VARIABLES`; None for a process no elastic agent started (or whose
    environment could not be read)."""
    if env is None or not all(name in env for name in ELASTIC_WORKER_VARIABLES):
        return None
    return tuple(env.get(name) for name in ELASTIC_AGENT_VARIABLES)


def elastic_workers(tree: Sequence[process.ProcInfo]) -> list[process.ProcInfo]:
    """The processes of ``tree`` that an elastic agent started: each carries an agent's worker
    environment that its parent does not carry. Their descendants carry the same one and are
    left out (a DataLoader worker that got the notify signal would die). A process whose
    environment cannot be read (gone, another user's) counts as no worker."""
    agents: dict[int, tuple[str | None, ...] | None] = {}

    def agent(pid: int) -> tuple[str | None, ...] | None:
        if pid not in agents:
            # The supervisor starts the command with its os.environ, which /proc does not show.
            agents[pid] = elastic_agent_of(os.environ if pid == os.getpid() else process.environ(pid))
        return agents[pid]

    return [info for info in tree if agent(info.pid) is not None and agent(info.pid) != agent(info.ppid)]


def worker_processes(child_pid: int) -> list[process.ProcInfo]:
    """The processes that run the training code, read from ``/proc`` now.

    In order: the workers of every elastic agent in the command's process tree
    (:func:`elastic_workers`); else the children of every torchrun found by its command line
    (none while it starts them: the agent must not be signalled, it takes a stop signal as
    fatal); else the command itself (a job of one process, or a launcher spotrun cannot tell
    from one before it has started its workers).
    """
    command = process.proc_info(child_pid)
    if command is None:
        return []
    tree = [command, *process.descendants(child_pid)]
    workers = elastic_workers(tree)
    if workers:
        return workers
    launchers = {info.pid for info in tree if is_torchrun(process.cmdline(info.pid))}
    if not launchers:
        return [command]
    return [info for info in tree if info.ppid in launchers]


def oldest_age_s(infos: Sequence[process.ProcInfo]) -> float | None:
    """Seconds the oldest of ``infos`` has been running; None for none."""
    if not infos:
        return None
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime", encoding="ascii") as f:
        uptime_s = float(f.read().split()[0])
    return max(0.0, uptime_s - min(info.start_ticks for info in infos) / ticks_per_s)


class NoticeDelivery:
    """The delivery state of one launch: decides once, signals the workers at most once.

    Args:
        control_dir: the launch's control directory (announcements are read there).
        child_pid: the launch command's pid.
        notify_signal: the signal for foreign jobs; ``forced``: the user chose it
            (``--notify-signal``): signal every job but one whose Checkpointer announced itself.
        announce_timeout_s: see :func:`choose_delivery`.
    """

    def __init__(
        self, control_dir: str, child_pid: int, *, notify_signal: int, forced: bool, announce_timeout_s: float
    ) -> None:
        self._control_dir = control_dir
        self._child_pid = child_pid
        self.notify_signal = notify_signal
        self._forced = forced
        self._announce_timeout_s = announce_timeout_s
        self._decide_by_unix_s: float | None = None  # set by the first notice
        self.choice: DeliveryChoice | None = None  # the final choice once made
        self.signalled: list[process.ProcInfo] = []

    def current(self) -> DeliveryChoice:
        """What to do now (reads the announcements and ``/proc``); final once decided."""
        if self.choice is not None:
            return self.choice
        workers = worker_processes(self._child_pid)
        kinds = [listener.kind for listener in read_listeners(self._control_dir)]
        choice = choose_delivery(
            kinds,
            signal_forced=self._forced,
            oldest_worker_age_s=oldest_age_s(workers),
            announce_timeout_s=self._announce_timeout_s,
            decide_in_s=None if self._decide_by_unix_s is None else self._decide_by_unix_s - time.time(),
        )
        if choice.delivery is not Delivery.UNDECIDED:
            self.choice = choice
        return choice

    def signal_workers(self) -> list[process.ProcInfo]:
        """Send the notify signal to the worker processes now (once); those signalled (none
        while torchrun has not started them yet)."""
        if self.signalled:
            return self.signalled
        workers = worker_processes(self._child_pid)
        for info in workers:
            process.send(info, self.notify_signal)
        self.signalled = workers
        return workers

    def deliver(self, deadline_unix_s: float | None) -> float | None:
        """Act on a stop notice now (the request file is already written): signal the workers
        when they are foreign, once.

        Args:
            deadline_unix_s: the save deadline of the notice (seconds since the epoch); the
                first call fixes how long the notice may wait for an announcement from it.

        Returns:
            When to call again (seconds since the epoch) while the workers are still young
            and silent, or foreign but not started yet; None once delivered.
        """
        if self.signalled:
            return None
        now_unix_s = time.time()
        if self._decide_by_unix_s is None and deadline_unix_s is not None:
            self._decide_by_unix_s = now_unix_s + ANNOUNCE_WAIT_SHARE * max(0.0, deadline_unix_s - now_unix_s)
        choice = self.current()
        if choice.delivery is Delivery.UNDECIDED:
            log.info(
                "no worker has announced spotrun's protocol yet: deciding how to deliver the notice "
                "in %.1f s at the latest",
                choice.recheck_in_s,
            )
            return now_unix_s + choice.recheck_in_s
        if choice.delivery is Delivery.SIGNAL:
            workers = self.signal_workers()
            if not workers:
                log.debug("no worker process to signal yet: looking again in %.1f s", _NO_WORKERS_RECHECK_S)
                return now_unix_s + _NO_WORKERS_RECHECK_S
            to_whom = (
                f"the command itself ({self._child_pid}): no elastic agent's worker in its process tree"
                if [info.pid for info in workers] == [self._child_pid]
                else f"{len(workers)} worker process(es) ({' '.join(str(info.pid) for info in workers)})"
            )
            log.warning(
                "sent %s to %s; they save with their own framework, the deadline is in "
                "$SPOTRUN_CONTROL_DIR/save-request.json",
                signal_name(self.notify_signal),
                to_whom,
            )
        elif choice.delivery is Delivery.POLL:
            log.info("the workers poll spotrun.preemption_notice(): no signal sent")
        else:
            log.info(
                "the workers run a spotrun Checkpointer: no signal sent, they read the save request%s",
                f" (--notify-signal {signal_name(self.notify_signal)} is not used for them)" if self._forced else "",
            )
        return None


#: How often a notice that must go out as a signal looks for the worker processes while
#: torchrun has not started them.
_NO_WORKERS_RECHECK_S = 0.2

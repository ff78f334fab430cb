"""The node supervisor behind ``spotrun run -- LAUNCH_COMMAND...``, one per node.

It checks the storage, starts the command from the newest complete checkpoint (storage's or its
fast tier's), turns a notice into a save request with a deadline (never a signal to torchrun, which
treats those as fatal), stops the process tree at the deadline, and exits with a code that says what
happened (0, 143, 142, 2, 86 or the command's own); a child subreaper, the only waiter for children.
The sequence and the exit codes: ``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time

from spotrun.checkpoint.manifest import Manifest
from spotrun.control import files as control
from spotrun.errors import ConfigError, SpotrunError
from spotrun.notices import Inbox, Notice, NoticeWatch, is_stop, parse_notice_option, start_sources
from spotrun.notices.signals import CHILD_EVENT, IgnoredSignal
from spotrun.notices.signals import describe as describe_signals
from spotrun.storage import Storage
from spotrun.storage.tier_dir import TierOwner
from spotrun.supervisor import exit_codes, finished, outcome, preflight, process
from spotrun.supervisor.config import MAX_RESTART_BACKOFF_S, SupervisorConfig
from spotrun.supervisor.exit_codes import EXIT_FENCED, EXIT_FINISHED, EXIT_PREEMPTED_NOT_SAVED
from spotrun.supervisor.foreign import NoticeDelivery, describe_delivery
from spotrun.supervisor.hang_watch import HangWatch
from spotrun.supervisor.launch import LaunchPlan, describe_start, plan_launch
from spotrun.supervisor.observers import Observers
from spotrun.supervisor.tier import TierService, fast_tier_launch, lost, open_fast_tier
from spotrun.supervisor.tier_emergency import STORAGE, decide_emergency, settle_memory_step
from spotrun.supervisor.torchrun_command import TorchrunLaunch, read_torchrun_command

log = logging.getLogger(__name__)

#: How long to wait for a SIGKILLed command to be reaped before giving up on it, in seconds.
_REAP_AFTER_KILL_S = 30.0


def supervise(config: SupervisorConfig, observers: Observers | None = None) -> int:
    """Run the launch command under supervision until it finishes or is preempted.

    Must be called from the main thread of a process that has no other children to wait
    for (it reaps every child), and that thread must live as long as the process (the
    launch command gets SIGTERM when the thread that started it ends). Installs handlers
    for every signal that would end the process (notices and ignored signals, see
    :mod:`spotrun.notices.signals`) and SIGCHLD while it runs and restores the old
    ones afterwards.

    Args:
        config: the options.
        observers: told of every event of :mod:`spotrun.supervisor.observers` (the event log,
            the metrics) and closed at the end; ``None``: none.

    Returns:
        The exit code (see the module docstring).

    Raises:
        ConfigError: the URI is unsupported or the command cannot be started.
        StorageError: the storage failed its preflight check (nothing was launched; the
            message names the cause), or the checkpoints could not be listed.
    """
    launch = read_torchrun_command(config.command)  # a --nnodes torchrun refuses: before anything else
    for warning in launch.warnings() if launch is not None else ():
        log.warning("%s", warning)
    location = config.location
    preflight.check_storage(location)
    with contextlib.ExitStack() as stack:
        inbox = stack.enter_context(Inbox())
        notice_options = config.notice_options
        watch = stack.enter_context(NoticeWatch(inbox))
        log.info(
            "notice signals: %s (other signals that would end spotrun are logged and ignored); "
            "grace period %.1f s, safety margin %.1f s",
            describe_signals(notice_options.notice_signals),
            config.grace_period_s,
            config.safety_margin_s,
        )
        log.info(
            "%s",
            describe_delivery(
                config.notify_signal_number if config.notify_signal is not None else None, config.announce_timeout_s
            ),
        )
        start_sources(parse_notice_option(config.notice), notice_options, watch)
        storage = location.open()
        control_root = tempfile.mkdtemp(prefix="spotrun-control-")
        stack.callback(shutil.rmtree, control_root, ignore_errors=True)
        if not process.become_subreaper():
            log.debug("could not become a child subreaper; orphaned workers go to init")
        observers = observers or Observers()
        stack.callback(observers.close)
        start = {"host": socket.gethostname(), "pid": os.getpid(), "command": list(config.command)}
        observers.emit("start", **start, grace_period_s=config.grace_period_s, checkpoint_uri=config.checkpoint_uri)
        done = None if config.rerun_finished else finished.finished_step(storage, config.command)
        if done is not None:
            observers.emit("exit", code=EXIT_FINISHED, reason="finished", step=None)
            log.info("%s", finished.finished_line(storage.uri, done, config.s3_endpoint_url))
            return EXIT_FINISHED
        tier, service = open_fast_tier(config, launch, stack)
        return _Supervisor(config, storage, inbox, control_root, launch, observers, tier, service).run()


class _Supervisor:
    """State of one ``supervise`` call; see the module docstring for the behaviour."""

    def __init__(
        self,
        config: SupervisorConfig,
        storage: Storage,
        inbox: Inbox,
        control_root: str,
        launch: TorchrunLaunch | None,
        observers: Observers,
        tier: TierOwner | None = None,
        tier_service: TierService | None = None,
    ):
        self.config = config
        self.tier, self.tier_service = tier, tier_service  # this run's fast tier (None: off), its server
        self.observers = observers
        self.launch = launch  # the rank count the torchrun command asks for; None: not torchrun
        self.storage = storage
        self.inbox = inbox
        self.control_root = control_root
        self.notice: Notice | None = None
        self.deadline_unix_s: float | None = None
        self.end_unix_s: float | None = None  # end of the grace period: every process gone by then
        self.ignored_signals: set[int] = set()  # logged once each
        self.child: subprocess.Popen | None = None
        self.child_returncode: int | None = None
        self.control_dir: str | None = None  # of the command now running, if any
        self.acknowledgements: list[tuple[Notice, object]] = []  # called once the save committed
        self.resumed_manifest: Manifest | None = None  # of the checkpoint the running command resumed
        self.save_declined = False  # a save could not commit in time: the workers stop without one
        self.saved_step: int | None = None  # the emergency checkpoint's step, once it is complete
        self.delivery: NoticeDelivery | None = None  # how the running command's workers hear of a notice
        self.delivery_recheck_unix_s: float | None = None  # undecided: look at the workers again then

    # --- the launch / restart loop ---------------------------------------------

    def run(self) -> int:
        try:
            code = self._launch_loop()
        except BaseException as exc:
            if self.child is not None and self.child_returncode is None:
                log.error("supervisor failed while pid %d runs: killing its process tree", self.child.pid)
                process.kill_tree(os.getpid(), self.child.pid)
            self.observers.emit(
                "exit",
                code=2 if isinstance(exc, SpotrunError) else None,
                reason="error",
                error=f"{type(exc).__name__}: {exc}",
            )
            raise
        reason = exit_codes.exit_reason(code)
        newest = finished.record_finished(self.storage, self.config.command) if code == EXIT_FINISHED else None
        self.observers.emit("exit", code=code, reason=reason, step=self.saved_step)
        if code == EXIT_FINISHED:
            log.info("%s", finished.finished_line(self.storage.uri, newest, self.config.s3_endpoint_url))
        return code

    def _launch_loop(self) -> int:
        plan: LaunchPlan | None = None
        attempt = 0
        while True:
            self._handle_events(self.inbox.wait(0))
            if self.notice is not None:
                log.warning("notice while no command ran: nothing to save%s", lost(self.tier, self.storage))
                return EXIT_PREEMPTED_NOT_SAVED
            control_dir = tempfile.mkdtemp(prefix=f"launch-{attempt}-", dir=self.control_root)
            plan = plan_launch(
                self.storage,
                self.config.location,
                control_dir=control_dir,
                grace_period_s=self.config.grace_period_s,
                previous=plan,
                supervisor_pid=os.getpid(),
                log_format=self.config.log_format,
                option_env=self.config.option_env(),
                **fast_tier_launch(self.config, self.tier, self.tier_service),
            )
            self.resumed_manifest = plan.resume.manifest if plan.resume is not None else None
            start_line = describe_start(plan.resume, self.launch)
            several_nodes = self.launch is not None and self.launch.max_nodes > 1
            if several_nodes and self.tier_service is not None and not self.tier_service.target_nodes():
                # a node new to the job does not know the other nodes yet: their memory may hold a
                # newer step, which the workers find and agree on after the rendezvous
                start_line += "; the workers may resume from a newer step held in the other nodes' memory"
            log.info("%s", start_line)
            self.observers.emit(
                "launch",
                attempt=attempt,
                incarnation=plan.incarnation,
                run_id=plan.run_id,
                resumed_step=plan.resume.step if plan.resume is not None else None,
                resumed_tier=plan.resume_tier,
                fast_tier_dir=self.tier.steps_root if self.tier is not None else None,
                resumed_world_size=self.resumed_manifest.world_size if self.resumed_manifest else None,
                resumed_created_unix_s=self.resumed_manifest.created_unix_s if self.resumed_manifest else None,
                control_dir=control_dir,
            )
            hangs = HangWatch(control_dir)  # a rank that stops answering: named, and a stuck command stopped
            code = self._run_once(plan, control_dir, hangs)
            self.observers.emit("command_exit", code=code, incarnation=plan.incarnation)
            hangs.look(running=False)
            fenced = outcome.fenced(control_dir)  # before a notice's outcome: a 142 would be retried
            if fenced is not None:
                log.error("%s: exiting %d", fenced, EXIT_FENCED)
                return EXIT_FENCED
            stopped_without_save = outcome.workers_stopped_without_save(control_dir)
            if self.notice is not None or stopped_without_save or outcome.workers_saved_on_their_own(control_dir):
                return self._preempted_exit_code(code, control_dir, stopped_without_save=stopped_without_save)
            if code == 0:  # the final line (run()) says where the checkpoint is
                return EXIT_FINISHED
            if attempt >= self.config.max_restarts:
                log.error("the command failed with exit code %d; no restarts left", code)
                return code
            delay_s = min(self.config.restart_backoff_s * 2**attempt, MAX_RESTART_BACKOFF_S)
            attempt += 1
            log.warning(
                "the command failed with exit code %d: restart %d of %d in %.1f s",
                code,
                attempt,
                self.config.max_restarts,
                delay_s,
            )
            self.observers.emit("restart", attempt=attempt, code=code, delay_s=delay_s)
            self._wait(delay_s, until_notice=True)

    def _run_once(self, plan: LaunchPlan, control_dir: str, hangs: HangWatch) -> int:
        """Start the command, wait for it (stopping it at the deadline); its exit code."""
        command = list(self.config.command)
        try:  # in the main thread: PR_SET_PDEATHSIG fires when the forking thread ends
            self.child = subprocess.Popen(
                command, env=plan.env, start_new_session=True, preexec_fn=process.die_with_parent()
            )
        except OSError as exc:
            raise ConfigError(f"cannot start {shlex.join(command)}: {exc.strerror or exc}") from exc
        self.child_returncode = None
        self.control_dir = control_dir
        self.delivery = NoticeDelivery(
            control_dir,
            self.child.pid,
            notify_signal=self.config.notify_signal_number,
            forced=self.config.notify_signal is not None,
            announce_timeout_s=self.config.announce_timeout_s,
        )
        self.delivery_recheck_unix_s = None
        log.info(
            "started pid %d (run id %s, incarnation %d): %s",
            self.child.pid,
            plan.run_id,
            plan.incarnation,
            shlex.join(command),
        )
        while self.child_returncode is None:
            wakes = (self.deadline_unix_s, self.delivery_recheck_unix_s, hangs.next_look_unix_s)
            self._wait(min(t for t in wakes if t is not None) - time.time())
            if self.delivery_recheck_unix_s is not None and time.time() >= self.delivery_recheck_unix_s:
                self._deliver_notice()
            deadline_passed = self.deadline_unix_s is not None and time.time() >= self.deadline_unix_s
            if self.child_returncode is None and (hangs.stuck() or deadline_passed):
                if not hangs.stopping:  # else the watch said why
                    log.warning("deadline passed before the command exited: stopping it")
                self._stop_child()
        self.control_dir = None
        code = process.exit_code(self.child_returncode)
        failed = code != 0 and self.notice is None
        process.stop_leftovers(
            os.getpid(), command_failed=failed, stop_timeout_s=self._stop_timeout_s(), wait=self._wait
        )
        log.info("the command exited with code %d", code)
        return code

    def _stop_timeout_s(self) -> float:
        """Seconds from SIGTERM to SIGKILL when stopping the tree now: ``--stop-timeout-s``, but
        SIGKILL at the latest halfway through the safety margin, so that every process is gone
        by the end of the grace period (after a notice)."""
        if self.end_unix_s is None:
            return self.config.stop_timeout_s
        kill_by_unix_s = self.end_unix_s - self.config.safety_margin_s / 2
        return max(0.0, min(self.config.stop_timeout_s, kill_by_unix_s - time.time()))

    def _stop_child(self) -> None:
        pgid = self.child.pid if self.child_returncode is None else None
        process.stop_tree(os.getpid(), pgid, stop_timeout_s=self._stop_timeout_s(), wait=self._wait)
        give_up = time.monotonic() + _REAP_AFTER_KILL_S
        while self.child_returncode is None and time.monotonic() < give_up:
            self._wait(give_up - time.monotonic())
        if self.child_returncode is None:
            log.error("pid %d survived SIGKILL for %.0f s; giving up on it", self.child.pid, _REAP_AFTER_KILL_S)
            self.child_returncode = -9

    # --- events ------------------------------------------------------------------

    def _wait(self, timeout_s: float | None, *, until_notice: bool = False) -> None:
        """Wait for events up to ``timeout_s`` seconds, handle them and reap children.

        With ``until_notice`` keep waiting for the whole ``timeout_s`` unless a notice comes.
        """
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if end is None else max(0.0, end - time.monotonic())
            self._handle_events(self.inbox.wait(remaining))
            self._reap()
            if not until_notice or self.notice is not None or remaining == 0.0:
                return

    def _handle_events(self, events: list[object]) -> None:
        for event in events:
            if isinstance(event, Notice):
                self._on_notice(event)
            elif isinstance(event, IgnoredSignal):
                self._on_ignored_signal(event)
            elif event != CHILD_EVENT:
                log.debug("ignoring unknown event %r", event)

    def _on_ignored_signal(self, event: IgnoredSignal) -> None:
        if event.signum in self.ignored_signals:
            log.debug("ignoring %s again", event.name)
            return
        self.ignored_signals.add(event.signum)
        log.warning(
            "ignoring %s: not a notice signal (--notice-signals: %s); still supervising (further %s are not logged)",
            event.name,
            describe_signals(self.config.notice_signal_numbers),
            event.name,
        )

    def _on_notice(self, notice: Notice) -> None:
        """The one place where a notice turns into a save request (signals and clouds alike)."""
        self.observers.emit(
            "notice",
            source=notice.source,
            kind=notice.kind,
            deadline_unix_s=notice.deadline_unix_s,
            stop=is_stop(notice),
        )
        if not is_stop(notice):  # e.g. an AWS rebalance recommendation: checkpoint, keep going
            log.warning("%s from %s: asking the workers for an ordinary checkpoint", notice.kind, notice.source)
            if self.control_dir is not None:
                control.write_checkpoint_request(self.control_dir, f"{notice.source}: {notice.kind}")
            return
        if notice.acknowledge is not None:
            self.acknowledgements.append((notice, notice.acknowledge))
        end_s = (
            notice.deadline_unix_s
            if notice.deadline_unix_s is not None
            else (notice.received_unix_s + self.config.grace_period_s)
        )
        deadline_unix_s = end_s - self.config.safety_margin_s
        if self.notice is not None and deadline_unix_s >= self.deadline_unix_s:
            log.info(
                "ignoring another notice (%s from %s): already saving, %.1f s to the deadline",
                notice.kind,
                notice.source,
                self.deadline_unix_s - time.time(),
            )
            return
        if self.notice is None:
            self.notice = notice
            if self.tier_service is not None:  # no other node may count on a replica held here
                self.tier_service.mark_leaving()
            log.warning(
                "preemption notice: %s from %s, %.1f s to the deadline",
                notice.kind,
                notice.source,
                deadline_unix_s - time.time(),
            )
        else:
            log.warning(
                "notice %s from %s moves the deadline earlier by %.1f s",
                notice.kind,
                notice.source,
                self.deadline_unix_s - deadline_unix_s,
            )
        self.deadline_unix_s = deadline_unix_s
        self.end_unix_s = end_s if self.end_unix_s is None else min(self.end_unix_s, end_s)
        if self.control_dir is not None:
            route = decide_emergency(
                self.control_dir,
                self.resumed_manifest,
                self.launch.min_ranks if self.launch else None,
                deadline_unix_s,
                self.observers,
                self.tier_service,
            )
            save = route is not None
            self.save_declined = not save
            if not save:  # nothing to commit: the workers may use the margin to stop cleanly
                self.deadline_unix_s = max(deadline_unix_s, end_s - self.config.stop_timeout_s)
            control.write_save_request(
                self.control_dir,
                control.SaveRequest(
                    reason=f"{notice.source}: {notice.kind}" if notice.source != "signal" else notice.kind,
                    requested_unix_s=time.time(),
                    deadline_unix_s=deadline_unix_s,
                    save=save,
                    tier=route or STORAGE,
                ),
            )
            self._deliver_notice()

    def _deliver_notice(self) -> None:
        """Tell the running command's workers of the stop notice as they listen: the request
        file only, or a signal as well (:mod:`spotrun.supervisor.foreign`)."""
        self.delivery_recheck_unix_s = None
        if self.delivery is not None and self.child_returncode is None:
            self.delivery_recheck_unix_s = self.delivery.deliver(self.deadline_unix_s)

    def _settle_memory_step(self, step: int) -> bool:
        """The workers committed ``step`` to the fast tier: its copy on another node (this node got the
        notice; until the processes must be gone), or its write to storage (this node stays)."""
        kill_by_unix_s = None if self.end_unix_s is None else self.end_unix_s - self.config.safety_margin_s / 2
        return settle_memory_step(
            self.tier_service,
            self.storage,
            step,
            deadline_unix_s=kill_by_unix_s if self.notice is not None else None,
            wait_s=self.config.grace_period_s,
        )

    def _reap(self) -> None:
        for pid, returncode in process.reap_children().items():
            if self.child is not None and pid == self.child.pid and self.child_returncode is None:
                self.child_returncode = returncode
                self.child.returncode = returncode  # so Popen never waits for it again
            else:
                log.debug("reaped pid %d (exit code %d)", pid, process.exit_code(returncode))

    # --- outcome -----------------------------------------------------------------

    def _preempted_exit_code(self, code: int, control_dir: str, *, stopped_without_save: bool) -> int:
        code, self.saved_step = exit_codes.preempted_exit_code(
            self.storage,
            code,
            control_dir,
            choice=self.delivery.choice if self.delivery is not None else None,
            declined=self.save_declined or stopped_without_save,
            acknowledgements=self.acknowledgements,
            settle_memory_step=self._settle_memory_step,
        )
        return code

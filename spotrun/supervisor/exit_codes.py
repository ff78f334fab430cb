"""``spotrun run``'s exit codes, and the one it chooses after a notice (from what the workers
reported and what the storage holds)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from spotrun.checkpoint import catalog
from spotrun.errors import SpotrunError
from spotrun.notices import Notice
from spotrun.storage import Storage
from spotrun.supervisor import outcome
from spotrun.supervisor.foreign import Delivery, DeliveryChoice

log = logging.getLogger("spotrun.supervisor.run")  # the supervisor's own log lines

EXIT_FINISHED = 0
EXIT_PREEMPTED_SAVED = 143
EXIT_PREEMPTED_NOT_SAVED = 142
#: Below 128 (permanent for Kubeflow's ExitCode policy); not 1, 2, 126, 127, 64-78 nor 128 + S.
EXIT_FENCED = 86


def exit_reason(code: int) -> str:
    """The ``reason`` of the ``exit`` event for ``spotrun run``'s exit code."""
    return {
        EXIT_FINISHED: "finished",
        EXIT_PREEMPTED_SAVED: "preempted_saved",
        EXIT_PREEMPTED_NOT_SAVED: "preempted_not_saved",
        EXIT_FENCED: "fenced",
    }.get(code, "failed")


def preempted_exit_code(
    storage: Storage,
    code: int,
    control_dir: str,
    *,
    choice: DeliveryChoice | None,
    declined: bool,
    acknowledgements: list[tuple[Notice, Callable[[], object]]],
    settle_memory_step: Callable[[int], bool] | None = None,
) -> tuple[int, int | None]:
    """The exit code after a notice (or workers that stopped or saved on their own), and the
    emergency checkpoint's step once it is complete (else ``None``).

    ``code``: the command's exit code; ``choice``: how its workers heard of the notice;
    ``declined``: the save was declined, or the workers stopped without one;
    ``acknowledgements``: called once the save committed; ``settle_memory_step``: for an
    emergency checkpoint in the fast tier, makes it safe (its copy on another node, or its
    write to storage) and says whether it is.
    """
    try:
        report = outcome.commit_report(control_dir)
    except SpotrunError as exc:
        log.error("%s", exc)
        report = None
    if report is None and choice is not None and choice.delivery is Delivery.SIGNAL:
        # The workers heard of the notice as a signal, not of spotrun's save decision.
        return foreign_exit_code(code, acknowledgements), None
    if report is None and declined:
        outcome.check_resume_point(storage, declined=True)
        return EXIT_PREEMPTED_NOT_SAVED, None
    if report is None:
        if choice is not None and choice.foreign:
            return foreign_exit_code(code, acknowledgements), None
        if code == 0:
            log.info("the command exited 0 without an emergency checkpoint: training finished")
            return EXIT_FINISHED, None
        log.warning("no emergency checkpoint committed (command exit code %d)", code)
        outcome.check_resume_point(storage)
        return EXIT_PREEMPTED_NOT_SAVED, None
    if report.tier == "memory":
        if settle_memory_step is None or not settle_memory_step(report.step):
            outcome.check_resume_point(storage)
            return EXIT_PREEMPTED_NOT_SAVED, None
        status, _problem = outcome.step_status(storage, report.step)
        if status != catalog.COMPLETE:  # held by another node, which writes it to storage
            log.info(
                "emergency checkpoint of step %d is in the fast tier of another node: exiting %d",
                report.step,
                EXIT_PREEMPTED_SAVED,
            )
            acknowledge(acknowledgements)
            return EXIT_PREEMPTED_SAVED, report.step
    status, problem = outcome.step_status(storage, report.step)
    if status != catalog.COMPLETE:
        log.error(
            "workers reported step %d committed, but it is %s on storage: %s",
            report.step,
            status,
            problem,
        )
        return EXIT_PREEMPTED_NOT_SAVED, None
    log.info("emergency checkpoint of step %d is complete: exiting %d", report.step, EXIT_PREEMPTED_SAVED)
    acknowledge(acknowledgements)
    return EXIT_PREEMPTED_SAVED, report.step


def foreign_exit_code(code: int, acknowledgements: list[tuple[Notice, Callable[[], object]]]) -> int:
    """The exit code after a notice for workers that save with their own framework."""
    if code == 0:
        log.info(
            "the command exited 0 after the notice: its workers saved with their own framework "
            "(spotrun cannot verify that checkpoint): exiting %d",
            EXIT_PREEMPTED_SAVED,
        )
        acknowledge(acknowledgements)
        return EXIT_PREEMPTED_SAVED
    log.warning(
        "the command exited %d after the notice: its workers save with their own framework, "
        "so spotrun cannot tell whether they saved; the restart resumes by the job's own logic: "
        "exiting %d",
        code,
        EXIT_PREEMPTED_NOT_SAVED,
    )
    return EXIT_PREEMPTED_NOT_SAVED


def acknowledge(acknowledgements: list[tuple[Notice, Callable[[], object]]]) -> None:
    """Acknowledge every notice that wants it (Azure StartRequests), only after the commit."""
    for notice, ack in acknowledgements:
        try:
            ack()
            log.info("acknowledged the %s notice (%s)", notice.source, notice.kind)
        except Exception as exc:  # an acknowledgement failure must not lose the exit code
            log.warning("acknowledging the %s notice failed: %s", notice.source, exc)

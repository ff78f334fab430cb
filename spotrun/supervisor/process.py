"""Process-tree chores of the supervisor: find descendants, stop them, reap zombies.

torchrun starts each worker in a new session, so signalling the launcher's process group
misses the workers. The supervisor therefore finds every descendant by walking the
parent links in ``/proc/<pid>/stat`` and signals each one. It also makes itself a *child
subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): a worker whose launcher died is re-parented
to the supervisor instead of to init, so it stays findable and gets reaped here.

Processes are identified by ``(pid, start time)``: a pid reused by an unrelated process
after the original exited is never signalled.

The launch command is started with ``PR_SET_PDEATHSIG`` (:func:`die_with_parent`): when the
supervisor dies, however it dies (SIGKILL included), the kernel sends the command SIGTERM,
which torchrun passes on to its workers (and SIGKILLs them after its shutdown timeout).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: Exit code of a launch child whose supervisor died before the child could start.
EXIT_PARENT_GONE = 128 + signal.SIGTERM
#: While stopping, how often to look for survivors, in seconds: descendants that are not
#: our own children send no SIGCHLD when they exit, so ``/proc`` must be read again.
STOP_POLL_S = 0.1


@dataclass(frozen=True)
class ProcInfo:
    """One live process.

    Attributes:
        pid: process id.
        ppid: parent process id.
        start_ticks: start time in clock ticks after boot (``/proc/<pid>/stat`` field 22),
            which together with ``pid`` names the process uniquely.
        state: one-letter state (``R``, ``S``, ``Z`` for a zombie, ...).
    """

    pid: int
    ppid: int
    start_ticks: int
    state: str


def _read_stat(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:  # gone, or not ours to read
        return None
    # "pid (comm) state ppid ..." - comm may hold spaces and parentheses.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return ProcInfo(pid=pid, ppid=int(fields[1]), start_ticks=int(fields[19]), state=fields[0])
    except (IndexError, ValueError):
        return None


def _all_processes() -> list[ProcInfo]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    infos = (_read_stat(int(name)) for name in names if name.isdigit())
    return [info for info in infos if info is not None]


def descendants(root_pid: int) -> list[ProcInfo]:
    """Every live (non-zombie) descendant of ``root_pid``, the root itself excluded.

    Returns an empty list where ``/proc`` is unavailable.
    """
    children: dict[int, list[ProcInfo]] = {}
    for info in _all_processes():
        children.setdefault(info.ppid, []).append(info)
    found: list[ProcInfo] = []
    stack = [root_pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child.pid != root_pid:
                found.append(child)
                stack.append(child.pid)
    return [info for info in found if info.state != "Z"]


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (the ``SigCgt`` mask of
    ``/proc/<pid>/status``, proc(5)); False when it is gone or the mask cannot be read.

    A signal sent before the handler is in place takes the default action (for SIGTERM: the
    process dies), so a sender that must be heard waits for this first.
    """
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def is_alive(info: ProcInfo) -> bool:
    """Whether the very process ``info`` names still runs (a zombie does not count)."""
    now = _read_stat(info.pid)
    return now is not None and now.start_ticks == info.start_ticks and now.state != "Z"


def proc_info(pid: int) -> ProcInfo | None:
    """Process ``pid`` as ``/proc`` shows it now; None when it is gone."""
    return _read_stat(pid)


def cmdline(pid: int) -> list[str]:
    """The arguments process ``pid`` runs with (``/proc/<pid>/cmdline``); empty when it is
    gone, a kernel thread or not ours to read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [word.decode(errors="replace") for word in raw.split(b"\0")[:-1]]


def environ(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (``/proc/<pid>/environ``: what it got
    from its parent at ``exec``, not later changes to its own ``os.environ``); None when it is
    gone, a zombie or not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw:  # a zombie's (or a kernel thread's) environment reads empty
        return None
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def send(info: ProcInfo, signum: int) -> None:
    """Send ``signum`` to the very process ``info`` names, if it still runs."""
    if not is_alive(info):
        return
    try:
        os.kill(info.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def signal_tree(root_pid: int, pgid: int | None, signum: int) -> list[ProcInfo]:
    """Send ``signum`` to process group ``pgid`` and to every descendant of ``root_pid``.

    Returns the processes signalled (so a caller can wait for exactly those).
    """
    targets = descendants(root_pid)
    if pgid is not None:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass
    for info in targets:
        send(info, signum)
    return targets


def stop_tree(
    root_pid: int,
    pgid: int | None,
    *,
    stop_timeout_s: float,
    wait: Callable[[float], None],
) -> int:
    """Stop every descendant of ``root_pid``: SIGTERM, then SIGKILL after ``stop_timeout_s``.

    Args:
        root_pid: the process whose descendants to stop (the supervisor itself).
        pgid: process group of the launch command, also signalled as a whole; ``None``
            once the command has been reaped.
        stop_timeout_s: seconds between SIGTERM and SIGKILL.
        wait: ``wait(timeout_s)`` blocks up to ``timeout_s`` seconds, returning early when
            something happened (a child exited); the supervisor passes a function that
            waits on its inbox and reaps children, so nothing stays a zombie meanwhile.

    Returns:
        How many processes were still alive when SIGKILL was sent.
    """
    signalled = signal_tree(root_pid, pgid, signal.SIGTERM)
    if not signalled:
        return 0
    log.info("sent SIGTERM to %d process(es): %s", len(signalled), _pids(signalled))
    deadline = time.monotonic() + stop_timeout_s
    while time.monotonic() < deadline:
        if not any(is_alive(i) for i in signalled) and not descendants(root_pid):
            return 0
        wait(min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
    return kill_tree(root_pid, pgid, signalled)


def kill_tree(root_pid: int, pgid: int | None, known: Sequence[ProcInfo] = ()) -> int:
    """SIGKILL every descendant of ``root_pid`` (and ``known`` processes still alive).

    Repeats the walk until it finds nothing new, so a process forked during the kill is
    caught too. Returns how many processes were killed.
    """
    killed: dict[tuple[int, int], ProcInfo] = {}
    pending = [i for i in known if is_alive(i)]
    for _round in range(10):
        pending += descendants(root_pid)
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        new = [i for i in pending if (i.pid, i.start_ticks) not in killed]
        if not new:
            break
        for info in new:
            send(info, signal.SIGKILL)
            killed[(info.pid, info.start_ticks)] = info
        pending = []
    if killed:
        log.warning("sent SIGKILL to %d process(es): %s", len(killed), _pids(killed.values()))
    return len(killed)


def stop_leftovers(
    root_pid: int, *, command_failed: bool, stop_timeout_s: float, wait: Callable[[float], None]
) -> None:
    """Stop what the launch command left running when it exited (orphans ``root_pid`` inherited).

    After a command that failed with no notice (torchrun crashed or was killed), they are the
    workers of a failed launch: SIGKILLed at once, as torchrun kills its workers when one fails,
    and waited for (at most ``stop_timeout_s``). A SIGTERM would have them take an emergency
    checkpoint, which the supervisor would read as a preemption elsewhere and end the job instead
    of restarting it. After any other exit: SIGTERM, then SIGKILL after ``stop_timeout_s``
    (:func:`stop_tree`). ``wait`` as for :func:`stop_tree`.
    """
    leftovers = descendants(root_pid)
    if not leftovers:
        return
    if not command_failed:
        log.warning("the command exited but left %d process(es) running: stopping them", len(leftovers))
        stop_tree(root_pid, None, stop_timeout_s=stop_timeout_s, wait=wait)
        return
    log.warning("the command failed and left %d process(es) running: killing them", len(leftovers))
    kill_tree(root_pid, None, leftovers)
    deadline = time.monotonic() + stop_timeout_s
    while any(is_alive(i) for i in leftovers) and time.monotonic() < deadline:
        wait(STOP_POLL_S)


def _pids(infos: Iterable[ProcInfo]) -> str:
    return ", ".join(str(i.pid) for i in infos)


def reap_children() -> dict[int, int]:
    """Reap every child that has exited, without blocking.

    Returns:
        ``{pid: exit_code}`` of the children reaped, with the shell convention for a
        death by signal N (``128 + N``, see :func:`exit_code`).
    """
    reaped: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        reaped[pid] = exit_code(os.waitstatus_to_exitcode(status))
    return reaped


def exit_code(returncode: int) -> int:
    """A Popen-style return code as a process exit code: ``-N`` (killed by signal N) -> ``128 + N``."""
    return 128 - returncode if returncode < 0 else returncode


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or ``None`` where there is none (not Linux)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    try:
        return ctypes.CDLL(libc_name, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux only).

    Returns:
        Whether it worked; on other systems or without ``prctl`` nothing changes.
    """
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child get ``signum`` when we die.

    The child asks the kernel for ``signum`` on its parent's death (``PR_SET_PDEATHSIG``),
    then checks that its parent is still the caller: if the caller died between the fork
    and the ``prctl``, the signal would never come, so the child exits at once with
    :data:`EXIT_PARENT_GONE`. The setting survives ``exec`` (of a binary that is not
    set-user-ID) but not ``fork``, so it covers the launch command only, not its children.

    The kernel sends the signal when the *thread* that forked the child ends, so call
    ``Popen`` from a thread that lives as long as the process (the supervisor uses its main
    thread). The function runs between ``fork`` and ``exec``: it only calls a C function
    looked up beforehand and two system calls, and takes no lock another thread could hold.

    Returns:
        The function, or ``None`` where ``prctl`` is missing (not Linux): start the child
        without it.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent_pid = os.getpid()
    number = int(signum)

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, number, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(EXIT_PARENT_GONE)

    return set_parent_death_signal

"""The signal notice source: which signals to the supervisor are preemption notices, and the rest.

:class:`SignalSource` is always on: it routes every signal that would end the supervisor, and
SIGCHLD, into the inbox through :func:`signal.set_wakeup_fd` (no work in a signal handler).
Each such signal is a **notice** (``--notice-signals``, default
:data:`DEFAULT_NOTICE_SIGNALS`), **ignored** (logged once), or a **fault**
(:data:`FAULT_SIGNALS`, which keep their default action). The groups in full:
``docs/design/internals.md`` (Notices).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spotrun.errors import ConfigError
from spotrun.notices.base import Notice, NoticeSource

if TYPE_CHECKING:
    from spotrun.notices.inbox import Inbox
    from spotrun.notices.options import NoticeOptions

#: The notice signals when ``--notice-signals`` is not given.
DEFAULT_NOTICE_SIGNALS = "TERM,INT,HUP,USR1,USR2"
#: Event meaning "a child process changed state" (SIGCHLD arrived).
CHILD_EVENT = "child"

#: Signals that report a fault in the process itself: they keep their default action.
FAULT_SIGNALS = frozenset(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGTRAP", "SIGSYS", "SIGABRT")
    if hasattr(signal, name)
)

# Default action "terminate" or "core dump" (signal(7)), faults excluded.
_TERMINATING_NAMES = (
    "SIGHUP",
    "SIGINT",
    "SIGQUIT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGPIPE",
    "SIGALRM",
    "SIGTERM",
    "SIGSTKFLT",
    "SIGXCPU",
    "SIGXFSZ",
    "SIGVTALRM",
    "SIGPROF",
    "SIGIO",
    "SIGPWR",
)
_RT = re.compile(r"RTM(IN|AX)(?:([+-])(\d+))?")


def terminating_signals() -> frozenset[int]:
    """Every catchable signal whose default action ends the process, faults excluded.

    Returns:
        Signal numbers; on Linux also every real-time signal ``SIGRTMIN..SIGRTMAX``.
    """
    numbers = {int(getattr(signal, name)) for name in _TERMINATING_NAMES if hasattr(signal, name)}
    if hasattr(signal, "SIGRTMIN"):
        numbers.update(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))
    return frozenset(numbers)


def signal_name(signum: int) -> str:
    """``15`` -> ``"SIGTERM"``; a real-time signal as ``"SIGRTMIN+3"``."""
    if hasattr(signal, "SIGRTMIN") and signal.SIGRTMIN < signum < signal.SIGRTMAX:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def parse_signal(token: str) -> int:
    """One signal name: ``TERM``, ``SIGTERM``, ``usr1``, ``RTMIN+3``, ``SIGRTMAX-1``.

    Raises:
        ConfigError: not a signal name.
    """
    name = token.strip().upper()
    bare = name[3:] if name.startswith("SIG") else name
    match = _RT.fullmatch(bare)
    if match and hasattr(signal, "SIGRTMIN"):
        base = signal.SIGRTMIN if match.group(1) == "IN" else signal.SIGRTMAX
        offset = int(match.group(3) or 0) * (-1 if match.group(2) == "-" else 1)
        number = base + offset
        if not signal.SIGRTMIN <= number <= signal.SIGRTMAX:
            raise ConfigError(f"{token.strip()!r} is outside SIGRTMIN..SIGRTMAX ({signal.SIGRTMIN}..{signal.SIGRTMAX})")
        return number
    number = getattr(signal, f"SIG{bare}", None)
    if not isinstance(number, signal.Signals):
        raise ConfigError(f"{token.strip()!r} is not a signal name (e.g. TERM, USR1, RTMIN+3)")
    return int(number)


def parse_notice_signals(text: str | Iterable[str]) -> frozenset[int]:
    """The ``--notice-signals`` value: comma-separated names, or ``none``.

    Args:
        text: e.g. ``"TERM,INT,HUP,USR1,USR2"``; ``"none"`` (no signal is a notice); a list
            of names is accepted too (from a YAML config file).

    Returns:
        The signal numbers.

    Raises:
        ConfigError: an unknown name, or a signal that cannot be a notice (SIGKILL and
            SIGSTOP cannot be caught, a fault signal keeps its default action, a signal
            that does not end a process needs no handling); the message lists the choices.
    """
    tokens = [t for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if [t.strip().lower() for t in tokens] == ["none"]:
        return frozenset()
    if not tokens:
        raise ConfigError("--notice-signals is empty: give signal names (TERM,INT,...) or none")
    return frozenset(
        _terminating_signal(token, "--notice-signals", "cannot be a notice signal", " (or none)") for token in tokens
    )


def parse_notify_signal(token: str) -> int:
    """The ``--notify-signal`` value: one signal that a training script can catch to save.

    Raises:
        ConfigError: an unknown name, or a signal no script could save on (SIGKILL and
            SIGSTOP cannot be caught, a fault signal means a crash, SIGCHLD, SIGCONT,
            SIGWINCH and the like are ignored by default); the message lists the choices.
    """
    return _terminating_signal(token, "--notify-signal", "cannot tell a job to save")


def _terminating_signal(token: str, option: str, refused: str, more_choices: str = "") -> int:
    allowed = terminating_signals()
    try:
        number = parse_signal(token)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None
    if number not in allowed:
        why = "reports a fault and keeps its default action" if number in FAULT_SIGNALS else refused
        raise ConfigError(
            f"{option}: {signal_name(number)} {why}; choose from "
            f"{', '.join(signal_name(s)[3:] for s in sorted(allowed) if s < getattr(signal, 'SIGRTMIN', 999))}"
            f"{', RTMIN+N' if hasattr(signal, 'SIGRTMIN') else ''}{more_choices}"
        )
    return number


def describe(numbers: Iterable[int]) -> str:
    """``{15, 2}`` -> ``"SIGINT, SIGTERM"`` (sorted by number); ``"none"`` when empty."""
    names = [signal_name(n) for n in sorted(numbers)]
    return ", ".join(names) if names else "none"


@dataclass(frozen=True)
class IgnoredSignal:
    """A signal that is not a notice arrived (e.g. SIGALRM, or SIGUSR1 left out of ``--notice-signals``).

    Attributes:
        signum: its number.
        name: its name (``"SIGALRM"``, ``"SIGRTMIN+3"``).
    """

    signum: int
    name: str


def _ignore(signum: int, frame: object) -> None:
    """Python-level handler: nothing to do; the wakeup fd already carries the signal."""


class SignalSource(NoticeSource):
    """Routes every signal that would end the supervisor, and SIGCHLD, into the inbox.

    The notice signals become :class:`Notice` events, every other signal of
    :func:`terminating_signals` an :class:`IgnoredSignal`, so no such signal can end the
    supervisor and leave its job unsupervised. Fault signals (SIGSEGV, ...) keep their
    default action. The signals are also unblocked in the main thread: a parent may have
    blocked them and the mask is inherited (a blocked SIGCHLD would leave exited children
    unnoticed, a blocked SIGTERM would swallow the notice). Handlers, unlike ``SIG_IGN``, are
    reset to the default by ``exec``, so the launch command starts with default
    dispositions. :meth:`stop` restores the previous handlers, wakeup fd and signal mask.

    Args:
        notice_signals: the signal numbers that are notices (see :func:`parse_notice_signals`).
    """

    name = "signal"

    def __init__(self, notice_signals: Collection[int]):
        self.notice_signals = frozenset(notice_signals)
        self._restore: tuple[dict[int, object], int, set[int] | None] | None = None

    def describe(self) -> str:
        return f"signals ({describe(self.notice_signals)})"

    def event(self, signum: int) -> object:
        """The inbox event for ``signum``: :data:`CHILD_EVENT`, a :class:`Notice` or an :class:`IgnoredSignal`."""
        if signum == signal.SIGCHLD:
            return CHILD_EVENT
        if signum in self.notice_signals:
            return Notice(source=self.name, kind=signal_name(signum), received_unix_s=time.time())
        return IgnoredSignal(signum=signum, name=signal_name(signum))

    def start(self, inbox: Inbox) -> None:
        """Install the handlers and the wakeup fd, and unblock the signals.

        Raises:
            ValueError: not called from the main thread.
        """
        watched = tuple(sorted({*terminating_signals(), *self.notice_signals, signal.SIGCHLD}))
        previous = {signum: signal.getsignal(signum) for signum in watched}
        old_fd = signal.set_wakeup_fd(inbox.route_signals(self.event), warn_on_full_buffer=False)
        old_mask = None
        try:
            for signum in watched:
                signal.signal(signum, _ignore)
            old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        except BaseException:
            _restore(previous, old_fd, old_mask)
            raise
        self._restore = (previous, old_fd, old_mask)

    def stop(self, timeout_s: float) -> None:
        """Restore the previous signal mask, handlers and wakeup fd (no thread to wait for)."""
        if self._restore is not None:
            restore, self._restore = self._restore, None
            _restore(*restore)


def _restore(previous: Mapping[int, object], old_fd: int, old_mask: set[int] | None) -> None:
    if old_mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    signal.set_wakeup_fd(old_fd)


def build(options: NoticeOptions, environ: Mapping[str, str]) -> list[NoticeSource]:
    """The signal source of ``options.notice_signals``."""
    return [SignalSource(options.notice_signals)]

"""Peak extra resident memory of an action, read from this process's ``/proc/self/status``.

Used by ``tests/unit/checkpoint/test_save_memory.py`` and ``benchmarks/checkpoint_vs_peers.py``, always in a
fresh child process per measurement, so that one tool's garbage (freed memory that the C heap
keeps, objects awaiting collection) is never counted for, or reused by, the next.

Method (Linux): collect garbage and hand the C heap's free pages back to the kernel
(``malloc_trim(0)``), read ``VmRSS`` (the memory the process really holds now), reset the peak
(``VmHWM``) to it by writing ``5`` to ``/proc/self/clear_refs``, run the action, read ``VmHWM``.
The difference is the most memory the action held at once beyond what was resident before,
threads included. The page cache filled by writing files is not in a process's RSS; file pages
the action maps (``mmap``) and touches are (``RssFile``): reading a file through a mapping counts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
#: Written to /proc/<pid>/clear_refs, resets the peak resident set size (Linux >= 4.0).
_RESET_PEAK_RSS = "5"


class PeakMemoryUnavailable(RuntimeError):
    """This system cannot reset or read a process's peak resident memory."""


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``...) in bytes.

    Raises:
        PeakMemoryUnavailable: no such file or field.
    """
    try:
        with open(_STATUS) as status:
            for line in status:
                name, _, value = line.partition(":")
                if name == field:
                    number, unit = value.split()
                    if unit != "kB":
                        raise PeakMemoryUnavailable(f"{_STATUS}: unexpected unit in {line!r}")
                    return int(number) * 1024
    except OSError as exc:
        raise PeakMemoryUnavailable(f"cannot read {_STATUS}: {exc}") from exc
    raise PeakMemoryUnavailable(f"{_STATUS} has no {field}")


def trim_heap() -> None:
    """Collect garbage, then give the C heap's free pages back to the kernel (glibc)."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def reset_peak() -> None:
    """Set the process's peak RSS (``VmHWM``) to its current RSS.

    Raises:
        PeakMemoryUnavailable: the kernel refused (older than 4.0, or no procfs).
    """
    try:
        with open(_CLEAR_REFS, "w") as clear_refs:
            clear_refs.write(_RESET_PEAK_RSS)
    except OSError as exc:
        raise PeakMemoryUnavailable(f"cannot reset the peak RSS through {_CLEAR_REFS}: {exc}") from exc
    if status_bytes("VmHWM") > status_bytes("VmRSS") + 4 * 2**20:
        raise PeakMemoryUnavailable("writing 5 to /proc/self/clear_refs did not reset VmHWM")


@dataclass(frozen=True)
class PeakMemory:
    """Resident memory around one action, in bytes.

    Attributes:
        before_bytes: ``VmRSS`` after trimming, just before the action.
        peak_bytes: ``VmHWM`` after the action (the most resident at once during it).
        after_bytes: ``VmRSS`` right after the action (what it kept).
    """

    before_bytes: int
    peak_bytes: int
    after_bytes: int

    @property
    def extra_bytes(self) -> int:
        """Most memory the action held at once beyond what was resident before it."""
        return max(0, self.peak_bytes - self.before_bytes)


def measure(action: Callable[[], T]) -> tuple[T, PeakMemory]:
    """Run ``action`` and return its result with the resident memory around it."""
    trim_heap()
    before = status_bytes("VmRSS")
    reset_peak()
    result = action()
    peak = status_bytes("VmHWM")
    after = status_bytes("VmRSS")
    return result, PeakMemory(before_bytes=before, peak_bytes=peak, after_bytes=after)

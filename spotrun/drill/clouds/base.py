"""What the drill needs from a cloud: :class:`DrillCloud`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from spotrun.drill.clouds.fake_server import FakeServer
    from spotrun.drill.report import DrillReport


class DrillCloud:
    """One cloud's part in a drill: its fake metadata server (started when the object is made,
    stopped by :meth:`close`) and how its notice is announced. Use as a context manager.

    Subclasses set :attr:`name` and :attr:`lead_s` and implement :meth:`run_options` and
    :meth:`serve`; :meth:`ready` and :meth:`check` are optional.
    """

    #: The ``--cloud`` value.
    name: ClassVar[str]
    #: Seconds from the cloud's notice to the end of the machine: the drill's default deadline.
    lead_s: ClassVar[float]

    def __init__(self) -> None:
        #: The fake metadata server on 127.0.0.1, or ``None`` when the notice needs none.
        self.fake: FakeServer | None = None

    def run_options(self) -> list[str]:
        """Options of ``spotrun run`` that make it listen for this notice (on :attr:`fake`)."""
        raise NotImplementedError

    def ready(self, pid: int) -> bool:
        """Whether the notice may be served to the ``spotrun run`` of process id ``pid`` now."""
        return True

    def serve(self, pid: int, deadline_unix_s: float) -> None:
        """Announce a preemption at ``deadline_unix_s`` (seconds since the epoch) to the
        ``spotrun run`` of process id ``pid``."""
        raise NotImplementedError

    def check(self, report: DrillReport) -> None:
        """After the emergency checkpoint committed: add this cloud's own problems to ``report``."""

    def close(self) -> None:
        """Stop the fake server."""
        if self.fake is not None:
            self.fake.close()

    def __enter__(self) -> DrillCloud:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

"""Azure in the drill: a fake IMDS with Scheduled Events (:class:`FakeAzure`) and its Preempt
event, which must be acknowledged only after the emergency commit (:class:`AzureDrill`)."""

from __future__ import annotations

import email.utils
import json
import uuid
from typing import TYPE_CHECKING

from spotrun.drill.clouds.base import DrillCloud
from spotrun.drill.clouds.fake_server import FakeServer, Reply, Request

if TYPE_CHECKING:
    from spotrun.drill.report import DrillReport

#: This VM's name in the drill's Azure events.
DRILL_VM_NAME = "spotrun-drill"


class AzureDrill(DrillCloud):
    """A Preempt event not before the deadline, served by :class:`FakeAzure`; :meth:`check`
    reads the acknowledgement (a StartRequests POST of that event, after the commit)."""

    name = "azure"
    lead_s = 30.0  # Azure gives at least 30 s

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeAzure(vm_name=DRILL_VM_NAME)
        self.event_id: str | None = None

    def run_options(self) -> list[str]:
        return ["--notice", "azure", "--azure-metadata-endpoint", self.fake.url, "--azure-vm-name", DRILL_VM_NAME]

    def serve(self, pid: int, deadline_unix_s: float) -> None:
        self.event_id = self.fake.add_event("Preempt", not_before_unix_s=deadline_unix_s)["EventId"]

    def check(self, report: DrillReport) -> None:
        posts = self.fake.requests_to(FakeAzure.EVENTS_PATH, "POST")
        if not posts:
            report.problems.append("the azure event was never acknowledged")
            return
        expected = [{"StartRequests": [{"EventId": self.event_id}]}]
        if self.fake.start_requests != expected:
            report.problems.append(f"the azure acknowledgements are {self.fake.start_requests}, expected {expected}")
        report.acknowledged_unix_s = posts[0].received_unix_s
        if report.acknowledged_unix_s < report.commit_unix_s:
            report.problems.append("the azure event was acknowledged before the emergency checkpoint committed")


def rfc1123(unix_s: float) -> str:
    """``Tue, 09 Aug 2022 17:07:32 GMT``, as Azure writes NotBefore."""
    return email.utils.formatdate(unix_s, usegmt=True)


class FakeAzure(FakeServer):
    """Azure IMDS: Scheduled Events (``Metadata: true`` required) and the VM's name.

    Args:
        vm_name: answered by ``compute/name``; ``None`` makes that endpoint 404.
    """

    EVENTS_PATH = "/metadata/scheduledevents"
    NAME_PATH = "/metadata/instance/compute/name"

    def __init__(self, vm_name: str | None = "vm-1") -> None:
        self.vm_name = vm_name
        self.incarnation = 1
        self.events: list[dict] = []
        self.start_requests: list[dict] = []  # parsed bodies of valid acknowledgement POSTs
        super().__init__()

    def add_event(
        self,
        event_type: str = "Preempt",
        resources: list[str] | None = None,
        not_before_unix_s: float | None = None,
        **fields: object,
    ) -> dict:
        """Schedule an event (for this VM unless ``resources`` says otherwise); returns it."""
        event = {
            "EventId": str(uuid.uuid4()).upper(),
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": [self.vm_name] if resources is None else resources,
            "EventStatus": "Scheduled",
            "NotBefore": "" if not_before_unix_s is None else rfc1123(not_before_unix_s),
            "Description": "",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
            **fields,
        }
        with self._changed:
            self.events.append(event)
            self.incarnation += 1
        return event

    def remove_event(self, event_id: str) -> None:
        """The event vanishes (cancelled or done)."""
        with self._changed:
            self.events = [e for e in self.events if e["EventId"] != event_id]
            self.incarnation += 1

    def reply(self, request: Request) -> Reply:
        if request.headers.get("metadata") != "true" or "api-version" not in request.query:
            return Reply(400, b'{"error": "Bad request"}')
        if request.path == self.NAME_PATH and request.method == "GET" and self.vm_name is not None:
            return Reply(200, self.vm_name.encode(), {"Content-Type": "text/plain"})
        if request.path != self.EVENTS_PATH:
            return Reply(404)
        with self._changed:
            if request.method == "GET":
                doc = {"DocumentIncarnation": self.incarnation, "Events": list(self.events)}
                return Reply(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})
            if request.method == "POST":
                if not _valid_start_requests(request.body):
                    return Reply(400)
                self.start_requests.append(json.loads(request.body))
                return Reply(200)
        return Reply(405)


def _valid_start_requests(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    starts = doc.get("StartRequests") if isinstance(doc, dict) else None
    return (
        isinstance(starts, list)
        and bool(starts)
        and all(isinstance(s, dict) and isinstance(s.get("EventId"), str) for s in starts)
    )


#: This module's cloud (see :data:`spotrun.drill.clouds.MODULES`).
CLOUD = AzureDrill

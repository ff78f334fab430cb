"""GCP in the drill: a fake metadata server (:class:`FakeGcp`) and its preemption notice
(:class:`GcpDrill`)."""

from __future__ import annotations

import hashlib

from spotrun.drill.clouds.base import DrillCloud
from spotrun.drill.clouds.fake_server import FakeServer, Reply, Request


class GcpDrill(DrillCloud):
    """``instance/preempted`` turns ``TRUE``, served by :class:`FakeGcp`. The notice carries no
    time: the supervisor gives it its own 30 s window."""

    name = "gcp"
    lead_s = 30.0

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeGcp()

    def run_options(self) -> list[str]:
        return ["--notice", "gcp", "--gcp-metadata-host", self.fake.host_port]

    def serve(self, pid: int, deadline_unix_s: float) -> None:
        self.fake.set_preempted()


class FakeGcp(FakeServer):
    """GCP metadata: ``Metadata-Flavor: Google`` required, values with ETags, long polls."""

    PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
    MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
    #: Longest a long poll blocks when the client gives no timeout_sec, in seconds.
    MAX_WAIT_S = 60.0

    def __init__(self) -> None:
        self.values = {self.PREEMPTED_PATH: "FALSE", self.MAINTENANCE_PATH: "NONE"}
        super().__init__()

    def set_preempted(self, preempted: bool = True) -> None:
        """``instance/preempted`` becomes ``TRUE`` (or ``FALSE``); long polls waiting on it answer."""
        self._set(self.PREEMPTED_PATH, "TRUE" if preempted else "FALSE")

    def set_maintenance_event(self, value: str) -> None:
        """``instance/maintenance-event`` becomes ``value``; long polls waiting on it answer."""
        self._set(self.MAINTENANCE_PATH, value)

    def _set(self, path: str, value: str) -> None:
        with self._changed:
            self.values[path] = value
            self._changed.notify_all()

    @staticmethod
    def etag(value: str) -> str:
        """The ETag served with ``value`` (16 hex digits of its SHA-256)."""
        return hashlib.sha256(value.encode()).hexdigest()[:16]

    def reply(self, request: Request) -> Reply:
        if request.headers.get("metadata-flavor") != "Google":
            return Reply(403, b"Missing Metadata-Flavor:Google header.")
        if request.method != "GET" or request.path not in self.values:
            return Reply(404)
        with self._changed:
            value = self.values[request.path]
            if request.query.get("wait_for_change") == "true":
                last_etag = request.query.get("last_etag")
                try:
                    wait_s = float(request.query.get("timeout_sec", self.MAX_WAIT_S))
                except ValueError:
                    return Reply(400)
                start_etag = last_etag if last_etag is not None else self.etag(value)
                self._changed.wait_for(
                    lambda: self.etag(self.values[request.path]) != start_etag or self._closing.is_set(),
                    min(wait_s, self.MAX_WAIT_S),
                )
                value = self.values[request.path]
        return Reply(
            200,
            value.encode(),
            {"ETag": self.etag(value), "Metadata-Flavor": "Google", "Content-Type": "application/text"},
        )


#: This module's cloud (see :data:`spotrun.drill.clouds.MODULES`).
CLOUD = GcpDrill

"""AWS in the drill: a fake IMDSv2 (:class:`FakeAws`) and its spot interruption notice
(:class:`AwsDrill`)."""

from __future__ import annotations

import json
import secrets
import time

from spotrun.drill.clouds.base import DrillCloud
from spotrun.drill.clouds.fake_server import FakeServer, Reply, Request


class AwsDrill(DrillCloud):
    """A spot instance-action ``terminate`` at the deadline, served by :class:`FakeAws`."""

    name = "aws"
    lead_s = 120.0  # AWS warns about 2 minutes ahead

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeAws()

    def run_options(self) -> list[str]:
        return ["--notice", "aws", "--aws-metadata-endpoint", self.fake.url]

    def serve(self, pid: int, deadline_unix_s: float) -> None:
        self.fake.set_instance_action("terminate", deadline_unix_s)


def rfc3339(unix_s: float) -> str:
    """``2017-09-18T08:22:00Z``, as AWS writes times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


class FakeAws(FakeServer):
    """IMDSv2: token PUT, token-checked GETs, 404 until a notice is set.

    Args:
        token_life_s: how long issued tokens really last, in seconds (``None``: the TTL the
            client asked for); a short life plays tokens that expire under the client.
        disabled: answer 403 everywhere (IMDS turned off).
    """

    TOKEN_PATH = "/latest/api/token"
    INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"

    def __init__(self, *, token_life_s: float | None = None, disabled: bool = False) -> None:
        self.token_life_s = token_life_s
        self.disabled = disabled
        self.tokens: dict[str, float] = {}  # token -> expiry (time.monotonic())
        self.documents: dict[str, bytes] = {}
        super().__init__()

    def set_instance_action(self, action: str, time_unix_s: float) -> bytes:
        """Announce a spot interruption; returns the body served."""
        return self._set(self.INSTANCE_ACTION_PATH, {"action": action, "time": rfc3339(time_unix_s)})

    def set_rebalance(self, notice_unix_s: float) -> bytes:
        """Announce a rebalance recommendation; returns the body served."""
        return self._set(self.REBALANCE_PATH, {"noticeTime": rfc3339(notice_unix_s)})

    def expire_tokens(self) -> None:
        """Every token issued so far stops working (401 from now on)."""
        with self._changed:
            self.tokens.clear()

    def _set(self, path: str, doc: dict) -> bytes:
        body = json.dumps(doc).encode()
        with self._changed:
            self.documents[path] = body
        return body

    def reply(self, request: Request) -> Reply:
        if self.disabled:
            return Reply(403)
        if request.path == self.TOKEN_PATH:
            return self._token(request)
        if request.method != "GET":
            return Reply(405)
        with self._changed:
            expiry = self.tokens.get(request.headers.get("x-aws-ec2-metadata-token", ""))
            if expiry is None or time.monotonic() >= expiry:
                return Reply(401)
            body = self.documents.get(request.path)
        return Reply(404) if body is None else Reply(200, body, {"Content-Type": "text/plain"})

    def _token(self, request: Request) -> Reply:
        if request.method != "PUT" or "x-forwarded-for" in request.headers:
            return Reply(403 if request.method == "PUT" else 405)
        try:
            ttl_s = int(request.headers["x-aws-ec2-metadata-token-ttl-seconds"])
        except (KeyError, ValueError):
            return Reply(400)
        if not 1 <= ttl_s <= 21600:
            return Reply(400)
        token = secrets.token_urlsafe(32)
        life_s = ttl_s if self.token_life_s is None else self.token_life_s
        with self._changed:
            self.tokens[token] = time.monotonic() + life_s
        return Reply(200, token.encode(), {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl_s)})


#: This module's cloud (see :data:`spotrun.drill.clouds.MODULES`).
CLOUD = AwsDrill

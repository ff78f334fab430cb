"""AWS EC2 spot interruption notices and rebalance recommendations through IMDSv2.

Polls ``spot/instance-action`` (a stop notice) and ``events/recommendations/rebalance`` (a
:data:`~spotrun.notices.base.REBALANCE` notice: an ordinary checkpoint), with a session token,
every 2 s like aws-node-termination-handler. The endpoint is
``AWS_EC2_METADATA_SERVICE_ENDPOINT`` when set, else ``http://169.254.169.254``. The protocol,
with its sources: ``docs/design/internals.md`` (Notices).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from spotrun.errors import ConfigError
from spotrun.notices import _http, _parse
from spotrun.notices.base import REBALANCE, Endpoint, Finding, NoticeSource, PolledSource, PollProblem

if TYPE_CHECKING:
    from spotrun.notices.options import NoticeOptions

log = logging.getLogger(__name__)

ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
ACTIONS = ("terminate", "stop", "hibernate")
MAX_TOKEN_TTL_S = 21600
DEFAULT_POLL_PERIOD_S = 2.0
DEFAULT_TIMEOUT_S = 2.0
_MAX_TOKEN_CHARS = 4096
_HOP_LIMIT_HINT = "; in a container, the instance's IMDS hop limit must be at least 2"


def endpoint_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``$AWS_EC2_METADATA_SERVICE_ENDPOINT`` if set and not empty, else the default endpoint."""
    env = os.environ if environ is None else environ
    return env.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


class AwsSource(PolledSource):
    """Polls IMDSv2 for a spot instance-action (stop notice) and a rebalance recommendation.

    Args:
        endpoint: ``http://host[:port]`` of IMDS; ``None`` reads :func:`endpoint_from_env`.
        poll_period_s: seconds between polls (2 s as the AWS node termination handler).
        timeout_s: bound on each HTTP request in seconds.
        token_ttl_s: lifetime requested for each token, 1..21600 s; renewed before it ends
            and whenever a GET answers 401.
        retry_after_error_s: wait after a failed poll; default ``poll_period_s``.

    Raises:
        ConfigError: a bad endpoint URL or token TTL.
    """

    name = "aws"

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        poll_period_s: float = DEFAULT_POLL_PERIOD_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token_ttl_s: int = MAX_TOKEN_TTL_S,
        retry_after_error_s: float | None = None,
    ):
        super().__init__(poll_period_s=poll_period_s, retry_after_error_s=retry_after_error_s)
        self.endpoint = _http.check_base_url(endpoint or endpoint_from_env(), "AWS metadata endpoint")
        if isinstance(token_ttl_s, bool) or not isinstance(token_ttl_s, int) or not 1 <= token_ttl_s <= MAX_TOKEN_TTL_S:
            raise ConfigError(f"AWS token TTL must be an integer 1..{MAX_TOKEN_TTL_S} s, got {token_ttl_s!r}")
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_renew_at = 0.0  # time.monotonic() after which the token is renewed

    def describe(self) -> str:
        return f"aws (IMDSv2 at {self.endpoint}, every {self.poll_period_s:g} s)"

    def poll_once(self) -> list[Finding]:
        findings = []
        body = self._get(INSTANCE_ACTION_PATH)
        if body is not None:
            finding = self._instance_action(body)
            if finding is not None:
                findings.append(finding)
        body = self._get(REBALANCE_PATH)
        if body is not None:
            finding = self._rebalance(body)
            if finding is not None:
                findings.append(finding)
        return findings

    def _instance_action(self, body: bytes) -> Finding | None:
        try:
            doc = _parse.json_object(body, "spot/instance-action")
            action = _parse.field(doc, "action", str, "spot/instance-action")
            if action not in ACTIONS:
                raise PollProblem(
                    "bad spot/instance-action.action", f"spot/instance-action has an unknown action {action!r:.40}"
                )
            deadline_unix_s = _parse.rfc3339_unix_s(
                _parse.field(doc, "time", str, "spot/instance-action"), "spot/instance-action"
            )
        except PollProblem as problem:
            self.problems.report(problem.key, problem.message + "; ignored")
            return None
        return Finding(kind=f"spot instance-action {action}", body=body, deadline_unix_s=deadline_unix_s)

    def _rebalance(self, body: bytes) -> Finding | None:
        try:
            doc = _parse.json_object(body, "rebalance recommendation")
            _parse.rfc3339_unix_s(
                _parse.field(doc, "noticeTime", str, "rebalance recommendation"), "rebalance recommendation"
            )
        except PollProblem as problem:
            self.problems.report(problem.key, problem.message + "; ignored")
            return None
        return Finding(kind=REBALANCE, body=body)

    def _get(self, path: str) -> bytes | None:
        """The body of ``path``; ``None`` on 404. Renews the token once on 401."""
        for attempt in range(2):
            token = self._current_token()
            response = _http.request(self.endpoint + path, headers={TOKEN_HEADER: token}, timeout_s=self.timeout_s)
            if response.status == 401:
                log.debug("aws notices: token refused (HTTP 401)%s", "" if attempt else ": getting a new one")
                self._token = None
                continue
            if response.status == 200:
                return response.body
            if response.status == 404:
                return None
            if response.status == 403:
                raise PollProblem("disabled", "the instance metadata service is disabled (HTTP 403)")
            raise PollProblem(f"HTTP {response.status}", f"GET {path} answered HTTP {response.status}")
        raise PollProblem("token refused", f"GET {path} refused a fresh token too (HTTP 401)")

    def _current_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_renew_at:
            return self._token
        self._token = None
        requested_at = time.monotonic()
        try:
            response = _http.request(
                self.endpoint + TOKEN_PATH,
                method="PUT",
                headers={TTL_HEADER: str(self.token_ttl_s)},
                timeout_s=self.timeout_s,
            )
        except PollProblem as problem:
            hint = _HOP_LIMIT_HINT if problem.key == "timeout" else ""
            raise PollProblem(problem.key, f"token request failed: {problem.message}{hint}") from problem
        if response.status == 403:
            raise PollProblem("disabled", "the instance metadata service is disabled (HTTP 403 on the token request)")
        if response.status != 200:
            raise PollProblem(f"token HTTP {response.status}", f"token request answered HTTP {response.status}")
        token = response.text().strip()
        if not token or len(token) > _MAX_TOKEN_CHARS or not token.isprintable() or any(c.isspace() for c in token):
            raise PollProblem("bad token", f"the token response is not a usable token: {response.body[:40]!r}")
        # Renew before the end: at 3/4 of a short TTL, a minute early for long ones.
        self._token_renew_at = requested_at + self.token_ttl_s - min(60.0, self.token_ttl_s / 4)
        self._token = token
        return token


def probe(endpoint: str, timeout_s: float) -> bool:
    """True if an IMDSv2 token can be obtained from ``endpoint`` within ``timeout_s`` seconds."""
    try:
        response = _http.request(endpoint + TOKEN_PATH, method="PUT", headers={TTL_HEADER: "60"}, timeout_s=timeout_s)
    except PollProblem:
        return False
    return response.status == 200 and bool(response.body.strip())


def endpoint(options: NoticeOptions, environ: Mapping[str, str]) -> Endpoint:
    """The IMDS URL in use: ``--aws-metadata-endpoint``, else :func:`endpoint_from_env`."""
    if options.aws_endpoint:
        return Endpoint(options.aws_endpoint, "--aws-metadata-endpoint is set")
    if environ.get(ENDPOINT_ENV):
        return Endpoint(environ[ENDPOINT_ENV], f"{ENDPOINT_ENV} is set")
    return Endpoint(DEFAULT_ENDPOINT, None)


def build(options: NoticeOptions, environ: Mapping[str, str]) -> list[NoticeSource]:
    """The AWS source of ``options``.

    Raises:
        ConfigError: a bad endpoint URL.
    """
    return [AwsSource(endpoint(options, environ).url, timeout_s=options.http_timeout_s, **options.poll_timing())]

"""GCP Compute Engine preemption and host-maintenance notices from the metadata server.

Long-polls ``instance/preempted`` and ``instance/maintenance-event``
(``wait_for_change``), one source each (:func:`gcp_sources`). A Spot VM often gets no metadata
lead at all, so SIGTERM stays the primary path on GCP. The host is ``GCE_METADATA_HOST`` when
set, else ``metadata.google.internal``. The protocol, with its sources:
``docs/design/internals.md`` (Notices).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from spotrun.errors import ConfigError
from spotrun.notices import _http
from spotrun.notices.base import Endpoint, Finding, NoticeSource, PolledSource, PollProblem

if TYPE_CHECKING:
    from spotrun.notices.options import NoticeOptions

HOST_ENV = "GCE_METADATA_HOST"
DEFAULT_HOST = "metadata.google.internal"
PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
FLAVOR_HEADER = {"Metadata-Flavor": "Google"}
#: Hard off comes 30 s after the soft off of a Spot VM.
DEFAULT_PREEMPT_WINDOW_S = 30.0
#: Warning given by TERMINATE_ON_HOST_MAINTENANCE.
MAINTENANCE_WINDOW_S = 60.0
DEFAULT_POLL_PERIOD_S = 1.0
DEFAULT_RETRY_AFTER_ERROR_S = 5.0
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_WAIT_TIMEOUT_S = 30
_MAX_ETAG_CHARS = 256


def base_url_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``http://`` + ``$GCE_METADATA_HOST`` if set and not empty, else the default host."""
    env = os.environ if environ is None else environ
    return "http://" + (env.get(HOST_ENV) or DEFAULT_HOST)


class GcpValueSource(PolledSource):
    """Long-polls one metadata value and turns some of its values into notices.

    Args:
        base_url: ``http://host[:port]``; ``None`` reads :func:`base_url_from_env`.
        path: the value's path, e.g. :data:`PREEMPTED_PATH`.
        notice_values: value -> (notice kind, deadline window in seconds from now).
        quiet_values: values that mean "nothing announced".
        poll_period_s: pause between two polls (a long poll itself waits for a change).
        timeout_s: HTTP timeout in seconds, added to ``wait_timeout_s`` for long polls.
        wait_timeout_s: the long poll's ``timeout_sec``, whole seconds >= 1.
        retry_after_error_s: pause after a failed poll (about 5 s, as GCP recommends).

    Raises:
        ConfigError: a bad URL or wait timeout.
    """

    name = "gcp"

    def __init__(
        self,
        base_url: str | None = None,
        *,
        path: str,
        notice_values: Mapping[str, tuple[str, float]],
        quiet_values: tuple[str, ...],
        poll_period_s: float = DEFAULT_POLL_PERIOD_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        wait_timeout_s: int = DEFAULT_WAIT_TIMEOUT_S,
        retry_after_error_s: float = DEFAULT_RETRY_AFTER_ERROR_S,
    ):
        super().__init__(poll_period_s=poll_period_s, retry_after_error_s=retry_after_error_s)
        self.base_url = _http.check_base_url(base_url or base_url_from_env(), "GCP metadata host")
        if isinstance(wait_timeout_s, bool) or not isinstance(wait_timeout_s, int) or wait_timeout_s < 1:
            raise ConfigError(f"GCP long-poll timeout must be a whole number of seconds >= 1, got {wait_timeout_s!r}")
        self.path = path
        self.notice_values = dict(notice_values)
        self.quiet_values = quiet_values
        self.timeout_s = timeout_s
        self.wait_timeout_s = wait_timeout_s
        self._etag: str | None = None

    def describe(self) -> str:
        return f"gcp ({self.base_url}{self.path}, long poll)"

    def poll_once(self) -> list[Finding]:
        url = self.base_url + self.path
        timeout_s = self.timeout_s
        if self._etag is not None:
            query = {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": str(self.wait_timeout_s)}
            url += "?" + urlencode(query)
            timeout_s += self.wait_timeout_s
        try:
            response = _http.request(url, headers=FLAVOR_HEADER, timeout_s=timeout_s)
        except PollProblem:
            self._etag = None  # start again with a plain read
            raise
        if response.status != 200:
            self._etag = None
            hint = " (the server refused the Metadata-Flavor request)" if response.status == 403 else ""
            raise PollProblem(f"HTTP {response.status}", f"GET {self.path} answered HTTP {response.status}{hint}")
        etag = response.headers.get("ETag")
        self._etag = etag if etag and len(etag) <= _MAX_ETAG_CHARS and etag.isprintable() else None
        value = response.text().strip()
        if value in self.notice_values:
            kind, window_s = self.notice_values[value]
            return [Finding(kind=kind, body=value.encode(), deadline_unix_s=time.time() + window_s)]
        if value not in self.quiet_values:
            self.problems.report(f"bad value {self.path}", f"{self.path} has an unknown value {value[:60]!r}; ignored")
        return []


def preempted_source(
    base_url: str | None = None, *, window_s: float = DEFAULT_PREEMPT_WINDOW_S, **kwargs: object
) -> GcpValueSource:
    """A source for ``instance/preempted``: ``TRUE`` is a stop notice due ``window_s`` seconds later."""
    return GcpValueSource(
        base_url,
        path=PREEMPTED_PATH,
        quiet_values=("FALSE",),
        notice_values={"TRUE": ("instance/preempted TRUE", window_s)},
        **kwargs,
    )


def maintenance_source(base_url: str | None = None, **kwargs: object) -> GcpValueSource:
    """A source for ``instance/maintenance-event``: TERMINATE_ON_HOST_MAINTENANCE, due in 60 s."""
    return GcpValueSource(
        base_url,
        path=MAINTENANCE_PATH,
        quiet_values=("NONE", "MIGRATE_ON_HOST_MAINTENANCE"),
        notice_values={
            "TERMINATE_ON_HOST_MAINTENANCE": ("maintenance-event TERMINATE_ON_HOST_MAINTENANCE", MAINTENANCE_WINDOW_S)
        },
        **kwargs,
    )


def gcp_sources(
    base_url: str | None = None, *, window_s: float = DEFAULT_PREEMPT_WINDOW_S, **kwargs: object
) -> list[GcpValueSource]:
    """Both GCP sources (preempted and maintenance-event) with the same options."""
    return [preempted_source(base_url, window_s=window_s, **kwargs), maintenance_source(base_url, **kwargs)]


def probe(base_url: str, timeout_s: float) -> bool:
    """True if ``base_url`` answers ``instance/preempted`` with TRUE or FALSE within ``timeout_s``."""
    try:
        response = _http.request(base_url + PREEMPTED_PATH, headers=FLAVOR_HEADER, timeout_s=timeout_s)
    except PollProblem:
        return False
    return response.status == 200 and response.text().strip() in ("TRUE", "FALSE")


def endpoint(options: NoticeOptions, environ: Mapping[str, str]) -> Endpoint:
    """The metadata base URL in use: ``--gcp-metadata-host``, else :func:`base_url_from_env`."""
    if options.gcp_host:
        return Endpoint("http://" + options.gcp_host, "--gcp-metadata-host is set")
    return Endpoint(base_url_from_env(environ), f"{HOST_ENV} is set" if environ.get(HOST_ENV) else None)


def build(options: NoticeOptions, environ: Mapping[str, str]) -> list[NoticeSource]:
    """Both GCP sources of ``options``.

    Raises:
        ConfigError: a bad host.
    """
    return list(
        gcp_sources(
            endpoint(options, environ).url,
            window_s=options.gcp_window_s,
            timeout_s=options.http_timeout_s,
            wait_timeout_s=options.gcp_wait_timeout_s,
            **options.poll_timing(),
        )
    )

"""Azure Scheduled Events: Preempt (and Terminate) events for this VM, acknowledged after the save.

Polls the Scheduled Events endpoint about once a second, keeps the events naming this VM, takes
``NotBefore`` as the deadline, and gives each notice an ``acknowledge`` callable that the
supervisor calls only after the emergency checkpoint committed. The endpoint is an option,
default ``http://169.254.169.254``. The protocol: ``docs/design/internals.md`` (Notices).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from spotrun.errors import SpotrunError
from spotrun.notices import _http, _parse
from spotrun.notices.base import Endpoint, Finding, NoticeSource, PolledSource, PollProblem

if TYPE_CHECKING:
    from spotrun.notices.options import NoticeOptions

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
EVENTS_PATH = "/metadata/scheduledevents"
API_VERSION = "2020-07-01"
NAME_PATH = "/metadata/instance/compute/name"
NAME_API_VERSION = "2021-02-01"
METADATA_HEADER = {"Metadata": "true"}
#: Event types that end this VM, and so are stop notices.
STOP_EVENT_TYPES = ("Preempt", "Terminate")
#: Minimum notice Azure gives for Preempt, in seconds.
MIN_NOTICE_S = 30.0
DEFAULT_POLL_PERIOD_S = 1.0
DEFAULT_TIMEOUT_S = 2.0
#: The first Scheduled Events call may take up to 2 minutes (it enables the service).
DEFAULT_FIRST_CALL_TIMEOUT_S = 125.0
_MAX_EVENT_ID_CHARS = 256


class AcknowledgeError(SpotrunError):
    """The StartRequests POST failed (no answer, or a status other than 200)."""


class AzureSource(PolledSource):
    """Polls Scheduled Events for a stop event naming this VM.

    Args:
        endpoint: ``http://host[:port]`` of the instance metadata service.
        vm_name: this VM's name as events list it in ``Resources``; ``None`` asks IMDS
            (``compute/name``) until it answers. Compared case-insensitively.
        event_types: event types that are stop notices.
        poll_period_s: seconds between polls (Azure suggests about 1 s).
        timeout_s: bound on each HTTP request in seconds.
        first_call_timeout_s: bound on the first Scheduled Events request in seconds.
        retry_after_error_s: wait after a failed poll; default ``poll_period_s``.

    Raises:
        ConfigError: a bad endpoint URL.
    """

    name = "azure"

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        vm_name: str | None = None,
        event_types: tuple[str, ...] = STOP_EVENT_TYPES,
        poll_period_s: float = DEFAULT_POLL_PERIOD_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        first_call_timeout_s: float = DEFAULT_FIRST_CALL_TIMEOUT_S,
        retry_after_error_s: float | None = None,
    ):
        super().__init__(poll_period_s=poll_period_s, retry_after_error_s=retry_after_error_s)
        self.endpoint = _http.check_base_url(endpoint or DEFAULT_ENDPOINT, "Azure metadata endpoint")
        self.events_url = f"{self.endpoint}{EVENTS_PATH}?{urlencode({'api-version': API_VERSION})}"
        self.vm_name = vm_name or None
        self.event_types = tuple(event_types)
        self.timeout_s = timeout_s
        self.first_call_timeout_s = first_call_timeout_s
        self._answered = False  # the service has answered once (it is enabled)

    def describe(self) -> str:
        return f"azure (Scheduled Events at {self.endpoint}, VM {self.vm_name or '<from IMDS>'})"

    def poll_once(self) -> list[Finding]:
        vm_name = self.vm_name or self._lookup_vm_name()
        timeout_s = self.timeout_s if self._answered else max(self.timeout_s, self.first_call_timeout_s)
        response = _http.request(self.events_url, headers=METADATA_HEADER, timeout_s=timeout_s)
        self._answered = True
        if response.status != 200:
            raise PollProblem(f"HTTP {response.status}", f"GET {EVENTS_PATH} answered HTTP {response.status}")
        doc = _parse.json_object(response.body, "scheduled events")
        events = _parse.field(doc, "Events", list, "scheduled events")
        findings = []
        for event in events:
            try:
                finding = self._finding(event, vm_name)
            except PollProblem as problem:
                self.problems.report(problem.key, problem.message + "; event ignored")
                continue
            if finding is not None:
                findings.append(finding)
        return findings

    def _finding(self, event: object, vm_name: str) -> Finding | None:
        if not isinstance(event, dict):
            raise PollProblem("bad event", f"an event is not a JSON object: {event!r:.80}")
        event_type = _parse.field(event, "EventType", str, "event")
        if event_type not in self.event_types:
            log.debug("azure notices: ignoring a %s event", event_type[:40])
            return None
        event_id = _parse.field(event, "EventId", str, "event")
        if not event_id or len(event_id) > _MAX_EVENT_ID_CHARS:
            raise PollProblem("bad event.EventId", f"unusable EventId {event_id!r:.80}")
        resources = _parse.field(event, "Resources", list, "event")
        if not any(isinstance(r, str) and r.casefold() == vm_name.casefold() for r in resources):
            log.debug(
                "azure notices: ignoring %s event %s for %r, not this VM (%s)", event_type, event_id, resources, vm_name
            )
            return None
        not_before = event.get("NotBefore", "")
        if not isinstance(not_before, str):
            raise PollProblem("bad event.NotBefore", f"event NotBefore is not a string: {not_before!r:.80}")
        if not_before.strip():
            deadline_unix_s = _parse.rfc1123_unix_s(not_before, "event NotBefore")
        else:
            deadline_unix_s = time.time() + MIN_NOTICE_S
        body = json.dumps(event, sort_keys=True).encode()
        return Finding(
            kind=f"scheduled event {event_type} {event_id}",
            body=body,
            deadline_unix_s=deadline_unix_s,
            acknowledge=lambda: self.acknowledge(event_id),
        )

    def acknowledge(self, event_id: str) -> None:
        """POST ``{"StartRequests": [{"EventId": event_id}]}``: the VM is ready for the event.

        Raises:
            AcknowledgeError: no answer, or an HTTP status other than 200.
        """
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        headers = {**METADATA_HEADER, "Content-Type": "application/json"}
        try:
            response = _http.request(
                self.events_url, method="POST", headers=headers, body=body, timeout_s=self.timeout_s
            )
        except PollProblem as problem:
            raise AcknowledgeError(f"acknowledging scheduled event {event_id}: {problem.message}") from problem
        if response.status != 200:
            raise AcknowledgeError(
                f"acknowledging scheduled event {event_id}: HTTP {response.status} {response.text()[:200]!r}"
            )
        log.info("azure notices: acknowledged scheduled event %s", event_id)

    def _lookup_vm_name(self) -> str:
        try:
            name = lookup_vm_name(self.endpoint, self.timeout_s)
        except PollProblem as problem:
            raise PollProblem(
                f"vm name {problem.key}",
                f"cannot learn this VM's name ({problem.message}); pass the VM name as an option",
            ) from problem
        log.info("azure notices: this VM is %r (from the instance metadata service)", name)
        self.vm_name = name
        return name


def lookup_vm_name(endpoint: str, timeout_s: float) -> str:
    """This VM's name from IMDS ``compute/name``.

    Raises:
        PollProblem: no answer, an HTTP error or an empty or unusable name.
    """
    query = urlencode({"api-version": NAME_API_VERSION, "format": "text"})
    response = _http.request(f"{endpoint}{NAME_PATH}?{query}", headers=METADATA_HEADER, timeout_s=timeout_s)
    if response.status != 200:
        raise PollProblem(f"HTTP {response.status}", f"GET {NAME_PATH} answered HTTP {response.status}")
    name = response.text().strip()
    if not name or len(name) > 256 or not name.isprintable():
        raise PollProblem("bad name", f"GET {NAME_PATH} gave an unusable name {response.body[:60]!r}")
    return name


def probe(endpoint: str, timeout_s: float) -> bool:
    """True if ``endpoint`` answers like Azure IMDS (a VM name) within ``timeout_s`` seconds."""
    try:
        lookup_vm_name(endpoint, timeout_s)
    except PollProblem:
        return False
    return True


def endpoint(options: NoticeOptions, environ: Mapping[str, str]) -> Endpoint:
    """The IMDS URL in use: ``--azure-metadata-endpoint``, else the default address."""
    if options.azure_endpoint:
        return Endpoint(options.azure_endpoint, "--azure-metadata-endpoint is set")
    return Endpoint(DEFAULT_ENDPOINT, None)


def build(options: NoticeOptions, environ: Mapping[str, str]) -> list[NoticeSource]:
    """The Azure source of ``options``.

    Raises:
        ConfigError: a bad endpoint URL.
    """
    return [
        AzureSource(
            endpoint(options, environ).url,
            vm_name=options.azure_vm_name,
            timeout_s=options.http_timeout_s,
            first_call_timeout_s=options.azure_first_call_timeout_s,
            **options.poll_timing(),
        )
    ]

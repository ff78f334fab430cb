"""Notice sources against fake metadata servers on 127.0.0.1 (spotrun/drill/clouds/)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time

import pytest

from spotrun.drill.clouds.aws import FakeAws
from spotrun.drill.clouds.azure import FakeAzure
from spotrun.drill.clouds.gcp import FakeGcp
from spotrun.errors import ConfigError
from spotrun.notices import (
    REBALANCE,
    Inbox,
    Notice,
    NoticeOptions,
    NoticePoller,
    NoticeWatch,
    PolledSource,
    build_sources,
    detect_cloud,
    is_stop,
    parse_notice_option,
    start_sources,
)
from spotrun.notices.aws import AwsSource
from spotrun.notices.azure import AcknowledgeError, AzureSource
from spotrun.notices.files import FileSource
from spotrun.notices.gcp import maintenance_source, preempted_source
from spotrun.notices.signals import CHILD_EVENT, IgnoredSignal, SignalSource

FAST = 0.05  # poll period in seconds for threaded tests
TIMEOUT_S = 10.0  # HTTP timeout of the sources under test: never reached by a working fake
SLOW_TIMEOUT_S = 0.3  # HTTP timeout in the tests of a server slower than that
WAIT_S = 30.0  # generous bound when waiting for a thread on a loaded machine


@pytest.fixture(autouse=True)
def _capture_spotrun_logs(caplog, monkeypatch):
    """Make sure the notice warnings reach caplog whatever configured logging before."""
    monkeypatch.setattr(logging.getLogger("spotrun"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger="spotrun")


@pytest.fixture
def aws():
    with FakeAws() as fake:
        yield fake


@pytest.fixture
def gcp():
    with FakeGcp() as fake:
        yield fake


@pytest.fixture
def azure():
    with FakeAzure(vm_name="vm-1") as fake:
        yield fake


@pytest.fixture
def closed_url():
    """``http://127.0.0.1:PORT`` where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_url():
    """A port that accepts connections (kernel backlog) but never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def poll(source: PolledSource, times: int = 3) -> list[Notice]:
    """Poll ``times`` times through a poller (with de-duplication); every notice posted."""
    posted: list[Notice] = []
    poller = NoticePoller(source, posted.append)
    for _ in range(times):
        poller.poll()
    return posted


def warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name.startswith("spotrun.notices") and r.levelno >= logging.WARNING
    ]


# --- AWS -------------------------------------------------------------------------------


def test_aws_no_notice_posts_nothing_and_uses_imdsv2(aws, caplog):
    assert poll(AwsSource(aws.url, timeout_s=TIMEOUT_S)) == []
    puts = aws.requests_to(FakeAws.TOKEN_PATH, "PUT")
    assert len(puts) == 1  # the token is reused while it lasts
    assert puts[0].headers["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    gets = aws.requests_to(FakeAws.INSTANCE_ACTION_PATH)
    assert len(gets) == 3 and {g.headers["x-aws-ec2-metadata-token"] for g in gets} == set(aws.tokens)
    assert not any("x-forwarded-for" in r.headers for r in aws.requests)
    assert warnings(caplog) == []


def test_aws_spot_interruption_is_one_stop_notice_due_at_its_time(aws):
    due_unix_s = float(int(time.time()) + 120)
    aws.set_instance_action("terminate", due_unix_s)
    notices = poll(AwsSource(aws.url, timeout_s=TIMEOUT_S), times=4)
    assert len(notices) == 1
    assert notices[0].source == "aws" and "terminate" in notices[0].kind and is_stop(notices[0])
    assert notices[0].deadline_unix_s == due_unix_s
    assert notices[0].acknowledge is None


def test_aws_changed_instance_action_is_a_new_notice(aws):
    source = AwsSource(aws.url, timeout_s=TIMEOUT_S)
    posted: list[Notice] = []
    poller = NoticePoller(source, posted.append)
    aws.set_instance_action("stop", time.time() + 120)
    poller.poll()
    poller.poll()
    aws.set_instance_action("terminate", time.time() + 60)
    poller.poll()
    assert [("stop" in n.kind, "terminate" in n.kind) for n in posted] == [(True, False), (False, True)]


def test_aws_rebalance_recommendation_is_not_a_stop(aws):
    aws.set_rebalance(time.time())
    notices = poll(AwsSource(aws.url, timeout_s=TIMEOUT_S))
    assert [(n.kind, n.deadline_unix_s, is_stop(n)) for n in notices] == [(REBALANCE, None, False)]


def test_aws_expired_token_is_renewed_transparently(aws, caplog):
    source = AwsSource(aws.url, timeout_s=TIMEOUT_S)
    assert poll(source, times=1) == []
    aws.expire_tokens()
    aws.set_instance_action("terminate", time.time() + 120)
    notices = poll(source, times=1)
    assert len(notices) == 1
    assert len(aws.requests_to(FakeAws.TOKEN_PATH)) == 2
    assert warnings(caplog) == []


def test_aws_tokens_that_never_work_are_logged_once(caplog):
    with FakeAws(token_life_s=0.0) as aws:  # every token has expired when it is used
        aws.set_instance_action("terminate", time.time() + 120)
        assert poll(AwsSource(aws.url, timeout_s=TIMEOUT_S), times=3) == []
        assert len(aws.requests_to(FakeAws.TOKEN_PATH)) == 6  # a new token after each 401
    assert len(warnings(caplog)) == 1 and "401" in warnings(caplog)[0]


def test_aws_endpoint_from_the_sdk_variable(aws, monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", aws.url)
    aws.set_instance_action("hibernate", time.time() + 120)
    notices = poll(AwsSource(timeout_s=TIMEOUT_S))
    assert len(notices) == 1 and "hibernate" in notices[0].kind


def test_aws_disabled_imds_is_logged_once(caplog):
    with FakeAws(disabled=True) as aws:
        assert poll(AwsSource(aws.url, timeout_s=TIMEOUT_S), times=4) == []
    assert len(warnings(caplog)) == 1 and "disabled" in warnings(caplog)[0]


@pytest.mark.parametrize("token", [b"", b"two words", b"line\r\nX-Injected: 1", b"t" * 5000])
def test_aws_unusable_token_is_logged_once(aws, token, caplog):
    aws.set_instance_action("terminate", time.time() + 120)
    aws.misbehave(FakeAws.TOKEN_PATH, body=token)
    assert poll(AwsSource(aws.url, timeout_s=TIMEOUT_S)) == []
    assert len(warnings(caplog)) == 1 and "token" in warnings(caplog)[0]
    assert aws.requests_to(FakeAws.INSTANCE_ACTION_PATH) == []


# --- GCP -------------------------------------------------------------------------------


def test_gcp_not_preempted_posts_nothing(gcp, caplog):
    assert poll(preempted_source(gcp.url, timeout_s=TIMEOUT_S, wait_timeout_s=1), times=2) == []
    assert all(r.headers.get("metadata-flavor") == "Google" for r in gcp.requests)
    assert warnings(caplog) == []


def test_gcp_preempted_is_one_notice_with_the_configured_window(gcp):
    gcp.set_preempted()
    notices = poll(preempted_source(gcp.url, window_s=30.0, timeout_s=TIMEOUT_S, wait_timeout_s=1), times=2)
    assert len(notices) == 1 and notices[0].source == "gcp" and is_stop(notices[0])
    assert 29.0 <= notices[0].deadline_unix_s - notices[0].received_unix_s <= 30.0


def test_gcp_long_polls_with_the_last_etag(gcp):
    source = preempted_source(gcp.url, timeout_s=TIMEOUT_S, wait_timeout_s=20)
    with Inbox() as inbox:
        with NoticeWatch(inbox) as watch:
            watch.start([source])
            assert gcp.wait_for(lambda: any(r.query.get("wait_for_change") for r in gcp.requests), WAIT_S)
            gcp.set_preempted()
            inbox_posts = inbox.wait(WAIT_S)
            assert inbox_posts
        inbox_posts += inbox.wait(0)
    waits = [r for r in gcp.requests_to(FakeGcp.PREEMPTED_PATH) if r.query.get("wait_for_change") == "true"]
    assert waits[0].query["last_etag"] == FakeGcp.etag("FALSE")
    assert waits[0].query["timeout_sec"] == "20"
    assert len(inbox_posts) == 1
    # it waited for the change instead of polling every 50 ms
    assert len(gcp.requests_to(FakeGcp.PREEMPTED_PATH)) <= 4


def test_gcp_host_maintenance(gcp):
    source = maintenance_source(gcp.url, timeout_s=TIMEOUT_S, wait_timeout_s=1)
    gcp.set_maintenance_event("MIGRATE_ON_HOST_MAINTENANCE")
    assert poll(source, times=1) == []
    gcp.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
    notices = poll(source, times=2)
    assert len(notices) == 1 and "TERMINATE_ON_HOST_MAINTENANCE" in notices[0].kind
    assert 59.0 <= notices[0].deadline_unix_s - notices[0].received_unix_s <= 60.0


def test_gcp_host_from_the_sdk_variable(gcp, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", gcp.host_port)
    gcp.set_preempted()
    assert len(poll(preempted_source(timeout_s=TIMEOUT_S, wait_timeout_s=1), times=1)) == 1


# --- Azure -----------------------------------------------------------------------------


def test_azure_no_events_posts_nothing(azure, caplog):
    assert poll(AzureSource(azure.url, vm_name="vm-1", timeout_s=TIMEOUT_S)) == []
    gets = azure.requests_to(FakeAzure.EVENTS_PATH, "GET")
    assert gets and all(r.headers["metadata"] == "true" and r.query["api-version"] == "2020-07-01" for r in gets)
    assert warnings(caplog) == []


def test_azure_preempt_for_this_vm_is_one_notice_due_at_not_before(azure):
    not_before_unix_s = float(int(time.time()) + 30)
    azure.add_event("Preempt", not_before_unix_s=not_before_unix_s)
    notices = poll(AzureSource(azure.url, vm_name="VM-1", timeout_s=TIMEOUT_S), times=3)
    assert len(notices) == 1 and notices[0].source == "azure" and "Preempt" in notices[0].kind
    assert notices[0].deadline_unix_s == not_before_unix_s
    assert azure.start_requests == []  # never acknowledged by polling


def test_azure_acknowledgement_posts_start_requests(azure):
    event = azure.add_event("Preempt", not_before_unix_s=time.time() + 30)
    [notice] = poll(AzureSource(azure.url, vm_name="vm-1", timeout_s=TIMEOUT_S))
    notice.acknowledge()
    assert azure.start_requests == [{"StartRequests": [{"EventId": event["EventId"]}]}]
    [post] = azure.requests_to(FakeAzure.EVENTS_PATH, "POST")
    assert post.headers["metadata"] == "true" and post.query["api-version"] == "2020-07-01"


def test_azure_failed_acknowledgement_raises(azure):
    azure.add_event("Preempt", not_before_unix_s=time.time() + 30)
    [notice] = poll(AzureSource(azure.url, vm_name="vm-1", timeout_s=TIMEOUT_S))
    azure.misbehave(FakeAzure.EVENTS_PATH, status=400)
    with pytest.raises(AcknowledgeError):
        notice.acknowledge()


def test_azure_ignores_events_for_other_vms_and_other_types(azure, caplog):
    azure.add_event("Preempt", resources=["vm-2"], not_before_unix_s=time.time() + 30)
    azure.add_event("Freeze", not_before_unix_s=time.time() + 30)
    assert poll(AzureSource(azure.url, vm_name="vm-1", timeout_s=TIMEOUT_S)) == []
    assert warnings(caplog) == []


def test_azure_terminate_without_not_before_gets_the_minimum_notice(azure):
    azure.add_event("Terminate", not_before_unix_s=None, EventStatus="Started")
    [notice] = poll(AzureSource(azure.url, vm_name="vm-1", timeout_s=TIMEOUT_S))
    assert 29.0 <= notice.deadline_unix_s - notice.received_unix_s <= 30.0


def test_azure_vm_name_from_imds(azure):
    azure.add_event("Preempt", not_before_unix_s=time.time() + 30)
    azure.add_event("Preempt", resources=["vm-2"], not_before_unix_s=time.time() + 30)
    notices = poll(AzureSource(azure.url, timeout_s=TIMEOUT_S))
    assert len(notices) == 1
    assert azure.requests_to(FakeAzure.NAME_PATH)


def test_azure_without_a_vm_name_acts_on_nothing(caplog):
    with FakeAzure(vm_name=None) as azure:
        azure.add_event("Preempt", resources=["anything"], not_before_unix_s=time.time() + 30)
        assert poll(AzureSource(azure.url, timeout_s=TIMEOUT_S), times=3) == []
    assert len(warnings(caplog)) == 1 and "name" in warnings(caplog)[0]


def test_azure_vanished_and_new_events(azure):
    source = AzureSource(azure.url, vm_name="vm-1", timeout_s=TIMEOUT_S)
    posted: list[Notice] = []
    poller = NoticePoller(source, posted.append)
    first = azure.add_event("Preempt", not_before_unix_s=time.time() + 30)
    poller.poll()
    azure.remove_event(first["EventId"])
    poller.poll()
    azure.add_event("Preempt", not_before_unix_s=time.time() + 40)
    poller.poll()
    assert len(posted) == 2


# --- file ------------------------------------------------------------------------------


def test_file_notice_appears(tmp_path, caplog):
    path = tmp_path / "drill" / "notice"
    source = FileSource(str(path))
    posted: list[Notice] = []
    poller = NoticePoller(source, posted.append)
    poller.poll()
    assert posted == []
    path.parent.mkdir()
    path.write_text("")
    poller.poll()
    poller.poll()
    assert [(n.source, n.deadline_unix_s, is_stop(n)) for n in posted] == [("file", None, True)]
    path.write_text(json.dumps({"deadline_in_s": 20}))
    poller.poll()
    assert len(posted) == 2 and 19.0 <= posted[1].deadline_unix_s - posted[1].received_unix_s <= 20.0
    assert warnings(caplog) == []


def test_file_notice_kinds_and_bad_content(tmp_path, caplog):
    path = tmp_path / "notice"
    path.write_text(json.dumps({"kind": REBALANCE, "deadline_unix_s": 1.5e9}))
    [notice] = poll(FileSource(str(path)))
    assert not is_stop(notice) and notice.deadline_unix_s == 1.5e9
    path.write_text("{garbage")
    [notice] = poll(FileSource(str(path)))
    assert is_stop(notice) and notice.deadline_unix_s is None
    assert len(warnings(caplog)) == 1


# --- hostile and broken servers ----------------------------------------------------------

HUGE = b"x" * (2 * 1024 * 1024)


def _aws(url, timeout_s=TIMEOUT_S):
    return AwsSource(url, timeout_s=timeout_s)


def _gcp(url, timeout_s=TIMEOUT_S):
    return preempted_source(url, timeout_s=timeout_s, wait_timeout_s=1, retry_after_error_s=FAST)


def _azure(url, timeout_s=TIMEOUT_S):
    return AzureSource(url, vm_name="vm-1", timeout_s=timeout_s, first_call_timeout_s=timeout_s)


CASES = {
    "aws": (FakeAws, FakeAws.INSTANCE_ACTION_PATH, _aws),
    "gcp": (FakeGcp, FakeGcp.PREEMPTED_PATH, _gcp),
    "azure": (FakeAzure, FakeAzure.EVENTS_PATH, _azure),
}
MISBEHAVIOURS = {
    "HTTP 500": {"status": 500, "body": b"oops"},
    "HTTP 403": {"status": 403},
    "huge body": {"body": HUGE},
    "slow": {"delay_s": 4 * SLOW_TIMEOUT_S, "body": b"TRUE"},
    "dropped connection": {"drop": True},
}
BAD_BODIES = {
    "aws": [
        b"{not json",
        b"[1, 2]",
        json.dumps({"action": 5, "time": []}).encode(),
        json.dumps({"action": "explode", "time": "2020-01-01T00:00:00Z"}).encode(),
        json.dumps({"action": "terminate", "time": "yesterday"}).encode(),
        b"\xff\xfe",
    ],
    "gcp": [b"MAYBE", b"\xff\xfe", b""],
    "azure": [
        b"{not json",
        b"null",
        json.dumps({"Events": "x"}).encode(),
        json.dumps({"Events": [5]}).encode(),
        json.dumps({"Events": [{"EventType": "Preempt", "EventId": "e", "Resources": "vm-1"}]}).encode(),
        json.dumps(
            {"Events": [{"EventType": "Preempt", "EventId": "e", "Resources": ["vm-1"], "NotBefore": "tomorrow"}]}
        ).encode(),
        json.dumps({"Events": [{"EventType": "Preempt", "EventId": ["e"], "Resources": ["vm-1"]}]}).encode(),
    ],
}


@pytest.mark.parametrize("cloud", CASES)
@pytest.mark.parametrize("misbehaviour", MISBEHAVIOURS)
def test_broken_server_is_logged_once_and_never_raises(cloud, misbehaviour, caplog):
    fake_type, path, make = CASES[cloud]
    with fake_type() as fake:
        fake.misbehave(path, **MISBEHAVIOURS[misbehaviour])
        timeout_s = SLOW_TIMEOUT_S if misbehaviour == "slow" else TIMEOUT_S
        assert poll(make(fake.url, timeout_s), times=3) == []
    assert len(warnings(caplog)) == 1, warnings(caplog)


@pytest.mark.parametrize("cloud", CASES)
def test_malformed_notices_are_ignored_and_logged_once_each(cloud, caplog):
    fake_type, path, make = CASES[cloud]
    with fake_type() as fake:
        for body in BAD_BODIES[cloud]:
            fake.misbehave(path, body=body)
            caplog.clear()
            assert poll(make(fake.url), times=3) == []
            assert len(warnings(caplog)) == 1, (body, warnings(caplog))


@pytest.mark.parametrize("cloud", CASES)
def test_unreachable_server_is_logged_once(cloud, closed_url, caplog):
    assert poll(CASES[cloud][2](closed_url), times=3) == []
    assert len(warnings(caplog)) == 1 and "refused" in warnings(caplog)[0]


def test_source_recovers_after_the_server_does(aws, caplog):
    source = AwsSource(aws.url, timeout_s=TIMEOUT_S)
    posted: list[Notice] = []
    poller = NoticePoller(source, posted.append)
    aws.misbehave(FakeAws.INSTANCE_ACTION_PATH, status=503)
    poller.poll()
    aws.behave(FakeAws.INSTANCE_ACTION_PATH)
    aws.set_instance_action("terminate", time.time() + 120)
    poller.poll()
    assert len(posted) == 1 and len(warnings(caplog)) == 1


# --- the polling threads ------------------------------------------------------------------


class _Exploding(PolledSource):
    """A source whose every poll fails with an unexpected error (a bug)."""

    name = "exploding"

    def __init__(self) -> None:
        super().__init__(poll_period_s=FAST)
        self.calls = 0
        self.called_thrice = threading.Event()

    def poll_once(self):
        self.calls += 1
        if self.calls >= 3:
            self.called_thrice.set()
        raise RuntimeError("bug")


def test_an_unexpected_error_does_not_stop_polling(caplog):
    source = _Exploding()
    with Inbox() as inbox, NoticeWatch(inbox) as watch:
        watch.start([source])
        assert source.called_thrice.wait(WAIT_S)
    assert len(warnings(caplog)) == 1 and "RuntimeError" in warnings(caplog)[0]


def test_pollers_deliver_to_the_inbox_and_stop(aws):
    aws.set_instance_action("terminate", time.time() + 120)
    source = AwsSource(aws.url, timeout_s=TIMEOUT_S, poll_period_s=FAST)
    with Inbox() as inbox:
        watch = NoticeWatch(inbox)
        watch.start([source])
        events: list[object] = []
        end = time.monotonic() + WAIT_S
        while not events and time.monotonic() < end:
            events = inbox.wait(end - time.monotonic())
        assert len(events) == 1 and isinstance(events[0], Notice) and events[0].source == "aws"
        # keeps polling (4 more polls) without posting the repeat
        count = len(aws.requests_to(FakeAws.INSTANCE_ACTION_PATH))
        assert aws.wait_for(lambda: len(aws.requests_to(FakeAws.INSTANCE_ACTION_PATH)) >= count + 4, WAIT_S)
        watch.stop()
        assert not source.alive()
        assert inbox.wait(0) == []


# --- signals -----------------------------------------------------------------------------


def _next_signal_event(inbox: Inbox) -> list[object]:
    """The next events of ``inbox`` other than SIGCHLD (a child of an earlier test may exit)."""
    end = time.monotonic() + WAIT_S
    events: list[object] = []
    while not events and time.monotonic() < end:
        events = [e for e in inbox.wait(end - time.monotonic()) if e != CHILD_EVENT]
    return events


def test_signal_source_delivers_notice_signals_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with Inbox() as inbox:
        with NoticeWatch(inbox) as watch:
            watch.start([SignalSource({signal.SIGUSR1})])
            os.kill(os.getpid(), signal.SIGUSR1)
            notices = _next_signal_event(inbox)
            os.kill(os.getpid(), signal.SIGUSR2)
            ignored = _next_signal_event(inbox)
        assert [(n.source, n.kind, is_stop(n)) for n in notices] == [("signal", "SIGUSR1", True)]
        assert ignored == [IgnoredSignal(signum=signal.SIGUSR2, name="SIGUSR2")]
    assert signal.getsignal(signal.SIGUSR1) is before
    assert signal.set_wakeup_fd(-1) == -1  # no wakeup fd left behind


def test_signals_run_whatever_notice_says(tmp_path):
    options = NoticeOptions(notice_file=str(tmp_path / "n"), poll_period_s=FAST)
    for value, names in (("none", ["signal"]), ("file", ["signal", "file"]), ("file,signal", ["signal", "file"])):
        with Inbox() as inbox, NoticeWatch(inbox) as watch:
            start_sources(parse_notice_option(value), options, watch, environ={})
            assert [s.name for s in watch.sources] == names


# --- --notice and detection -----------------------------------------------------------------


def test_parse_notice_option():
    assert parse_notice_option("auto").auto
    none = parse_notice_option("none")
    assert not none.auto and none.names == frozenset()
    listed = parse_notice_option(" AWS, signal ")
    assert listed.names == {"aws", "signal"} and not listed.auto
    for bad in ("", "aws,", "amazon", "auto,aws", "none,signal"):
        with pytest.raises(ConfigError):
            parse_notice_option(bad)


def test_file_source_needs_a_path():
    with pytest.raises(ConfigError):
        build_sources(parse_notice_option("file"), NoticeOptions())


@pytest.mark.parametrize(
    "bad",
    [
        {"aws_endpoint": "https://x"},
        {"aws_endpoint": "169.254.169.254"},
        {"azure_endpoint": "http://h/path"},
        {"gcp_host": "h:notaport"},
    ],
)
def test_bad_endpoints_are_config_errors(bad):
    with pytest.raises(ConfigError):
        build_sources(parse_notice_option("aws,gcp,azure"), NoticeOptions(**bad), environ={})


def test_build_sources_for_a_list(tmp_path):
    options = NoticeOptions(
        aws_endpoint="http://127.0.0.1:1",
        gcp_host="127.0.0.1:1",
        azure_endpoint="http://127.0.0.1:1",
        notice_file=str(tmp_path / "n"),
        poll_period_s=FAST,
    )
    sources = build_sources(parse_notice_option("aws,gcp,azure,file,signal"), options, environ={})
    assert sorted(s.name for s in sources) == ["aws", "azure", "file", "gcp", "gcp"]
    assert all(s.poll_period_s == FAST for s in sources)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_auto_detects_the_cloud(cloud, closed_url, tmp_path):
    fake_type = {"aws": FakeAws, "gcp": FakeGcp, "azure": FakeAzure}[cloud]
    with fake_type() as fake:
        urls = {c: (fake.url if c == cloud else closed_url) for c in ("aws", "gcp", "azure")}
        options = NoticeOptions(
            aws_endpoint=urls["aws"],
            gcp_host=urls["gcp"].removeprefix("http://"),
            azure_endpoint=urls["azure"],
            notice_file=str(tmp_path / "n"),
        )
        assert detect_cloud(options, environ={}) == cloud
        sources = build_sources(parse_notice_option("auto"), options, environ={})
    assert {s.name for s in sources} == {cloud, "file"}


@pytest.mark.parametrize("cloud", ["aws", "azure"])
def test_auto_tells_aws_from_azure_on_the_same_address(cloud, closed_url):
    fake_type = {"aws": FakeAws, "azure": FakeAzure}[cloud]
    with fake_type() as fake:  # both clouds use 169.254.169.254
        options = NoticeOptions(
            aws_endpoint=fake.url, azure_endpoint=fake.url, gcp_host=closed_url.removeprefix("http://")
        )
        assert detect_cloud(options, environ={}) == cloud


def test_auto_off_cloud_gives_up_quickly(closed_url, silent_url):
    options = NoticeOptions(
        aws_endpoint=silent_url,
        gcp_host=closed_url.removeprefix("http://"),
        azure_endpoint=silent_url,
        detect_timeout_s=2.0,
    )
    started = time.monotonic()
    sources = build_sources(parse_notice_option("auto"), options, environ={})
    elapsed_s = time.monotonic() - started
    assert sources == []
    assert elapsed_s < 2.5, f"auto-detection took {elapsed_s:.1f} s off-cloud"

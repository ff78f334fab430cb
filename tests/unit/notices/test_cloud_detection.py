"""Issue 8, section 8: cloud detection sends nothing anywhere off a cloud.

``--notice auto`` (the default) first reads the DMI strings (faked here in a temporary
directory named by ``SPOTRUN_DMI_ROOT``) and the endpoint settings; it probes a metadata
server only for the cloud those facts name or the user named. What a process does with
sockets is observed from inside it (a Python audit hook, tests/support/socket_audit.py) and, where
strace works, from the kernel's side (every socket syscall of the whole process tree).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import pytest

from spotrun.drill.clouds.aws import FakeAws
from spotrun.drill.clouds.azure import FakeAzure
from spotrun.drill.clouds.gcp import FakeGcp
from spotrun.notices import DMI_ROOT_ENV, NoticeOptions, aws, azure, cloud_from_dmi, gcp, plan_detection, read_dmi
from tests.support.socket_audit import audited_env, read_audit, socket_events

#: Generous bound for one short `spotrun run` on a loaded machine, seconds.
RUN_TIMEOUT_S = 120
#: Generous bound for a metadata poll to arrive, seconds.
WAIT_S = 60

# DMI files as real machines show them (field -> text; fields left out do not exist).
AWS_NITRO = {
    "sys_vendor": "Amazon EC2",
    "product_name": "m5.large",
    "board_vendor": "Amazon EC2",
    "bios_vendor": "Amazon EC2",
    "bios_version": "1.0",
    "chassis_asset_tag": "Amazon EC2",
}
AWS_XEN = {
    "sys_vendor": "Xen",
    "product_name": "HVM domU",
    "product_version": "4.2.amazon",
    "bios_vendor": "Xen",
    "bios_version": "4.2.amazon",
    "chassis_asset_tag": "",
}
AWS_XEN_UUID_ONLY = {
    "sys_vendor": "Xen",
    "product_name": "HVM domU",
    "product_version": "4.11",
    "product_uuid": "EC2CEFAC-DCE1-EED5-4E48-83AD3EF51BFB",
    "product_serial": "ec2cefac-dce1-eed5-4e48-83ad3ef51bfb",
}
GCP = {
    "sys_vendor": "Google",
    "product_name": "Google Compute Engine",
    "board_vendor": "Google",
    "bios_vendor": "Google",
    "bios_version": "Google",
    "chassis_asset_tag": "",
}
GCP_SERIAL_ONLY = {"sys_vendor": "", "product_name": "", "product_serial": "GoogleCloud-5A2E1F0C9D8B7A6F"}
AZURE = {
    "sys_vendor": "Microsoft Corporation",
    "product_name": "Virtual Machine",
    "product_version": "7.0",
    "board_vendor": "Microsoft Corporation",
    "bios_vendor": "Microsoft Corporation",
    "bios_version": "Hyper-V UEFI Release v4.1",
    "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77",
}
HYPER_V_DESKTOP = {**AZURE, "chassis_asset_tag": "0291-4458-9427-1539-1703-8420-55"}
LAPTOP = {
    "sys_vendor": "LENOVO",
    "product_name": "20XW004GUS",
    "product_version": "ThinkPad X1 Carbon Gen 9",
    "board_vendor": "LENOVO",
    "bios_vendor": "LENOVO",
    "bios_version": "N32ET75W (1.51 )",
    "chassis_asset_tag": "No Asset Information",
}
KVM = {
    "sys_vendor": "QEMU",
    "product_name": "Standard PC (Q35 + ICH9, 2009)",
    "bios_vendor": "SeaBIOS",
    "bios_version": "1.16.2-debian-1.16.2-1",
    "chassis_asset_tag": "",
}

DEFAULT_URLS = {"aws": aws.DEFAULT_ENDPOINT, "gcp": "http://" + gcp.DEFAULT_HOST, "azure": azure.DEFAULT_ENDPOINT}
FAKES = {"aws": FakeAws, "gcp": FakeGcp, "azure": FakeAzure}


def write_dmi(root: pathlib.Path, fields: dict[str, str]) -> pathlib.Path:
    """A fake ``/sys/class/dmi/id``: one file per field, newline-terminated as the kernel writes them."""
    root.mkdir(parents=True)
    for name, text in fields.items():
        (root / name).write_text(text + "\n")
    return root


def clean_env(dmi_root: pathlib.Path) -> dict[str, str]:
    """This environment with no metadata endpoint set and DMI read from ``dmi_root``."""
    env = {k: v for k, v in os.environ.items() if k not in (aws.ENDPOINT_ENV, gcp.HOST_ENV)}
    env[DMI_ROOT_ENV] = str(dmi_root)
    return env


def _address(event) -> tuple:
    address = ast.literal_eval(event.args[-1])
    return tuple(address[:2]) if isinstance(address, tuple) else (address, None)


def targets(events) -> set[tuple]:
    """(host, port) of every DNS lookup, connect and send in ``events`` (binds aside)."""
    found = set()
    for e in events:
        if e.event == "socket.getaddrinfo":
            found.add((ast.literal_eval(e.args[0]), ast.literal_eval(e.args[1])))
        elif e.event in ("socket.connect", "socket.sendto"):
            found.add(_address(e))
        elif e.event not in ("socket.__new__", "socket.bind"):
            found.add((e.event, e.args))  # never expected here: shows up in a failure message
    return found


def bound(events) -> set[tuple]:
    """(host, port) of every bind in ``events``."""
    return {_address(e) for e in events if e.event == "socket.bind"}


def spotrun_run(checkpoint_uri: str, command: list[str], *options: str) -> list[str]:
    return [sys.executable, "-m", "spotrun", "run", "--checkpoint-uri", checkpoint_uri, *options, "--", *command]


# --- DMI facts, read from files, name the cloud -------------------------------------------------


@pytest.mark.parametrize(
    "fields, cloud",
    [
        pytest.param(AWS_NITRO, "aws", id="aws-nitro"),
        pytest.param(AWS_XEN, "aws", id="aws-xen"),
        pytest.param(AWS_XEN_UUID_ONLY, "aws", id="aws-xen-uuid-and-serial"),
        pytest.param(GCP, "gcp", id="gcp"),
        pytest.param(GCP_SERIAL_ONLY, "gcp", id="gcp-serial-only"),
        pytest.param(AZURE, "azure", id="azure"),
        pytest.param(HYPER_V_DESKTOP, None, id="hyper-v-desktop-is-not-azure"),
        pytest.param(LAPTOP, None, id="laptop"),
        pytest.param(KVM, None, id="kvm"),
        pytest.param(
            {**KVM, "product_uuid": "ec2aa5e6-0000-4000-8000-000000000001"},
            None,
            id="uuid-starting-ec2-alone-is-not-aws",
        ),
    ],
)
def test_8_dmi_facts_name_the_cloud(tmp_path, fields, cloud):
    facts = read_dmi(str(write_dmi(tmp_path / "dmi", fields)))
    assert facts.available
    assert cloud_from_dmi(facts) == cloud


def test_8_missing_or_unreadable_dmi_is_hidden(tmp_path):
    assert not read_dmi(str(tmp_path / "absent")).available
    unreadable = tmp_path / "unreadable"
    for name in ("sys_vendor", "product_name", "chassis_asset_tag"):
        (unreadable / name).mkdir(parents=True)  # exists, but reading it fails (EISDIR)
    facts = read_dmi(str(unreadable))
    assert not facts.available and cloud_from_dmi(facts) is None


@pytest.mark.parametrize(
    "fields, options, environ, expected",
    [
        pytest.param(LAPTOP, {}, {}, {}, id="laptop-nothing-set"),
        pytest.param(None, {}, {}, {}, id="dmi-hidden-nothing-set"),
        pytest.param(
            None,
            {},
            {"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9"},
            {"aws": "http://127.0.0.1:9"},
            id="dmi-hidden-aws-variable",
        ),
        pytest.param(
            LAPTOP, {}, {"GCE_METADATA_HOST": "127.0.0.1:9"}, {"gcp": "http://127.0.0.1:9"}, id="laptop-gcp-variable"
        ),
        pytest.param(
            LAPTOP,
            {"azure_endpoint": "http://127.0.0.1:9"},
            {},
            {"azure": "http://127.0.0.1:9"},
            id="laptop-azure-option",
        ),
        pytest.param(
            LAPTOP,
            {"aws_endpoint": "http://127.0.0.1:8"},
            {"AWS_EC2_METADATA_SERVICE_ENDPOINT": ""},
            {"aws": "http://127.0.0.1:8"},
            id="laptop-aws-option-empty-variable",
        ),
        pytest.param(
            AZURE,
            {"gcp_host": "127.0.0.1:9"},
            {},
            {"gcp": "http://127.0.0.1:9", "azure": DEFAULT_URLS["azure"]},
            id="azure-and-gcp-option",
        ),
        pytest.param(GCP, {}, {}, {"gcp": DEFAULT_URLS["gcp"]}, id="gcp"),
    ],
)
def test_8_candidates_are_the_dmi_cloud_and_the_named_endpoints(tmp_path, fields, options, environ, expected):
    root = write_dmi(tmp_path / "dmi", fields) if fields is not None else tmp_path / "absent"
    plan = plan_detection(NoticeOptions(dmi_root=str(root), **options), environ=environ)
    assert {cloud: url for cloud, (url, _why) in plan.probes.items()} == expected
    if not expected:
        assert "no metadata server probed" in plan.summary() and "--notice aws" in plan.summary()


# --- detection from DMI: no network traffic -------------------------------------------------------

_PLAN = """
import json
from spotrun.notices import NoticeOptions, plan_detection
plan = plan_detection(NoticeOptions())
print(json.dumps({"dmi_cloud": plan.dmi_cloud, "probes": {c: url for c, (url, _) in plan.probes.items()}}))
"""


@pytest.mark.parametrize("cloud, fields", [("aws", AWS_NITRO), ("gcp", GCP), ("azure", AZURE)])
def test_8_each_cloud_is_detected_from_dmi_with_no_network_traffic(tmp_path, cloud, fields):
    """``auto``'s decision, in a process whose every socket use is recorded: the cloud is
    named from the fake DMI files alone, and only that cloud's metadata server is a candidate."""
    env, audit = audited_env(tmp_path, clean_env(write_dmi(tmp_path / "dmi", fields)))
    result = subprocess.run(
        [sys.executable, "-c", _PLAN], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"dmi_cloud": cloud, "probes": {cloud: DEFAULT_URLS[cloud]}}
    events = read_audit(audit)
    assert [e.event for e in events] == ["hook-installed"]  # watched, and not one socket event


# --- off a cloud, `spotrun run` opens no socket but the checkpoint store's --------------------------


def _off_cloud_dmi(tmp_path: pathlib.Path, dmi: str) -> pathlib.Path:
    return write_dmi(tmp_path / "dmi", LAPTOP) if dmi == "generic" else tmp_path / "no-dmi"


@pytest.mark.parametrize("dmi", ["generic", "missing"])
def test_8_off_cloud_spotrun_run_opens_no_socket(tmp_path, dmi):
    """The default ``--notice auto`` with a local checkpoint root: no DNS query, no socket at all."""
    env, audit = audited_env(tmp_path, clean_env(_off_cloud_dmi(tmp_path, dmi)))
    result = subprocess.run(
        spotrun_run(str(tmp_path / "ck"), [shutil.which("true")]),
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert "--notice auto: " in result.stderr and "no metadata server probed" in result.stderr, result.stderr
    events = read_audit(audit)
    assert any(e.event == "hook-installed" for e in events)
    assert socket_events(events) == []


def test_8_off_cloud_spotrun_run_with_s3_talks_only_to_the_store(tmp_path, s3_bucket):
    """With an S3 checkpoint store, the store's address is the only one looked up or connected to."""
    env, audit = audited_env(tmp_path, clean_env(_off_cloud_dmi(tmp_path, "generic")))
    result = subprocess.run(
        spotrun_run(s3_bucket.uri, [shutil.which("true")]),
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    store = s3_bucket.endpoint_url.removeprefix("http://").split(":")
    events = socket_events(read_audit(audit))
    assert any(e.event == "socket.connect" for e in events)  # the preflight did reach the store
    assert targets(events) == {(store[0], int(store[1]))}
    # urllib3 (under boto3) checks IPv6 support by binding a socket to ::1 at import: no traffic
    assert {host for host, _port in bound(events)} <= {"::1", "127.0.0.1"}


def _strace_works() -> str | None:
    """Why strace cannot be used here, or None."""
    strace = shutil.which("strace")
    if strace is None:
        return "strace is not installed"
    probe = subprocess.run([strace, "-f", "-o", os.devnull, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"strace cannot trace here: {probe.stderr.strip()[:200]}"
    return None


_STRACE_PID = re.compile(r"^\d+\s+")


def _network_syscalls(trace: str) -> list[str]:
    """strace lines of socket syscalls that could reach another host: every socket() but
    AF_UNIX, every connect or addressed send to a non-AF_UNIX address, and any connect to
    nscd (libc's name-service cache, where host lookups go first)."""
    found = []
    for line in trace.splitlines():
        call = _STRACE_PID.sub("", line, count=1)  # "1102  socket(...)": pids are padded to 5
        if call.startswith("socket(") and not call.startswith("socket(AF_UNIX"):
            found.append(line)
        elif call.startswith("connect(") and ("sa_family=AF_UNIX" not in call or "nscd" in call):
            found.append(line)
        elif call.startswith(("sendto(", "sendmsg(")) and "sa_family=" in call and "sa_family=AF_UNIX" not in call:
            found.append(line)
    return found


@pytest.mark.parametrize("pid", ["123", "1102 ", "15957", "4194304"])
def test_8_strace_lines_are_read_whatever_the_pid_width(pid):
    """strace pads pids to 5 columns ("1102  socket(...)"): a 4-digit pid must not hide a call."""
    trace = (
        f"{pid} socket(AF_INET, SOCK_STREAM|SOCK_CLOEXEC, IPPROTO_IP) = 3\n"
        f"{pid} socket(AF_UNIX, SOCK_STREAM, 0) = 4\n"
        f"{pid} connect(3, {{sa_family=AF_INET, sin_port=htons(9)}}, 16) = -1 ECONNREFUSED\n"
    )
    assert len(_network_syscalls(trace)) == 2


@pytest.mark.parametrize("dmi", ["generic", "missing"])
def test_8_off_cloud_spotrun_run_makes_no_network_syscall(tmp_path, dmi):
    """The same run seen from the kernel's side: no socket syscall in the whole process tree."""
    why_not = _strace_works()
    if why_not:
        pytest.skip(why_not)
    trace_path = tmp_path / "strace.txt"
    command = [
        shutil.which("strace"),
        "-f",
        "-qq",
        "-e",
        "trace=socket,connect,sendto,sendmsg",
        "-o",
        str(trace_path),
        *spotrun_run(str(tmp_path / "ck"), [shutil.which("true")]),
    ]
    result = subprocess.run(
        command, env=clean_env(_off_cloud_dmi(tmp_path, dmi)), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert "no metadata server probed" in result.stderr, result.stderr
    assert _network_syscalls(trace_path.read_text()) == []


_CONNECT = "import socket, sys; socket.socket().connect_ex(('127.0.0.1', int(sys.argv[1])))"


def test_8_the_observers_see_a_connection_attempt(tmp_path):
    """Both observers used above do see a process that connects somewhere (to a closed
    loopback port here), so their silence in the tests above means something."""
    with socket_on_loopback() as port:
        env, audit = audited_env(tmp_path, dict(os.environ))
        subprocess.run([sys.executable, "-c", _CONNECT, str(port)], env=env, check=True, timeout=RUN_TIMEOUT_S)
        assert ("127.0.0.1", port) in targets(socket_events(read_audit(audit)))
        if _strace_works() is None:
            trace_path = tmp_path / "strace.txt"
            subprocess.run(
                [
                    shutil.which("strace"),
                    "-f",
                    "-qq",
                    "-e",
                    "trace=socket,connect,sendto,sendmsg",
                    "-o",
                    str(trace_path),
                    sys.executable,
                    "-c",
                    _CONNECT,
                    str(port),
                ],
                check=True,
                timeout=RUN_TIMEOUT_S,
            )
            flagged = _network_syscalls(trace_path.read_text())
            assert any(_STRACE_PID.sub("", line, count=1).startswith("socket(AF_INET") for line in flagged), flagged
            assert any(f"sin_port=htons({port})" in line for line in flagged), flagged


@contextlib.contextmanager
def socket_on_loopback():
    """A loopback port nobody listens on (bound, so no one else takes it, but not listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


# --- the user opts in: the named metadata server is probed/polled, and only it -----------------------


_OPT_IN = {
    "aws-named": ("aws", ["--notice", "aws"], aws.ENDPOINT_ENV),
    "aws-auto-env": ("aws", [], aws.ENDPOINT_ENV),
    "gcp-auto-env": ("gcp", [], gcp.HOST_ENV),
    "azure-auto-option": ("azure", ["--azure-metadata-endpoint"], None),
}
#: A request only the polling source makes (the probes ask other paths), per cloud.
_POLL_PATH = {"aws": FakeAws.INSTANCE_ACTION_PATH, "gcp": FakeGcp.MAINTENANCE_PATH, "azure": FakeAzure.EVENTS_PATH}


@pytest.mark.parametrize("case", list(_OPT_IN))
def test_8_named_source_is_probed_off_cloud_and_nothing_else(tmp_path, processes, case):
    """Off a cloud (generic DMI), naming the source or setting its endpoint makes spotrun
    contact that metadata server (a fake on 127.0.0.1), and no other address."""
    cloud, options, variable = _OPT_IN[case]
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    hold = os.open(fifo, os.O_RDWR)  # the command's read blocks until the test writes a byte
    try:
        with FAKES[cloud]() as fake:
            base = clean_env(_off_cloud_dmi(tmp_path, "generic"))
            if variable is not None:
                base[variable] = fake.url if cloud == "aws" else fake.host_port
            else:
                options = [*options, fake.url]
            env, audit = audited_env(tmp_path, base)
            log_path = tmp_path / "supervisor.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    spotrun_run(str(tmp_path / "ck"), ["head", "-c", "1", str(fifo)], *options),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            processes.append(proc)
            assert fake.wait_for(lambda: any(r.path == _POLL_PATH[cloud] for r in fake.requests), WAIT_S), (
                log_path.read_text()
            )
            os.write(hold, b"x")
            assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, log_path.read_text()
    finally:
        os.close(hold)
    text = log_path.read_text()
    if not options or options[0] != "--notice":
        assert f"--notice auto: probing {cloud} at {fake.url}" in text, text
        assert f"detected {cloud}: its metadata server answered" in text, text
    host, port = fake.host_port.split(":")
    events = socket_events(read_audit(audit))
    assert targets(events) == {(host, int(port))}
    assert bound(events) == set()

"""A real Ceph RADOS Gateway (S3) on 127.0.0.1 for tests: a second S3 implementation.

Fixtures (tests/conftest.py registers them: a test asks for them by name)::

    def test_something(rgw_bucket):
        storage = open_storage(rgw_bucket.uri)   # AWS_ENDPOINT_URL and keys point at RGW

* ``rgw_endpoint`` (session scope): makes sure Debian's ``radosgw``, ``ceph-mon`` and
  ``ceph-osd`` are installed (``apt-get update`` + ``apt-get install`` when they are
  missing; skips with the reason where that is not possible), starts a one-monitor,
  one-OSD Ceph cluster whose OSD keeps its objects in memory (``memstore``, capped at
  :data:`MEMSTORE_BYTES`) and ``radosgw`` on free loopback ports in a temporary
  directory, creates an S3 user with random keys, yields an :class:`RgwServer`, and stops
  the daemons (SIGTERM, then SIGKILL) at the end of the session. About 15 s to start.
* ``rgw_bucket`` (function scope): a fresh bucket on it, with the user's keys, region and
  ``AWS_ENDPOINT_URL`` set in the environment (restored after the test); yields an
  :class:`~tests.support.s3_server.S3Bucket`. Emptied and deleted afterwards.

Unlike moto, RGW checks credentials and signatures, caps ListObjectsV2 pages at 1,000
keys, sends error responses without message text and answers a multipart completion
with an empty ETag; and a ``CompleteMultipartUpload`` with ``If-None-Match: *`` onto an
existing key succeeds and overwrites it (a single ``PutObject`` with it is enforced).

Ceph Pacific (Debian 12) has no standalone gateway mode, hence the tiny cluster. Settings
that matter: messenger v2 only on 127.0.0.1, auth ``none``, pool size 1, and for the
gateway ``ms mon client mode = crc secure`` (without it radosgw retries its monitor
authentication forever). Every daemon runs in the foreground as a child of the test
process, and dies with it (``PR_SET_PDEATHSIG``) if the test process is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.s3_server import S3Bucket, empty_and_delete_bucket, free_loopback_port

#: Debian packages that provide the daemons and tools used here.
PACKAGES = ("radosgw", "ceph-mon", "ceph-osd")
#: Programs that must be on PATH (``ceph``, ``radosgw-admin`` and the tools come as dependencies).
PROGRAMS = ("radosgw", "ceph-mon", "ceph-osd", "ceph", "radosgw-admin", "monmaptool", "ceph-authtool")
#: Most bytes the OSD keeps in memory (all objects of the session).
MEMSTORE_BYTES = 1536 * 1024 * 1024
#: Bounds of the installation and of each start-up phase, in seconds (slow, loaded machines).
INSTALL_TIMEOUT_S = 900.0
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
REGION = "us-east-1"

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RgwServer:
    """A running gateway.

    Attributes:
        endpoint_url: ``http://127.0.0.1:PORT``.
        access_key_id, secret_access_key: the S3 user's keys (random per session).
        workdir: the cluster's directory (configuration, logs).
    """

    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    workdir: str

    def client(self):
        """A plain boto3 S3 client for this gateway, with the user's keys."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )


def _missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None]


def install_packages() -> str | None:
    """Install :data:`PACKAGES` with apt-get where a program is missing.

    Returns:
        ``None`` when every program is there (now), else why it could not be installed.
    """
    if not _missing_programs():
        return None
    if shutil.which("apt-get") is None:
        return f"{', '.join(_missing_programs())} missing and no apt-get to install {' '.join(PACKAGES)}"
    if os.geteuid() != 0:
        return f"{', '.join(_missing_programs())} missing; installing {' '.join(PACKAGES)} needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=INSTALL_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return f"{' '.join(command)} did not finish in {INSTALL_TIMEOUT_S:.0f} s"
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip()[-1500:]
            return f"{' '.join(command)} failed (exit {done.returncode}):\n{tail}"
    missing = _missing_programs()
    return f"still missing after installing {' '.join(PACKAGES)}: {', '.join(missing)}" if missing else None


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _config(workdir: str, fsid: str, mon_port: int, rgw_port: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
public addr = 127.0.0.1
ms bind ipv6 = false
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
run dir = {workdir}/run
admin socket = {workdir}/run/$name.asok
pid file = {workdir}/run/$name.pid
log file = {workdir}/log/$name.log
mon data = {workdir}/mon/$cluster-$id
osd data = {workdir}/osd/$cluster-$id
keyring = {workdir}/keyring
osd objectstore = memstore
memstore device bytes = {MEMSTORE_BYTES}
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 2000
osd crush chooseleaf type = 0
mon data avail warn = 1
mon data avail crit = 0
osd max object size = 1073741824
[client.rgw]
ms mon client mode = crc secure
ms client mode = crc secure
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw enable usage log = false
"""


class _Cluster:
    """The daemons of one cluster, started in order, stopped in reverse."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.conf = os.path.join(workdir, "ceph.conf")
        self.daemons: list[subprocess.Popen] = []

    def run(self, *command: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """Run one tool with the cluster's configuration; its stdout. Raises on failure."""
        done = subprocess.run(
            [command[0], "-c", self.conf, *command[1:]],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed (exit {done.returncode}): {(done.stdout + done.stderr).strip()[-1500:]}"
            )
        return done.stdout

    def start(self, name: str, *command: str) -> None:
        """Start a daemon in the foreground (``-f``); its output goes to ``log/NAME.out``."""
        with open(os.path.join(self.workdir, "log", f"{name}.out"), "ab") as out:
            self.daemons.append(
                subprocess.Popen(
                    [command[0], "-f", "-c", self.conf, *command[1:]],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent,
                )
            )

    def wait_until(self, what: str, ready) -> None:
        """Poll ``ready()`` until true; raise naming ``what`` if a daemon exits or time runs out."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pause_s = 0.1
        while not ready():
            exited = [p.args[0] for p in self.daemons if p.poll() is not None]
            if exited:
                raise RuntimeError(f"{', '.join(exited)} exited while waiting for {what}; logs in {self.workdir}/log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready in {START_TIMEOUT_S:.0f} s; logs in {self.workdir}/log")
            time.sleep(pause_s)  # polling a condition, not synchronising on time
            pause_s = min(pause_s * 2, 1.0)

    def stop(self) -> None:
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _osd_up(cluster: _Cluster) -> bool:
    try:
        stat = json.loads(cluster.run("ceph", "osd", "stat", "-f", "json", timeout_s=30))
    except (RuntimeError, ValueError, subprocess.TimeoutExpired):
        return False
    return int(stat.get("num_up_osds", 0)) >= 1


def _http_answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:  # any HTTP status means the gateway serves
        return True
    except OSError:
        return False


@contextlib.contextmanager
def rgw_server(workdir: str) -> Iterator[RgwServer]:
    """Start a cluster and gateway under ``workdir`` (an empty directory); yields the gateway.

    Raises:
        RuntimeError: a step failed or a daemon did not become ready; the message names
            it and where the logs are.
    """
    for sub in ("run", "log", "mon", "osd"):
        os.makedirs(os.path.join(workdir, sub), exist_ok=True)
    mon_port, rgw_port = free_loopback_port(), free_loopback_port()
    while rgw_port == mon_port:
        rgw_port = free_loopback_port()
    fsid = str(uuid.uuid4())
    cluster = _Cluster(workdir)
    with open(cluster.conf, "w") as f:
        f.write(_config(workdir, fsid, mon_port, rgw_port))
    try:
        subprocess.run(
            [
                "ceph-authtool",
                "--create-keyring",
                os.path.join(workdir, "keyring"),
                "--gen-key",
                "-n",
                "mon.",
                "--cap",
                "mon",
                "allow *",
            ],
            check=True,
            capture_output=True,
        )
        monmap = os.path.join(workdir, "monmap")
        subprocess.run(
            ["monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", "--fsid", fsid, monmap],
            check=True,
            capture_output=True,
        )
        cluster.run("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap)
        cluster.start("mon", "ceph-mon", "-i", "a")
        osd_uuid = str(uuid.uuid4())
        osd_id = cluster.run("ceph", "osd", "new", osd_uuid).strip()
        os.makedirs(os.path.join(workdir, "osd", f"ceph-{osd_id}"), exist_ok=True)
        cluster.run("ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        cluster.start("osd", "ceph-osd", "-i", osd_id)
        cluster.wait_until("the OSD", lambda: _osd_up(cluster))
        cluster.start("rgw", "radosgw", "-n", "client.rgw")
        endpoint_url = f"http://127.0.0.1:{rgw_port}"
        cluster.wait_until("radosgw", lambda: _http_answers(endpoint_url))
        access_key, secret_key = f"spotrun{secrets.token_hex(8)}", secrets.token_hex(20)
        cluster.run(
            "radosgw-admin",
            "user",
            "create",
            "--uid=spotrun-test",
            "--display-name=spotrun test",
            f"--access-key={access_key}",
            f"--secret={secret_key}",
        )
        yield RgwServer(endpoint_url, access_key, secret_key, workdir)
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def rgw_endpoint() -> Iterator[RgwServer]:
    """A Ceph RADOS Gateway shared by the whole session (installed first if need be)."""
    reason = install_packages()
    if reason is not None:
        pytest.skip(f"Ceph RADOS Gateway not available: {reason}")
    workdir = tempfile.mkdtemp(prefix="spotrun-rgw-")
    try:
        with rgw_server(workdir) as server:
            yield server
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def set_rgw_env(monkeypatch: pytest.MonkeyPatch, server: RgwServer) -> None:
    """Point boto3 (here and in child processes) at the gateway with the user's keys."""
    from tests.support.s3_server import set_fake_aws_env

    set_fake_aws_env(monkeypatch, server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_access_key)


@pytest.fixture
def rgw_bucket(rgw_endpoint: RgwServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket on the gateway; the AWS environment points at it with the user's keys."""
    set_rgw_env(monkeypatch, rgw_endpoint)
    client = rgw_endpoint.client()
    name = f"spotrun-test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    yield S3Bucket(name=name, endpoint_url=rgw_endpoint.endpoint_url)
    empty_and_delete_bucket(client, name)

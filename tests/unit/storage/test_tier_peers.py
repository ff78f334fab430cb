"""The fast tiers of a job's nodes talk to each other (issue 24): a real tier server on loopback
serves listings, byte ranges and replicas only to peers that prove the job's secret; a
malformed frame or a stranger is refused and logged and the server keeps serving; a peer that
stops answering costs one timeout, never a hang; :class:`JobTier` reads every node's keys as
one store."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from spotrun.errors import ObjectNotFoundError, StorageError
from spotrun.storage import tier_protocol as wire
from spotrun.storage.local import LocalStorage
from spotrun.storage.tier_holdings import NodeHoldings
from spotrun.storage.tier_peers import JobTier, Peer, PeerClient, PeerError, RateLimit
from spotrun.storage.tier_server import TierServer

SECRET = b"s" * 32


def make_tier(tmp_path, name: str) -> str:
    path = tmp_path / name
    (path / "steps").mkdir(parents=True)
    return str(path)


@pytest.fixture
def served(tmp_path):
    """A tier directory with one step's files, served on loopback."""
    tier = make_tier(tmp_path, "node0")
    own = LocalStorage(os.path.join(tier, "steps"))
    own.put("step-000000026/rank-00000.i000000001.safetensors", bytes(range(256)) * 64)
    own.put("step-000000026/manifest.i000000001.json", b"{}")
    server = TierServer(tier, SECRET, "127.0.0.1", 0, timeout_s=5).start()
    yield tier, server
    server.close()


def peer_of(server: TierServer, secret: bytes = SECRET) -> Peer:
    host, port = server.address
    return Peer("node0", host, port, secret)


def test_a_peer_with_the_secret_lists_reads_and_deletes_byte_ranges(served):
    tier, server = served
    client = PeerClient(peer_of(server), "node1", timeout_s=5)
    keys = [info.key for info in client.list("step-000000026/")]
    assert keys == ["step-000000026/manifest.i000000001.json", "step-000000026/rank-00000.i000000001.safetensors"]
    out = bytearray(300)
    client.read_into("step-000000026/rank-00000.i000000001.safetensors", 1000, memoryview(out))
    assert bytes(out) == (bytes(range(256)) * 64)[1000:1300]
    with pytest.raises(ObjectNotFoundError):
        client.stat("step-000000026/rank-00001.i000000001.safetensors")
    client.delete("step-000000026/manifest.i000000001.json")
    assert not os.path.exists(os.path.join(tier, "steps/step-000000026/manifest.i000000001.json"))
    client.close()


def test_a_peer_asks_whether_the_node_is_being_preempted_itself(served):
    """A node under notice says so, so that no other node counts on a replica held there."""
    _, server = served
    client = PeerClient(peer_of(server), "node1", timeout_s=5)
    assert client.leaving() is False
    server.leaving = True
    assert client.leaving() is True
    client.close()


def test_a_replica_lands_under_its_source_node_and_only_the_two_newest_steps_are_kept(served, tmp_path):
    tier, server = served
    client = PeerClient(peer_of(server), "node1", timeout_s=5)
    source = tmp_path / "shard"
    source.write_bytes(b"x" * 3_000_000)
    for step in (20, 22, 24):
        assert client.put_file("node1", f"step-{step:09d}/rank-00001.i000000001.safetensors", str(source)) == 3_000_000
        client.replica_done("node1")
    held = NodeHoldings(tier)
    assert held.replica_nodes() == ["node1"]
    steps = sorted({info.key.split("/")[0] for info in held.replica_root("node1").list("")})
    assert steps == ["step-000000022", "step-000000024"]
    assert held.stat("step-000000024/rank-00001.i000000001.safetensors").size_bytes == 3_000_000


def test_a_connection_without_the_secret_is_refused_and_logged(served, caplog):
    _tier, server = served
    client = PeerClient(peer_of(server, secret=b"w" * 32), "stranger", timeout_s=5)
    with pytest.raises(PeerError, match="secret"):
        client.list("")
    deadline = time.monotonic() + 10
    while server.refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.refused == 1
    # the job's own peers are still served
    assert PeerClient(peer_of(server), "node1", timeout_s=5).list("")


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack(">I", 2**31) + b"{",  # a header over the limit
        struct.pack(">I", 5) + b"nope!",  # not JSON
        struct.pack(">I", 2) + b"[]",  # not an object
    ],
    ids=["oversized-header", "not-json", "not-an-object"],
)
def test_a_malformed_frame_is_refused_and_the_server_keeps_serving(served, frame):
    _tier, server = served
    host, port = server.address
    with socket.create_connection((host, port), timeout=5) as raw:
        wire.client_handshake(raw, SECRET, "node1")
        raw.sendall(frame)
        try:
            dropped = raw.recv(1) == b""
        except ConnectionResetError:  # closed with the rest of the frame unread
            dropped = True
        assert dropped
    assert server.refused == 1
    assert PeerClient(peer_of(server), "node1", timeout_s=5).list("")


def test_a_replica_outside_a_step_or_the_tier_is_refused(served, tmp_path):
    tier, server = served
    source = tmp_path / "evil"
    source.write_bytes(b"evil")
    client = PeerClient(peer_of(server), "node1", timeout_s=5)
    refused = [("node1", "../../escape"), ("node1", "incarnations/x.json"), ("../up", "step-000000001/a")]
    for source_node, key in refused:
        with pytest.raises(StorageError):
            client.put_file(source_node, key, str(source))
    assert not (tmp_path / "escape").exists()
    assert NodeHoldings(tier).replica_nodes() == []


def test_a_peer_that_stops_answering_costs_one_timeout_and_the_next_holder_serves(served, tmp_path):
    tier, server = served
    # a second node holding the same key, served from a process that is then stopped
    code = (
        "import sys, time\n"
        "from spotrun.storage.tier_server import TierServer\n"
        f"s = TierServer({tier!r}, {SECRET!r}, '127.0.0.1', 0, timeout_s=5).start()\n"
        "print(s.address[1], flush=True)\n"
        "time.sleep(600)\n"
    )
    stopped = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(stopped.stdout.readline())
        os.kill(stopped.pid, signal.SIGSTOP)
        own = make_tier(tmp_path, "node2")
        host, good_port = server.address
        peers = [Peer("stopped", "127.0.0.1", port, SECRET), Peer("node0", host, good_port, SECRET)]
        job = JobTier(own, peers, "node2", 1.0)
        started = time.monotonic()
        keys = [info.key for info in job.list("step-000000026/")]
        out = bytearray(16)
        job.read_into("step-000000026/rank-00000.i000000001.safetensors", 0, [memoryview(out)])
        job.read_into("step-000000026/rank-00000.i000000001.safetensors", 16, [memoryview(out)])
        elapsed = time.monotonic() - started
    finally:
        stopped.kill()
        stopped.wait()
    assert "step-000000026/rank-00000.i000000001.safetensors" in keys
    assert bytes(out) == bytes(range(16, 32))
    assert job.read_from == {"node0"}
    assert elapsed < 30  # one timeout of 1 s for the stopped peer, not one per request


def test_the_job_tier_writes_here_and_reads_every_nodes_keys(served, tmp_path):
    _tier, server = served
    own = make_tier(tmp_path, "node1")
    job = JobTier(own, [peer_of(server)], "node1", 5.0)
    job.put("step-000000026/rank-00001.i000000001.safetensors", b"mine")
    assert os.path.exists(os.path.join(own, "steps/step-000000026/rank-00001.i000000001.safetensors"))
    keys = [info.key for info in job.list("step-000000026/")]
    assert keys == [
        "step-000000026/manifest.i000000001.json",
        "step-000000026/rank-00000.i000000001.safetensors",
        "step-000000026/rank-00001.i000000001.safetensors",
    ]
    assert job.holders("step-000000026/rank-00000.i000000001.safetensors") == 1
    assert job.get("step-000000026/manifest.i000000001.json") == b"{}"
    assert job.peer_bytes_read == 2
    job.delete("step-000000026/manifest.i000000001.json")
    with pytest.raises(ObjectNotFoundError):
        job.stat("step-000000026/manifest.i000000001.json")


def test_the_rate_limit_spaces_its_bytes():
    rate = RateLimit(1_000_000)
    started = time.monotonic()
    for _ in range(5):
        rate.take(100_000)
    assert time.monotonic() - started >= 0.39  # the first piece goes at once, the four others wait 0.1 s each


def test_the_handshake_refuses_another_protocol_version(served):
    _tier, server = served
    host, port = server.address
    with socket.create_connection((host, port), timeout=5) as raw:
        opening = wire.recv_header(raw)
        wire.send_frame(raw, {"mac": wire.mac(SECRET, bytes.fromhex(opening["challenge"])), "version": 99})
        answer = wire.recv_header(raw)
        assert answer.get("ok") is False
    assert json.dumps(answer)


HANGING_SERVER = """
import sys, time
from spotrun.storage.tier_server import TierServer

class StopsMidRead(TierServer):
    def _answer(self, conn, request, node):
        if request.get("op") == "read":  # answers listings, then never the bytes
            time.sleep(3600)
        super()._answer(conn, request, node)

server = StopsMidRead(sys.argv[1], bytes.fromhex(sys.argv[2]), "127.0.0.1", 0, timeout_s=600).start()
print(server.address[1], flush=True)
time.sleep(3600)
"""


def test_a_restore_whose_peer_stops_answering_mid_read_falls_back_to_storage_within_the_timeout(tmp_path, caplog):
    import logging

    import torch

    import spotrun
    from spotrun.checkpoint.restore import load_newest

    w = torch.zeros(4)
    ckpt = spotrun.Checkpointer(
        {"params": {"w": w}},
        uri=str(tmp_path / "store"),
        handle_signals=False,
        background_saves=False,
        interval_steps=4,
        memory_interval_steps=2,
        memory_dir=str(tmp_path / "peer" / "steps"),  # the other node's tier: storage 4, memory 4 and 6
    )
    for step in range(1, 7):
        w.fill_(step)
        ckpt.end_of_step(step)
        ckpt._tier.report_ended()
    ckpt.close()
    server = subprocess.Popen(
        [sys.executable, "-c", HANGING_SERVER, str(tmp_path / "peer"), SECRET.hex()], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        job = JobTier(make_tier(tmp_path, "own"), [Peer("peer", "127.0.0.1", port, SECRET)], "own", 1.0)
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="spotrun"):
            loaded = load_newest(LocalStorage(str(tmp_path / "store")), supervisor_step=None, fast_tier=job)
        elapsed = time.monotonic() - started
    finally:
        server.kill()
        server.wait()
    assert (loaded.manifest.step, loaded.tier) == (4, "storage")
    assert "the fast tier of node peer (127.0.0.1:" in caplog.text and "is left out for 60 s" in caplog.text
    assert elapsed < 20  # one timeout of 1 s, not a hang


def test_a_peer_never_reads_or_deletes_outside_the_tiers_steps(served, tmp_path):
    tier, server = served
    secret_file = os.path.join(tier, "secret")
    with open(secret_file, "w") as file:
        file.write("the server's own files, beside steps/")
    (tmp_path / "outside").write_bytes(b"not the tier's")
    client = PeerClient(peer_of(server), "node1", timeout_s=5)
    for key in ("../secret", "../../outside", "/etc/passwd", "step-000000026/../../secret"):
        with pytest.raises(StorageError):
            client.read_into(key, 0, memoryview(bytearray(4)))
        with pytest.raises(StorageError):
            client.delete(key)
    assert os.path.exists(secret_file) and (tmp_path / "outside").exists()
    assert client.list("")  # the connection and the server are fine


def drip(server: TierServer) -> socket.socket:
    """A stranger that announces a long hello and sends it a byte at a time, as slowly as it may."""
    conn = socket.create_connection(server.address, timeout=10)
    try:
        wire.recv_header(conn)  # the server's challenge
        conn.sendall(struct.pack(">I", 60_000) + b"{")
    except ConnectionError:
        pass  # refused at once
    return conn


def test_a_stranger_that_sends_a_byte_at_a_time_is_dropped_and_cannot_take_every_connection(
    served, monkeypatch, caplog
):
    tier, server = served
    monkeypatch.setattr("spotrun.storage.tier_server.HANDSHAKE_TIMEOUT_S", 1.0)
    drippers = [drip(server) for _ in range(20)]  # more than one address may hold in handshakes
    started = time.monotonic()
    for _ in range(4):  # a byte now and then: each recv alone would stay within the timeout
        for conn in drippers:
            try:
                conn.sendall(b" ")
            except OSError:
                pass
        time.sleep(0.4)
    # every dripper was closed by the server: at once over the per-address bound, the others at
    # the handshake's deadline, however often they sent a byte
    for conn in drippers:
        conn.settimeout(5)
        try:
            assert conn.recv(1 << 16) == b""
        except ConnectionResetError:
            pass
        conn.close()
    assert server.refused >= 20, caplog.text
    assert "handshakes from it under way" in caplog.text
    assert "refused: no handshake within 1.0 s" in caplog.text
    assert time.monotonic() - started < 20
    client = PeerClient(peer_of(server), "node1", timeout_s=5)  # the job's peers are served again
    assert client.list("step-000000026/")
    client.close()

"""Where each node's fast-tier replicas go: the next nodes in rank order, other failure domains
first, and always R + 1 distinct holders, so that any R lost nodes (or one lost domain, where the
job spans two) leave a copy of every node's step."""

from __future__ import annotations

import itertools

import pytest

from spotrun.storage.tier_peers import Peer
from spotrun.supervisor.tier_replicas import replica_targets


def nodes(*domains: str | None) -> list[Peer]:
    return [Peer(f"n{i}", "127.0.0.1", 9000 + i, b"s" * 32, domain) for i, domain in enumerate(domains)]


def targets(job: list[Peer], node: int, replicas: int) -> list[str]:
    return [peer.node for peer in replica_targets(job[node].node, job, replicas)]


def test_without_domains_the_next_nodes_in_rank_order_hold_a_nodes_step():
    job = nodes(None, None, None, None)
    assert [targets(job, n, 1) for n in range(4)] == [["n1"], ["n2"], ["n3"], ["n0"]]
    assert targets(job, 2, 2) == ["n3", "n0"]
    assert targets(job, 0, 9) == ["n1", "n2", "n3"]  # more replicas than other nodes: every other node
    assert targets(job, 0, 0) == []
    assert replica_targets("gone", job, 1) == []  # a node the workers did not name holds nothing


def test_replicas_go_to_another_failure_domain_first_and_even_domains_share_the_load():
    job = nodes("zone-a", "zone-a", "zone-b", "zone-b")  # the ring: n0 n2 n1 n3
    assert [targets(job, n, 1) for n in range(4)] == [["n2"], ["n3"], ["n1"], ["n0"]]
    assert targets(job, 1, 2) == ["n3", "n2"]
    assert targets(job, 0, 3) == ["n2", "n3", "n1"]  # its own domain only when no other is left
    single = nodes("zone-a", "zone-a", "zone-a")
    assert targets(single, 0, 1) == ["n1"]  # one domain: rank order, as without labels
    uneven = nodes("zone-a", "zone-a", "zone-a", "zone-b")  # safety first: zone b holds more
    assert all(peer.domain == "zone-b" for n in range(3) for peer in replica_targets(f"n{n}", uneven, 1))


@pytest.mark.parametrize("domains", [("a", "a", "b", "b"), ("a", "b", "c", "a", "b", "c"), (None,) * 4])
@pytest.mark.parametrize("replicas", [1, 2])
def test_with_even_domains_every_node_holds_r_replicas(domains, replicas):
    job = nodes(*domains)
    held = [name for i in range(len(job)) for name in targets(job, i, replicas)]
    assert sorted(held) == sorted(p.node for p in job for _ in range(replicas))


@pytest.mark.parametrize(
    "domains", [(None,) * 5, ("a", "a", "b", "b", "c"), ("a", "b", "a", "b", "a"), ("a", None, "a", None, "a")]
)
@pytest.mark.parametrize("replicas", [1, 2])
def test_the_loss_of_any_r_nodes_leaves_a_copy_of_every_nodes_step(domains, replicas):
    job = nodes(*domains)
    holders = {peer.node: {peer.node, *targets(job, i, replicas)} for i, peer in enumerate(job)}
    assert all(len(held) == replicas + 1 for held in holders.values())
    for lost in itertools.combinations([p.node for p in job], replicas):
        assert all(held - set(lost) for held in holders.values()), lost


@pytest.mark.parametrize("domains", [("a", "a", "b", "b"), ("a", "b", "a", "b", "c", "c")])
def test_the_loss_of_one_domain_leaves_a_copy_where_the_job_spans_two(domains):
    job = nodes(*domains)
    holders = {peer.node: {peer.node, *targets(job, i, 1)} for i, peer in enumerate(job)}
    for zone in set(domains):
        lost = {p.node for p in job if p.domain == zone}
        assert all(held - lost for held in holders.values()), zone


def test_a_peers_domain_travels_with_its_address():
    peer = Peer("n0", "10.0.0.1", 7000, b"k" * 32, "zone-a")
    assert Peer.from_json(peer.to_json()) == peer
    plain = Peer("n1", "10.0.0.2", 7000, b"k" * 32)
    assert "domain" not in plain.to_json() and Peer.from_json(plain.to_json()) == plain


def test_a_workers_failure_domain_reaches_its_supervisors_placement(tmp_path):
    """The label given to `spotrun run` goes to the workers, which gather it with the node's address
    and write it into the peers file that the supervisor places replicas from."""
    from spotrun.control.env import WorkerEnv
    from spotrun.supervisor.tier_replicas import _read_peers
    from spotrun.train.tier_nodes import job_nodes, write_peers_file

    secret_file = tmp_path / "secret"
    secret_file.write_text((b"k" * 32).hex())
    env = WorkerEnv(
        checkpoint_uri=None,
        resume_step=None,
        control_dir=None,
        run_id=None,
        incarnation=0,
        memory_node="n0",
        memory_peer_address="127.0.0.1:9000",
        memory_secret_file=str(secret_file),
        memory_failure_domain="zone-a",
    )
    job = job_nodes(env, wanted=True, interval_steps=2)  # one process: the job's only node
    write_peers_file(str(tmp_path), job)
    peers, _replicas = _read_peers(str(tmp_path))
    assert [(p.node, p.domain) for p in peers] == [("n0", "zone-a")]


@pytest.mark.parametrize("kind", ["missing", "short", "directory", "fifo-without-writer"])
def test_a_secret_file_that_cannot_serve_is_a_clear_error_at_once(tmp_path, kind):
    import os
    import time

    from spotrun.errors import ConfigError
    from spotrun.supervisor.tier_replicas import read_secret

    path = tmp_path / "secret"
    if kind == "short":
        path.write_text("12345")
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo-without-writer":
        os.mkfifo(path)  # an open() for reading would wait for a writer forever
    started = time.monotonic()
    with pytest.raises(ConfigError, match="the fast tier's secret file"):
        read_secret(str(path))
    assert time.monotonic() - started < 5
    path_ok = tmp_path / "good"
    path_ok.write_text("k" * 32)
    assert read_secret(str(path_ok)) == b"k" * 32

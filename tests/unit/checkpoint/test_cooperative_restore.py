"""Issue 26, point 3: ranks that need the same bytes read them from storage once per group and
share them over the process group (real torchrun and gloo, tests/jobs/coop_job.py).

On S3 (a real moto server) every restoring rank talks to S3 through a proxy of its own
(tests/support/fault_proxy.py), which counts the bytes it relays apart from spotrun's own
``restore_bytes_read``. The bounds, from the saved files (listed straight from moto) and the
manifest, never from the reader:

* 4 DDP ranks restoring the step they saved: each rank reads only its own data file and its own
  index (the save spread the replicated tensors over the ranks by bytes, and each reads what it
  wrote), so the data bytes summed over the ranks are at most the step's data files, each header
  counted twice (read once to be checked, then again with the first block): the replicated state
  once, plus the ranks' own state (RNGs) and the headers, which the test states and bounds
  (:data:`OWN_AND_HEADER_BOUND_BYTES` per rank). Read by every rank
  alone, as before, the sum would be 4 times the replicated state. The manifest is read once in
  total (by rank 0's listing). Every replicated byte a rank did not read it received from a
  peer: the received bytes sum to 3 times the replicated state.
* HSDP on a 2 x 2 mesh (replicated over mesh dimension 0): each box is needed by the two ranks of
  its replica group and read by one of them, each plain tensor by one rank of the four, so again
  each data file is read at most once in total; restored on 2 ranks (another world size) the
  same holds, and the state is bit-exact.

On a local root: a corrupt block in one reader's share makes every rank fall back together,
and a rank whose objects refuse the step stops every rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib

import pytest

from spotrun.checkpoint import catalog
from spotrun.storage import open_storage
from tests.support.fault_proxy import FaultProxy
from tests.support.paths import JOBS
from tests.support.rank_reports import run_ranks
from tests.support.s3_server import make_client
from tests.support.step_edits import edit_chunk_bytes, index_path

pytestmark = pytest.mark.slow

WORKER = JOBS / "coop_job.py"
#: Layers width -> 2*width -> width with biases: weights of 2 * WIDTH**2 float32 (4.5 MiB each),
#: so the replicated state (weights, biases, AdamW's two moments) is about 27 MiB.
WIDTH = 768
RANKS = 4
#: Bytes of a data file besides the replicated tensors it holds: the safetensors header (a few
#: hundred bytes per tensor) and the rank's own state (the Python, NumPy and torch RNG states,
#: about 8 KiB together).
OWN_AND_HEADER_BOUND_BYTES = 32 * 1024
TORCHRUN_TIMEOUT_S = 300
ITEMSIZE = {"float32": 4, "int64": 8, "uint8": 1, "uint32": 4, "int32": 4, "float64": 8}


def torchrun(ranks: int, mode: str, uri: str, out_dir: pathlib.Path, *args: str, env=None) -> tuple[list[dict], str]:
    """Run the worker on ``ranks`` ranks: each rank's report, by rank, and torchrun's output."""
    args = ["--mode", mode, "--uri", uri, "--out-dir", str(out_dir), *args]
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    return run_ranks(ranks, WORKER, args, out_dir, env, timeout_s=TORCHRUN_TIMEOUT_S)


def saved_step(bucket, step: int) -> tuple[dict[str, int], dict, dict[str, int]]:
    """Straight from moto: the step's objects' sizes by name, its manifest (JSON), and the
    header bytes of each data file (everything before its first chunk, by the writers' indexes:
    a reader reads them once to check them, then whole blocks, the first of which holds them)."""
    client = make_client(bucket.endpoint_url)
    prefix = f"job/step-{step:09d}/"
    listing = client.list_objects_v2(Bucket=bucket.name, Prefix=prefix)["Contents"]
    sizes = {o["Key"][len(prefix) :]: o["Size"] for o in listing}

    def read(name: str) -> dict:
        return json.loads(client.get_object(Bucket=bucket.name, Key=prefix + name)["Body"].read())

    [manifest_name] = [n for n in sizes if n.startswith("manifest.")]
    headers: dict[str, int] = {}
    for name in sizes:
        if name.endswith(".index.json"):
            index = read(name)
            for file_index, begin, _end in index["chunks"].values():
                path = index["files"][file_index]["path"]
                headers[path] = min(begin, headers.get(path, begin))
    return sizes, read(manifest_name), headers


def tensor_bytes(manifest: dict, replicated: bool) -> int:
    """Bytes of the manifest's tensors: the replicated state's, or the ranks' own."""
    total = 0
    for name, record in manifest["tensors"].items():
        if name.startswith("rank-") != replicated:
            elements = 1
            for d in record["shape"]:
                elements *= d
            total += elements * ITEMSIZE[record["dtype"]]
    return total


def counted(proxy: FaultProxy) -> dict[str, dict[str, int]]:
    """What one rank's proxy relayed to it: body bytes of each object it GOT, by kind."""
    answers = proxy.relayed()
    assert {a.status for a in answers} <= {200, 206}, answers
    found: dict[str, dict[str, int]] = {"data": {}, "index": {}, "manifest": {}}
    for a in answers:
        if a.method != "GET" or "/step-" not in a.path:
            continue
        name = a.path.split("?")[0].rsplit("/", 1)[-1]
        kind = "data" if name.endswith(".safetensors") else "index" if name.endswith(".index.json") else "manifest"
        found[kind][name] = found[kind].get(name, 0) + a.body_bytes
    return found


def restore_through_proxies(bucket, uri: str, ranks: int, out_dir: pathlib.Path, *args: str):
    """Restore on ``ranks`` ranks, each through a counting proxy of its own: reports and counts."""
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(bucket.endpoint_url)) for _ in range(ranks)]
        env = {"SPOTRUN_TEST_RANK_ENDPOINTS": ",".join(p.url for p in proxies)}
        reports, output = torchrun(ranks, "restore", uri, out_dir, *args, env=env)
        return reports, [counted(p) for p in proxies], output


def test_4_ddp_ranks_restoring_from_s3_read_the_replicated_state_once_in_total(s3_bucket, tmp_path):
    """Issue 26, acceptance: 4 DDP ranks restoring from S3 read the replicated state from
    storage once in total (within the stated overhead), bit-exact, and train on exactly as the
    uninterrupted run did."""
    uri = f"{s3_bucket.uri}/job"
    layout = ("--layout", "ddp", "--width", str(WIDTH))
    saved, _ = torchrun(RANKS, "save", uri, tmp_path / "save", *layout, "--steps", "1", "--continue", "2")
    sizes, manifest, headers = saved_step(s3_bucket, 1)
    replicated = tensor_bytes(manifest, replicated=True)
    data_files = {n: s for n, s in sizes.items() if n.endswith(".safetensors")}
    reports, counts, output = restore_through_proxies(
        s3_bucket, uri, RANKS, tmp_path / "restore", *layout, "--continue", "2"
    )

    print(f"\nreplicated state {replicated} B; data files {sum(data_files.values())} B")
    print("rank   data B     index B   manifest B   received B   restore_bytes_read")
    for rank, (report, count) in enumerate(zip(reports, counts)):
        data, index = sum(count["data"].values()), sum(count["index"].values())
        print(
            f"{rank:4d}   {data:8d}   {index:7d}   {sum(count['manifest'].values()):10d}   "
            f"{report['restore_bytes_received']:10d}   {report['restore_bytes_read']}"
        )
        assert report["restored"] == 1 and report["error"] is None
        assert report["tensors"] == saved[rank]["tensors"]  # bit-exact, every parameter and AdamW tensor
        assert report["losses"] == saved[rank]["losses"]  # and the training goes on as if never stopped
        own = f"rank-{rank:05d}."
        assert all(name.startswith(own) for name in count["data"]), count["data"]
        assert data <= sum(size + headers[name] for name, size in data_files.items() if name.startswith(own))
        assert list(count["index"]) == [n for n in sizes if n.startswith(own) and n.endswith(".index.json")]
        assert index == sizes[next(iter(count["index"]))]  # one index GET per rank: its own
        assert report["restore_bytes_read"] == data + index  # spotrun's count: the same bodies

    total_data = sum(sum(c["data"].values()) for c in counts)
    files_once = sum(data_files.values()) + sum(headers.values())
    assert replicated <= total_data <= files_once <= replicated + RANKS * OWN_AND_HEADER_BOUND_BYTES
    assert sum(r["restore_bytes_received"] for r in reports) == (RANKS - 1) * replicated
    manifest_reads = [sum(c["manifest"].values()) for c in counts]
    assert (
        manifest_reads[1:] == [0] * (RANKS - 1)
        and manifest_reads[0] == sizes[next(n for n in sizes if n.startswith("manifest."))]
    )
    assert f"{RANKS} rank(s) read {sum(r['restore_bytes_read'] for r in reports)} bytes from storage" in output


def received_bound(manifest: dict, ranks: int) -> int:
    """The bytes ``ranks`` HSDP ranks receive in total when each box is read once by one of the
    ranks that hold it: a DTensor's box (a tensor saved in several chunks) is held by the 2
    ranks of its replica group (mesh dimension 0 has size 2 at any world size), a plain tensor
    (AdamW's step counters) by every rank; all holders but the reader receive it."""
    total = 0
    for name, record in manifest["tensors"].items():
        if name.startswith("rank-"):
            continue
        cells = len(record["chunks"]) if "chunks" in record else math.prod(record["grid"])
        holders = 2 if cells > 1 else ranks
        total += math.prod(record["shape"]) * ITEMSIZE[record["dtype"]] * (holders - 1)
    return total


def test_hsdp_ranks_read_each_box_once_per_replica_group_at_4_and_at_2_ranks(s3_bucket, tmp_path):
    """Issue 26, point 3: on a 2 x 2 HSDP mesh the two ranks of a replica group read each of
    their boxes once between them (so each data file is read at most once in total), and
    restored on 2 ranks (another world size: each holds every tensor whole) the same holds,
    bit-exact both times."""
    uri = f"{s3_bucket.uri}/job"
    layout = ("--layout", "hsdp", "--width", str(WIDTH))
    saved, _ = torchrun(RANKS, "save", uri, tmp_path / "save", *layout, "--steps", "1")
    sizes, manifest, headers = saved_step(s3_bucket, 1)
    data_files = {n: s for n, s in sizes.items() if n.endswith(".safetensors")}
    for ranks in (RANKS, 2):
        reports, counts, _ = restore_through_proxies(s3_bucket, uri, ranks, tmp_path / f"restore-{ranks}", *layout)
        print(f"\nrestored on {ranks} ranks: data files {sum(data_files.values())} B")
        print("rank   data B     index B   received B")
        for rank, (report, count) in enumerate(zip(reports, counts)):
            data, index = sum(count["data"].values()), sum(count["index"].values())
            print(f"{rank:4d}   {data:8d}   {index:7d}   {report['restore_bytes_received']:10d}")
            assert report["restored"] == 1 and report["error"] is None
            assert report["tensors"] == saved[0]["tensors"]  # every tensor gathered to full: bit-exact
            assert report["restore_bytes_read"] == data + index
        for name, size in data_files.items():  # each file: at most once, its header twice
            assert sum(c["data"].get(name, 0) for c in counts) <= size + headers[name], name
        assert sum(r["restore_bytes_received"] for r in reports) == received_bound(manifest, ranks)
        assert sum(sum(c["manifest"].values()) for c in counts) == sizes[next(n for n in sizes if "manifest." in n)]


def local_statuses(root: pathlib.Path) -> dict[int, str]:
    return {s.step: s.status for s in catalog.list_steps(open_storage(str(root)))}


def test_a_corrupt_block_in_one_readers_share_makes_every_rank_fall_back_together(tmp_path):
    """Issue 26, point 3: a block of rank 2's file no longer matches its checksum; rank 2 reads
    it for all four ranks, finds it before anything is sent, and every rank falls back to step 1
    together (bit-exact); the log names rank 2 alone, and step 2 is un-committed."""
    root = tmp_path / "ck"
    layout = ("--layout", "ddp", "--width", "128")
    step1, _ = torchrun(RANKS, "save", str(root), tmp_path / "save-1", *layout, "--steps", "1")
    torchrun(RANKS, "save", str(root), tmp_path / "save-2", *layout, "--steps", "2")
    chunks = json.loads(index_path(root, 2, 2).read_text())["chunks"]
    largest = max((k for k in chunks if not k.startswith("rank-")), key=lambda k: chunks[k][2] - chunks[k][1])

    def flip(data: bytearray) -> None:
        data[len(data) // 2] ^= 0xFF

    edit_chunk_bytes(root, 2, 2, largest, flip)
    reports, output = torchrun(RANKS, "restore", str(root), tmp_path / "restore", *layout)
    assert [r["restored"] for r in reports] == [1] * RANKS
    assert [r["tensors"] for r in reports] == [s["tensors"] for s in step1]
    [line] = [line for line in output.splitlines() if "failed verification" in line]
    assert "(rank 2: " in line and "does not match its checksum" in line and "falling back to step 1" in line
    assert not any(f"rank {r}: " in line for r in (0, 1, 3)), line
    assert local_statuses(root) == {1: "complete", 2: "corrupt"}


def test_a_rank_whose_objects_refuse_the_step_stops_every_rank(tmp_path):
    """Issue 26, point 3: rank 1 asks for a state the step lacks (StateMismatchError, after the
    step was read and shared): every rank stops with a StateMismatchError, rank 1 in its own
    words, and nothing is un-committed."""
    root = tmp_path / "ck"
    layout = ("--layout", "ddp", "--width", "128")
    torchrun(RANKS, "save", str(root), tmp_path / "save", *layout, "--steps", "1")
    reports, _ = torchrun(RANKS, "restore", str(root), tmp_path / "restore", *layout, "--extra-state-rank", "1")
    errors = [r["error"] or "" for r in reports]
    assert all(e.startswith("StateMismatchError: ") for e in errors), errors
    assert "has no state named 'extra'" in errors[1]
    assert all("does not fit this job" in errors[r] for r in (0, 2, 3)), errors
    assert local_statuses(root) == {1: "complete"}

"""Issue 10, acceptance "On S3 (moto server): the bytes each rank reads during a resharded
restore are counted and stay within its share plus small overhead".

An FSDP2 model and its AdamW state are saved by 2 ranks (real torchrun, gloo) to a real
moto server, then restored by 3 ranks. During the restore every rank talks to S3 through a
proxy of its own (tests/support/fault_proxy.py, no faults), chosen by its ``RANK``: the proxy counts
every byte it sends that rank, apart from spotrun's own ``restore_bytes_read``.

The bounds, per rank (worked out from torch's sharding of the live model and the saved
chunks' places in the files, which the writers' index files give; never from the reader):

* its share: the bytes of its own box of every tensor (its DTensor shards; a plain tensor
  such as AdamW's ``step`` whole) and of the own state it takes over (the RNG state tensors
  of saved rank ``rank mod 2``);
* data bytes (ranged GETs of the shard files): at least the share, and at most the share
  rounded out to whole 1 MiB checksum blocks (every block is verified, so a reader reads the
  blocks around what it needs; blocks two runs share count once), which is itself at most
  the share plus 2 blocks per run (a run: one tensor's overlap with one saved chunk, one
  contiguous byte range along dimension 0), plus the safetensors header of each file it reads
  from, once (checked against the manifest and the index before anything is read, issue 21);
* index bytes: at most the writers' index files, each read once;
* everything else (the listing of the root, the manifest, the incarnation records of the
  fencing claim, and every answer's status line and headers): at most :data:`OTHER_BOUND_BYTES`
  plus the manifest's size; so spotrun's ``restore_bytes_read`` (index and block bytes)
  equals the proxy's body count of the index and shard GETs, and the wire count exceeds it
  by no more than that.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib

import pytest

from tests.support.fault_proxy import FaultProxy
from tests.support.paths import JOBS
from tests.support.rank_reports import run_ranks
from tests.support.s3_server import make_client

pytestmark = pytest.mark.slow

WORKER = JOBS / "sharded_s3_job.py"
#: Layers width -> 2*width -> width with biases: weights of 2 * WIDTH**2 float32 (8 MiB each).
WIDTH = 1024
SAVED_RANKS, RESTORED_RANKS = 2, 3
BLOCK_BYTES = 2**20  # the checksum block (spotrun.checkpoint.stream.CHECKSUM_BLOCK_BYTES)
#: Bound of a restore's traffic besides index and shard bodies, besides the manifest: one
#: listing of the root and of the incarnation records (a few hundred bytes per object listed,
#: a dozen objects), the incarnation record a rank reads, and the status line and headers of
#: each answer (about 300-500 bytes; a restore makes a few dozen requests).
OTHER_BOUND_BYTES = 64 * 1024
TORCHRUN_TIMEOUT_S = 240
STEP_DIR = "job/step-000000001/"


def torchrun(ranks: int, mode: str, uri: str, out_dir: pathlib.Path, env: dict[str, str]) -> list[dict]:
    """Run the worker on ``ranks`` ranks; each rank's report, by rank."""
    args = ["--mode", mode, "--uri", uri, "--width", str(WIDTH), "--out-dir", str(out_dir)]
    return run_ranks(ranks, WORKER, args, out_dir, env, timeout_s=TORCHRUN_TIMEOUT_S)[0]


def saved_files(bucket) -> tuple[dict[str, int], dict[int, dict]]:
    """Straight from moto (not through a proxy): step 1's file sizes by name, and the
    writers' index files (their documented JSON format) by writer rank."""
    client = make_client(bucket.endpoint_url)
    listing = client.list_objects_v2(Bucket=bucket.name, Prefix=STEP_DIR)["Contents"]
    sizes = {o["Key"][len(STEP_DIR) :]: o["Size"] for o in listing}
    indexes = {}
    for name in sizes:
        if name.endswith(".index.json"):
            doc = json.loads(client.get_object(Bucket=bucket.name, Key=STEP_DIR + name)["Body"].read())
            indexes[doc["rank"]] = doc
    return sizes, indexes


def runs_of(report: dict, rank: int, indexes: dict[int, dict]) -> list[tuple[str, int, int]]:
    """The byte runs ``(file, begin, end)`` of the saved files that hold ``rank``'s share:
    each tensor's box (from the live DTensors) cut by each saved chunk (from the indexes),
    and the RNG state tensors of saved rank ``rank mod SAVED_RANKS``."""
    runs = []
    own_state = f"rank-{rank % SAVED_RANKS:05d}/"
    for _writer, index in indexes.items():
        for key, (file_index, begin, end) in index["chunks"].items():
            path = index["files"][file_index]["path"]
            name, _, offsets = key.partition("@")
            if name.startswith(own_state):
                runs.append((path, begin, end))
                continue
            if name.startswith("rank-"):
                continue  # another saved rank's own state
            held = report["shards"][name]
            if held["box"] is None:  # a plain tensor, held whole
                runs.append((path, begin, end))
                continue
            row_bytes = math.prod(held["shape"][1:]) * held["itemsize"]
            first = int(offsets.split(",")[0]) if offsets else 0
            rows = (end - begin) // row_bytes
            low, high = max(first, held["box"][0]), min(first + rows, sum(held["box"]))
            if low < high:
                runs.append((path, begin + (low - first) * row_bytes, begin + (high - first) * row_bytes))
    return runs


def header_bytes(runs: list[tuple[str, int, int]], indexes: dict[int, dict]) -> int:
    """The 8-byte length and JSON header of each file that ``runs`` touch: everything before
    its first chunk (a safetensors file's data follows its header)."""
    data_start = {}
    for index in indexes.values():
        for file_index, begin, _end in index["chunks"].values():
            path = index["files"][file_index]["path"]
            data_start[path] = min(begin, data_start.get(path, begin))
    return sum(data_start[path] for path in {path for path, _, _ in runs})


def block_bytes(runs: list[tuple[str, int, int]], sizes: dict[str, int]) -> int:
    """Bytes of the whole checksum blocks that ``runs`` touch, each block counted once."""
    blocks = {(path, b) for path, begin, end in runs for b in range(begin // BLOCK_BYTES, (end - 1) // BLOCK_BYTES + 1)}
    return sum(min(BLOCK_BYTES, sizes[path] - b * BLOCK_BYTES) for path, b in blocks)


def test_fsdp2_saved_on_2_ranks_restored_on_3_each_rank_reads_its_share_from_s3(s3_bucket, tmp_path):
    uri = f"{s3_bucket.uri}/job"
    saved = torchrun(SAVED_RANKS, "save", uri, tmp_path / "save", {})
    sizes, indexes = saved_files(s3_bucket)
    with contextlib.ExitStack() as stack:  # one proxy per restoring rank
        proxies = [stack.enter_context(FaultProxy(s3_bucket.endpoint_url)) for _ in range(RESTORED_RANKS)]
        restored = torchrun(
            RESTORED_RANKS,
            "restore",
            uri,
            tmp_path / "restore",
            {"SPOTRUN_TEST_RANK_ENDPOINTS": ",".join(p.url for p in proxies)},
        )

    shard_bytes = sum(size for name, size in sizes.items() if name.endswith(".safetensors"))
    index_file_bytes = sum(size for name, size in sizes.items() if name.endswith(".index.json"))
    manifest_bytes = sum(size for name, size in sizes.items() if name.startswith("manifest."))
    print(f"\nsaved by {SAVED_RANKS} ranks: {shard_bytes / 2**20:.1f} MiB of shard files; restored by {RESTORED_RANKS}")
    print("rank   share MiB   read MiB   block bound MiB   runs   index B   other B   restore_bytes_read")
    for rank, (report, proxy) in enumerate(zip(restored, proxies)):
        assert report["restored"] == 1
        # bit-identical: every parameter and AdamW tensor gathered to full
        assert report["tensors"] == saved[0]["tensors"]
        runs = runs_of(report, rank, indexes)
        share = sum(end - begin for _, begin, end in runs)
        expected_share = sum(  # from the live tensors alone: each run is one piece of the share
            (held["box"][1] * math.prod(held["shape"][1:]) if held["box"] else math.prod(held["shape"]))
            * held["itemsize"]
            for held in report["shards"].values()
        )
        own_state_bytes = sum(
            end - begin
            for key, (_, begin, end) in indexes[rank % SAVED_RANKS]["chunks"].items()
            if key.startswith(f"rank-{rank % SAVED_RANKS:05d}/")
        )
        assert share == expected_share + own_state_bytes, "the saved chunks must cover each tensor's box exactly once"
        bound = block_bytes(runs, sizes) + header_bytes(runs, indexes)

        answers = proxy.relayed()
        assert {a.status for a in answers} <= {200, 206}, answers
        data = sum(a.body_bytes for a in answers if a.method == "GET" and ".safetensors" in a.path)
        index = sum(a.body_bytes for a in answers if a.method == "GET" and ".index.json" in a.path)
        other = proxy.sent_bytes - data - index
        print(
            f"{rank:4d}   {share / 2**20:9.2f}   {data / 2**20:8.2f}   {bound / 2**20:15.2f}   {len(runs):4d}   "
            f"{index:7d}   {other:7d}   {report['restore_bytes_read']}"
        )

        assert share <= data <= bound <= share + 2 * BLOCK_BYTES * len(runs) + header_bytes(runs, indexes)
        assert data < shard_bytes, "a rank read the whole checkpoint"
        assert index <= index_file_bytes
        assert other <= manifest_bytes + OTHER_BOUND_BYTES
        assert report["restore_bytes_read"] == data + index  # spotrun's count: the same bodies
        assert (
            report["restore_bytes_read"]
            < proxy.sent_bytes
            <= report["restore_bytes_read"] + manifest_bytes + OTHER_BOUND_BYTES
        )

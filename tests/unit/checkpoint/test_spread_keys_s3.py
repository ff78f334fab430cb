"""Issue 26, point 2 and its acceptance line "The moto test with the spread key layout: requests
per prefix counted; every tool (ls, gc, verify, export, report, restore) works on a root written
that way, and roots written before still load".

An FSDP2 model and its AdamW state are saved by 4 ranks (real torchrun, gloo) to a real moto
server with ``key_layout="spread"`` (tests/jobs/sharded_s3_job.py). Requests are counted per key
prefix by the proxy every rank talks to (tests/support/fault_proxy.py): the prefix is the first
component of an object's key under the root, or of a listing's prefix. A root written before
(the step layout, format 4, as spotrun writes below 256 ranks) is in
test_a_root_with_both_layouts_lists_verifies_restores_and_collects_both.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib
import subprocess
import sys
import urllib.parse

import pytest
import safetensors.torch
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import spread_dir
from spotrun.checkpoint.restore import load_committed
from spotrun.cli import main
from spotrun.storage import open_storage
from tests.support.fault_proxy import FaultProxy
from tests.support.paths import JOBS
from tests.support.rank_reports import run_ranks
from tests.support.s3_server import make_client

pytestmark = pytest.mark.slow

WORKER = JOBS / "sharded_s3_job.py"
WIDTH = 1024  # 12 MiB of parameters and AdamW state per rank on 4 ranks
RANKS = 4
MIB = 1024 * 1024
#: Multipart from 5 MiB on, so each rank's shard goes up as create, parts, complete.
SPREAD = {"key_layout": "spread", "multipart_threshold_bytes": 5 * MIB, "part_size_bytes": 5 * MIB}
TORCHRUN_TIMEOUT_S = 240
DATA_FILE_SUFFIXES = (".safetensors", ".index.json")


def torchrun(ranks: int, mode: str, uri: str, out_dir: pathlib.Path, env: dict[str, str], *extra: str) -> list[dict]:
    """Run the worker on ``ranks`` ranks; each rank's report, by rank."""
    args = ["--mode", mode, "--uri", uri, "--width", str(WIDTH), "--out-dir", str(out_dir), *extra]
    return run_ranks(ranks, WORKER, args, out_dir, env, timeout_s=TORCHRUN_TIMEOUT_S)[0]


def save(uri: str, out_dir: pathlib.Path, steps: str = "1", env: dict[str, str] | None = None) -> list[dict]:
    return torchrun(
        RANKS, "save", uri, out_dir, env or {}, "--storage-options", json.dumps(SPREAD), "--save-steps", steps
    )


def key_of(path: str, root: str) -> str | None:
    """The key under ``root`` (``job/``) a request names: its object, or its listing's prefix."""
    parts = urllib.parse.urlsplit(path)
    bucket, _, name = parts.path.lstrip("/").partition("/")
    if not name:
        name = urllib.parse.parse_qs(parts.query).get("prefix", [""])[0]
    name = urllib.parse.unquote(name)
    return name[len(root) :] if name.startswith(root) else None


def test_a_spread_save_spreads_its_writes_over_the_ranks_prefixes(s3_bucket, tmp_path):
    """Issue 26 point 2: with the spread layout each rank's data files and index, every request
    of their multipart uploads included, go under the rank's own prefix (its last digits
    reversed), the manifest alone to the step directory; so the busiest prefix takes one rank's
    share of the save's writes. The bound: ranks write equal shards (FSDP2 splits evenly), so
    equal requests within one part: at most ``(1 / ranks) * (1 + 1 / per-rank writes)`` of the
    writes, 1.25 / 4 here, where the step layout sends all of them to ``step-000000001/``."""
    with FaultProxy(s3_bucket.endpoint_url) as proxy:
        save(f"{s3_bucket.uri}/job", tmp_path / "save", env={"AWS_ENDPOINT_URL": proxy.url})
        relayed = proxy.relayed()
    writes: collections.Counter[str] = collections.Counter()
    per_rank: collections.Counter[int] = collections.Counter()
    for answer in relayed:
        key = key_of(answer.path, "job/")
        if key is None or answer.method not in ("PUT", "POST", "DELETE"):
            continue
        prefix, _, rest = key.partition("/")
        writes[prefix] += 1
        name = rest.rpartition("/")[2]
        if name.endswith(DATA_FILE_SUFFIXES):
            rank = int(name.split(".")[0].removeprefix("rank-"))
            assert prefix == spread_dir(rank, 2), f"{key} is not under rank {rank}'s prefix"
            per_rank[rank] += 1
    assert set(per_rank) == set(range(RANKS)) and min(per_rank.values()) >= 4  # create, parts, complete, index
    spread = {spread_dir(r, 2) for r in range(RANKS)}
    assert {p for p in writes if p in spread} == spread == {"00", "10", "20", "30"}
    assert writes["step-000000001"] == 1  # the manifest, the commit
    total = sum(writes.values())
    busiest = max(writes.values())
    assert busiest / total <= (1 / RANKS) * (1 + 1 / min(per_rank.values())), dict(writes)
    assert max(per_rank.values()) - min(per_rank.values()) <= 1


def tensors_in(directory: pathlib.Path) -> dict[str, str]:
    """Name -> SHA-256 of the bytes of every tensor of an export's safetensors files."""
    found = {}
    for path in directory.glob("*.safetensors"):
        for name, tensor in safetensors.torch.load_file(str(path)).items():
            found[name] = hashlib.sha256(
                tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            ).hexdigest()
    return found


def open_uploads(bucket) -> list[str]:
    return [
        u["Key"] for u in make_client(bucket.endpoint_url).list_multipart_uploads(Bucket=bucket.name).get("Uploads", [])
    ]


def test_every_tool_works_on_a_root_written_with_the_spread_layout(s3_bucket, tmp_path, capsys):
    """Issue 26 point 2, acceptance: on a root saved by 4 ranks with the spread layout, ``ls``
    lists both steps complete, ``verify`` passes them, ``export --format hf`` writes the tensors
    the job held, ``report`` reads the job's events, ``gc`` deletes the older step's files under
    every prefix, a killed writer's files under spread prefixes and its open multipart upload,
    and the step it keeps restores bit-exactly on 4 ranks and on 3."""
    uri = f"{s3_bucket.uri}/job"
    saved = save(uri, tmp_path / "save", steps="1,2")
    client = make_client(s3_bucket.endpoint_url)

    assert main(["ls", uri, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["status"], s["world_size"]) for s in listed] == [(1, "complete", 4), (2, "complete", 4)]
    assert main(["verify", uri, "--all"]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert main(["export", uri, str(tmp_path / "hf"), "--format", "hf"]) == 0
    capsys.readouterr()
    model = {k.removeprefix("model/"): d for k, d in saved[0]["tensors"].items() if k.startswith("model/")}
    assert tensors_in(tmp_path / "hf") == model
    assert main(["report", uri]) == 0
    capsys.readouterr()

    # a killed writer's leftovers of step 3: files under two spread prefixes, an open upload
    for key in (
        "job/00/step-000000003/rank-00000.i000000009.safetensors",
        "job/30/step-000000003/rank-00003.i000000009.index.json",
    ):
        client.put_object(Bucket=s3_bucket.name, Key=key, Body=b"a save that never committed")
    client.create_multipart_upload(Bucket=s3_bucket.name, Key="job/20/step-000000003/rank-00002.i000000009.safetensors")
    assert main(["gc", uri, "--keep-last", "1", "--incomplete-older-than-s", "0"]) == 0
    capsys.readouterr()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket.name, Prefix="job/").get("Contents", [])]
    assert not [k for k in keys if "step-000000001" in k or "step-000000003" in k]
    assert {k.split("/")[1] for k in keys if "step-000000002" in k} == {"00", "10", "20", "30", "step-000000002"}
    assert open_uploads(s3_bucket) == []

    for ranks in (RANKS, 3):
        restored = torchrun(ranks, "restore", uri, tmp_path / f"restore-{ranks}", {})
        assert all(r["restored"] == 2 for r in restored)
        assert all(r["tensors"] == saved[0]["tensors"] for r in restored)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(256, 300)


def test_a_root_with_both_layouts_lists_verifies_restores_and_collects_both(s3_bucket, capsys):
    """Issue 26 point 2, acceptance "roots written before still load": a root whose steps were
    written by three starts of a job, in the step layout (format 4, as every save before and
    every save below 256 ranks: steps 1 and 4) and in the spread layout (format 5: steps 2 and
    3), lists every step complete, verifies them, restores each exactly, and ``gc --keep-last 1``
    deletes the old steps of either layout whole (step 3 stays: the newest start resumed from it)."""
    uri = f"{s3_bucket.uri}/job"
    net = Net()
    weights = {}
    for layout, steps in (("step", [1]), ("spread", [2, 3]), ("step", [4])):
        ckpt = spotrun.Checkpointer({"model": net}, storage=open_storage(uri, key_layout=layout), handle_signals=False)
        for step in steps:
            with torch.no_grad():
                net.proj.weight.add_(step)
            weights[step] = net.proj.weight.detach().clone()
            ckpt.save(step)
        ckpt.close()
    storage = open_storage(uri)
    listed = {s.step: s for s in catalog.list_steps(storage)}
    assert {s: (i.status, i.manifest.format_version) for s, i in listed.items()} == {
        1: ("complete", 4),
        2: ("complete", 5),
        3: ("complete", 5),
        4: ("complete", 4),
    }
    assert {o.key.split("/")[0] for o in listed[1].objects} == {"step-000000001"}
    assert {o.key.split("/")[0] for o in listed[2].objects} == {"step-000000002", "00"}
    assert main(["verify", uri, "--all"]) == 0, capsys.readouterr()
    for step in (4, 3, 2, 1):
        loaded = load_committed(storage, step, 0, 1)
        assert torch.equal(loaded.replicated["model"]["proj.weight"], weights[step])
    assert main(["gc", uri, "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert [s.step for s in catalog.list_steps(storage)] == [3, 4]
    assert not [o.key for o in storage.list("") if "step-000000001" in o.key or "step-000000002" in o.key]


def test_a_restore_reads_a_shard_in_units_that_grow_with_it(s3_bucket):
    """Issue 26 point 2: a restore from an object store reads each shard in units that grow with
    the read (one ranged GET each, ``max_concurrency`` in flight), not in 8 MiB ones: a 40 MiB
    shard read with 2 streams takes 2 data GETs instead of 5, every byte still verified in 1 MiB
    blocks (the restored weight is exact)."""
    uri = f"{s3_bucket.uri}/job"
    torch.manual_seed(0)
    saved = torch.nn.Linear(2560, 4096, bias=False)  # 40 MiB of float32
    ckpt = spotrun.Checkpointer({"model": saved}, storage=open_storage(uri), handle_signals=False)
    ckpt.save(1)
    ckpt.close()
    with FaultProxy(s3_bucket.endpoint_url) as proxy:
        restored = torch.nn.Linear(2560, 4096, bias=False)
        storage = open_storage(uri, endpoint_url=proxy.url, max_concurrency=2)
        ckpt = spotrun.Checkpointer({"model": restored}, storage=storage, handle_signals=False)
        assert ckpt.restore() == 1
        ckpt.close()
        data_gets = [r for r in proxy.relayed() if r.method == "GET" and r.path.split("?")[0].endswith(".safetensors")]
    assert torch.equal(restored.weight, saved.weight)
    large = [r.body_bytes for r in data_gets if r.body_bytes >= MIB]  # the header's reads are a few KiB
    assert len(large) == 2 and sum(large) >= 40 * MIB, [r.body_bytes for r in data_gets]


def test_spotrun_run_key_layout_spread_reaches_the_workers_and_ls_finds_the_steps(s3_bucket, tmp_path):
    """`spotrun run --key-layout spread` (a supervisor option, so a job at fewer than 256 ranks
    can spread its keys without code): the workers of a user's DDP script, which opens its root
    with defaults, write each rank's files under the rank's own prefix, and `spotrun ls` lists
    every step complete; `--key-layout step` keeps them in the step directory."""
    job = [str(JOBS / "ddp_mlp.py"), "8"]  # 2 saves (interval 4)
    for layout, root in (("spread", "spread-job"), ("step", "step-job")):
        uri = f"{s3_bucket.uri}/{root}"
        done = subprocess.run(
            [sys.executable, "-m", "spotrun", "run", "--checkpoint-uri", uri, "--key-layout", layout]
            + ["--s3-endpoint-url", s3_bucket.endpoint_url, "--"]
            + [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *job],
            capture_output=True,
            text=True,
            timeout=TORCHRUN_TIMEOUT_S,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        keys = [
            o["Key"][len(root) + 1 :]
            for o in make_client(s3_bucket.endpoint_url)
            .list_objects_v2(Bucket=s3_bucket.name, Prefix=f"{root}/")
            .get("Contents", [])
        ]
        data = [k for k in keys if k.endswith(DATA_FILE_SUFFIXES) and "/rank-" in k]
        assert data, keys
        for key in data:
            rank = int(key.rpartition("/rank-")[2].split(".")[0])
            first = key.partition("/")[0]  # step-000000004 in the step layout
            assert (first == spread_dir(rank, 2)) == (layout == "spread"), key
        steps = {s.step: s.status for s in catalog.list_steps(open_storage(uri, endpoint_url=s3_bucket.endpoint_url))}
        assert steps == {4: "complete", 8: "complete"}, steps

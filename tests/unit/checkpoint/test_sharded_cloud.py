"""Issue 25: an FSDP2 checkpoint saved by 2 ranks on ``gs://`` (the GCS emulator) or ``az://``
(Azurite) and restored by 3 reads only each rank's byte ranges, counted by a proxy per restoring
rank; the same bounds as on S3 (test_sharded_s3.py, whose docstring derives them), except the
wire count of headers, which neither proxy keeps (they count bodies).
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse

import pytest

from spotrun.storage import open_storage
from tests.support.azurite_server import connection_string, counting_proxy
from tests.support.gcs_server import GcsProxy
from tests.unit.checkpoint.test_sharded_s3 import (
    BLOCK_BYTES,
    RESTORED_RANKS,
    SAVED_RANKS,
    STEP_DIR,
    block_bytes,
    header_bytes,
    runs_of,
    torchrun,
)

pytestmark = pytest.mark.slow

TABLE_HEADER = "\nrank   share MiB   read MiB   block bound MiB   index B   restore_bytes_read"


def saved_files(uri: str) -> tuple[dict[str, int], dict[int, dict]]:
    """Step 1's file sizes by name and the writers' index files by writer rank, read with the
    storage API (through the fixture's own endpoint, not the counting proxies)."""
    storage = open_storage(uri)
    step = STEP_DIR.removeprefix("job/")
    sizes = {info.key[len(step) :]: info.size_bytes for info in storage.list(step)}
    indexes = {}
    for name in sizes:
        if name.endswith(".index.json"):
            doc = json.loads(storage.get(step + name))
            indexes[doc["rank"]] = doc
    return sizes, indexes


def check_rank(
    rank: int, report: dict, saved: list[dict], files: tuple[dict[str, int], dict[int, dict]], data: int, index: int
) -> None:
    """Assert one restoring rank's bounds (and print its row), given the body bytes its proxy
    relayed from the shard files (``data``) and from the index files (``index``)."""
    sizes, indexes = files
    shard_bytes = sum(size for name, size in sizes.items() if name.endswith(".safetensors"))
    index_file_bytes = sum(size for name, size in sizes.items() if name.endswith(".index.json"))
    assert report["restored"] == 1
    assert report["tensors"] == saved[0]["tensors"]
    runs = runs_of(report, rank, indexes)
    share = sum(end - begin for _, begin, end in runs)
    bound = block_bytes(runs, sizes) + header_bytes(runs, indexes)
    print(
        f"{rank:4d}   {share / 2**20:9.2f}   {data / 2**20:8.2f}   {bound / 2**20:15.2f}   {index:7d}   "
        f"{report['restore_bytes_read']}"
    )
    assert share <= data <= bound <= share + 2 * BLOCK_BYTES * len(runs) + header_bytes(runs, indexes)
    assert data < shard_bytes, "a rank read the whole checkpoint"
    assert index <= index_file_bytes
    assert report["restore_bytes_read"] == data + index  # spotrun's count: the same bodies


def test_fsdp2_saved_on_2_ranks_restored_on_3_each_rank_reads_its_share_from_gcs(gcs_bucket, tmp_path):
    uri = f"{gcs_bucket.uri}/job"
    saved = torchrun(SAVED_RANKS, "save", uri, tmp_path / "save", {})
    files = saved_files(uri)
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(GcsProxy(gcs_bucket.server.emulator_url)) for _ in range(RESTORED_RANKS)]
        rank_env = [{"STORAGE_EMULATOR_HOST": p.url} for p in proxies]
        restored = torchrun(
            RESTORED_RANKS, "restore", uri, tmp_path / "restore", {"SPOTRUN_TEST_RANK_ENV": json.dumps(rank_env)}
        )

    print(TABLE_HEADER)
    for rank, (report, proxy) in enumerate(zip(restored, proxies)):
        answers = proxy.seen()
        assert {a.status for a in answers} <= {200, 206}, answers
        gets = [a for a in answers if a.method == "GET"]
        data = sum(a.body_bytes for a in gets if a.object_name.endswith(".safetensors"))
        index = sum(a.body_bytes for a in gets if a.object_name.endswith(".index.json"))
        check_rank(rank, report, saved, files, data, index)


def test_fsdp2_saved_on_2_ranks_restored_on_3_each_rank_reads_its_share_from_azure(azure_container, tmp_path):
    uri = f"{azure_container.uri}/job"
    saved = torchrun(SAVED_RANKS, "save", uri, tmp_path / "save", {})
    files = saved_files(uri)
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(counting_proxy(azure_container.endpoint_url)) for _ in range(RESTORED_RANKS)]
        # Each rank's own connection string: the development account, its BlobEndpoint the rank's proxy.
        rank_env = [{"AZURE_STORAGE_CONNECTION_STRING": connection_string(url)} for url, _ in proxies]
        restored = torchrun(
            RESTORED_RANKS, "restore", uri, tmp_path / "restore", {"SPOTRUN_TEST_RANK_ENV": json.dumps(rank_env)}
        )

    print(TABLE_HEADER)
    for rank, (report, (_url, relayed)) in enumerate(zip(restored, proxies)):
        assert relayed, "the rank never talked to its proxy"
        # 201: a Put Blob's answer on Azure (the fencing claim's incarnation record, rank 0's event log)
        assert {a.status for a in relayed} <= {200, 201, 206}, relayed
        gets = [(urllib.parse.urlsplit(a.path).path, a) for a in relayed if a.method == "GET"]
        data = sum(a.body_bytes for path, a in gets if path.endswith(".safetensors"))
        index = sum(a.body_bytes for path, a in gets if path.endswith(".index.json"))
        check_rank(rank, report, saved, files, data, index)

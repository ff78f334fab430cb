"""Issue 26, point 2 (requests that scale): the part sizes of uploads and the units of ranged reads
grow with the object, within each store's limits, and a save's requests stay within the bound
``docs/design/storage.md`` (Requests that scale) derives.

Pure arithmetic of :mod:`spotrun.storage.part_sizes`; the stores themselves: the transfer tests
(test_s3_streaming.py, test_gcs_backend.py, test_azure_backend.py) and the spread-layout test
on moto (tests/unit/checkpoint/test_spread_keys_s3.py).
"""

from __future__ import annotations

import pytest

from spotrun.errors import ConfigError
from spotrun.storage.options import SPREAD_FROM_WORLD_SIZE, ObjectStoreOptions
from spotrun.storage.part_sizes import (
    AZURE_LIMITS,
    GCS_LIMITS,
    S3_LIMITS,
    read_requests,
    read_unit_size,
    upload_part_size,
    upload_requests,
)

MIB = 1024 * 1024
GIB = 1024 * MIB
CHUNK = 8 * MIB  # the checkpoint engine's chunk (spotrun.checkpoint.stream.CHECKSUM_CHUNK_BYTES)
DEFAULTS = ObjectStoreOptions()
ALL_LIMITS = [S3_LIMITS, GCS_LIMITS, AZURE_LIMITS]


def parts_of(size_bytes: int, part_bytes: int) -> int:
    return -(-size_bytes // part_bytes)


@pytest.mark.parametrize("limits", ALL_LIMITS, ids=lambda limits: limits.store)
def test_an_object_below_the_threshold_is_one_request(limits):
    """Issue 26 point 2: a tiny object (an index, a small shard) costs one request, on every store."""
    for size_bytes in (0, 1, DEFAULTS.multipart_threshold_bytes - 1):
        requests = upload_requests(size_bytes, DEFAULTS, limits, chunk_bytes=CHUNK)
        assert (requests.total, requests.puts) == (1, 1)


@pytest.mark.parametrize("limits", ALL_LIMITS, ids=lambda limits: limits.store)
def test_parts_grow_with_the_object_until_every_stream_is_busy_then_stay_at_the_cap(limits):
    """Issue 26 point 2: an object of at least ``max_concurrency`` smallest parts is cut into at
    most ``max_concurrency`` parts (no more requests than streams), at least two thirds of them
    (whole 8 MiB chunks round a part up), until the parts reach ``max_part_size_bytes``; from
    there the part count grows, never the part."""
    concurrency, floor, cap = DEFAULTS.max_concurrency, DEFAULTS.part_size_bytes, DEFAULTS.max_part_size_bytes
    for size_bytes in (concurrency * floor, concurrency * floor + 1, 200 * MIB, 500 * MIB, concurrency * cap):
        part = upload_part_size(size_bytes, DEFAULTS, limits, chunk_bytes=CHUNK)
        assert floor <= part <= cap and part % CHUNK == 0
        assert 2 * concurrency / 3 <= parts_of(size_bytes, part) <= concurrency, size_bytes
    for size_bytes in (concurrency * cap + 1, GIB, 4 * GIB, 60 * GIB):  # within GCS's 1,024 parts of the cap
        part = upload_part_size(size_bytes, DEFAULTS, limits, chunk_bytes=CHUNK)
        assert part == cap and parts_of(size_bytes, part) > concurrency
    for size_bytes in (DEFAULTS.multipart_threshold_bytes, concurrency * floor - 1):  # small: the smallest part
        assert upload_part_size(size_bytes, DEFAULTS, limits, chunk_bytes=CHUNK) == floor


def test_s3_parts_are_at_least_5_mib_whatever_the_options_say():
    """Issue 26 point 2: S3 refuses parts under 5 MiB (but the last); options made for another
    store (1 MiB parts) still give S3 parts of 5 MiB."""
    small = ObjectStoreOptions(part_size_bytes=MIB, max_part_size_bytes=MIB)
    assert upload_part_size(100 * MIB, small, S3_LIMITS) == 5 * MIB
    assert upload_part_size(100 * MIB, small, AZURE_LIMITS) == MIB


@pytest.mark.parametrize(
    ("limits", "largest_part_bytes"),
    [(S3_LIMITS, 5 * GIB), (AZURE_LIMITS, 4000 * MIB)],
    ids=["s3-5gib-part", "azure-4000mib-block"],
)
def test_parts_grow_past_the_cap_to_fit_the_part_count_up_to_the_largest_part(limits, largest_part_bytes):
    """Issue 26 point 2: an object that would need more than the store's parts (S3: 10,000; Azure:
    50,000 blocks) at the cap gets larger parts, whole chunks, up to the store's largest part; an
    object larger than that many largest parts is refused with a clear error."""
    cap = DEFAULTS.max_part_size_bytes
    size_bytes = limits.max_parts * cap + 1
    part = upload_part_size(size_bytes, DEFAULTS, limits, chunk_bytes=CHUNK)
    assert cap < part <= largest_part_bytes and part % CHUNK == 0
    assert parts_of(size_bytes, part) <= limits.max_parts
    largest = limits.max_parts * largest_part_bytes
    part = upload_part_size(largest, DEFAULTS, limits, chunk_bytes=CHUNK)
    assert part == largest_part_bytes and parts_of(largest, part) == limits.max_parts
    with pytest.raises(ConfigError, match=f"{limits.max_parts} parts"):
        upload_part_size(largest + 1, DEFAULTS, limits, chunk_bytes=CHUNK)


def test_gcs_parts_fit_the_two_levels_of_1024_composed_parts():
    """Issue 26 point 2: GCS composes at most 32 parts per request, two levels: 1,024 parts. A
    shard of 200 GiB gets parts large enough for that, and the requests count every upload,
    compose and deletion."""
    size_bytes = 200 * GIB
    requests = upload_requests(size_bytes, DEFAULTS, GCS_LIMITS, chunk_bytes=CHUNK)
    assert requests.parts == parts_of(size_bytes, requests.part_size_bytes) <= 1024
    intermediates = -(-requests.parts // 32)
    assert requests.composes == intermediates + 1
    assert requests.deletes == requests.parts + intermediates
    assert requests.total == 2 * requests.parts + 2 * intermediates + 1
    few = upload_requests(512 * MIB, DEFAULTS, GCS_LIMITS, chunk_bytes=CHUNK)  # 8 parts: one compose
    assert (few.parts, few.composes, few.deletes) == (8, 1, 8)


def test_an_s3_upload_is_create_parts_complete_and_azure_is_blocks_and_one_list():
    """Issue 26 point 2: the requests of one upload, by kind, as the scale model counts them."""
    s3 = upload_requests(512 * MIB, DEFAULTS, S3_LIMITS, chunk_bytes=CHUNK)
    assert (s3.creates, s3.parts, s3.completes, s3.total) == (1, 8, 1, 10)
    azure = upload_requests(512 * MIB, DEFAULTS, AZURE_LIMITS, chunk_bytes=CHUNK)
    assert (azure.parts, azure.completes, azure.total) == (8, 1, 9)


def test_part_buffers_stay_within_max_concurrency_parts_of_the_cap():
    """Issue 26 point 2 (memory): an upload holds at most ``max_concurrency`` part buffers; with
    growing parts that is at most the object's bytes rounded up to whole chunks, and never more
    than ``max_concurrency * max_part_size_bytes`` (512 MiB with the defaults) for an object that
    fits the store's part count at the cap (S3: 625 GiB; a shard file is at most 4 GiB by default,
    ``max_file_size_bytes``)."""
    bound = DEFAULTS.max_concurrency * DEFAULTS.max_part_size_bytes
    assert bound == 512 * MIB
    for size_bytes in (64 * MIB, 300 * MIB + 7, GIB, 10 * GIB, S3_LIMITS.max_parts * DEFAULTS.max_part_size_bytes):
        part = upload_part_size(size_bytes, DEFAULTS, S3_LIMITS, chunk_bytes=CHUNK)
        held = min(DEFAULTS.max_concurrency, parts_of(size_bytes, part)) * part
        assert held <= min(bound, size_bytes + DEFAULTS.max_concurrency * CHUNK)


def test_read_units_grow_with_the_read_and_stay_small_for_small_reads():
    """Issue 26 point 2: a restore reads in units of one GET each: 8 MiB for a small read, the
    read over ``max_concurrency`` for a larger one, at most ``max_part_size_bytes``; 512 MiB is
    8 GETs and 1 GiB 16, not 64 and 128."""
    assert read_unit_size(3 * MIB, DEFAULTS, floor_bytes=CHUNK) == CHUNK
    assert read_unit_size(512 * MIB, DEFAULTS, floor_bytes=CHUNK) == 64 * MIB
    assert read_requests(512 * MIB, DEFAULTS, floor_bytes=CHUNK) == 8
    assert read_requests(GIB, DEFAULTS, floor_bytes=CHUNK) == 16
    assert read_unit_size(100 * GIB, DEFAULTS, floor_bytes=CHUNK) == DEFAULTS.max_part_size_bytes
    odd = read_unit_size(100 * MIB + 1, DEFAULTS, floor_bytes=CHUNK)
    assert odd % CHUNK == 0 and read_requests(100 * MIB + 1, DEFAULTS, floor_bytes=CHUNK) <= DEFAULTS.max_concurrency
    assert read_requests(0, DEFAULTS, floor_bytes=CHUNK) == 0


@pytest.mark.parametrize("ranks", [1024, 8192])
def test_a_1_tb_save_stays_within_the_documented_request_bound(ranks):
    """Issue 26 point 2, the bound ``docs/design/storage.md`` states: a 1 TB checkpoint saved by
    ``ranks`` ranks (one shard file and one index per rank on S3, plus the manifest) takes at most
    ``ranks * (3 + max(max_concurrency, shard / max_part_size_bytes)) + 1`` requests: 18,433 at
    1,024 ranks (931 MiB shards in 15 parts of 64 MiB; the issue asks for under 20,000), 90,113
    at 8,192 (116 MiB shards still go up in 8 streams each)."""
    shard_bytes = 10**12 // ranks
    per_rank = upload_requests(shard_bytes, DEFAULTS, S3_LIMITS, chunk_bytes=CHUNK).total + 1  # + the index
    total = ranks * per_rank + 1  # + the manifest
    bound = ranks * (3 + max(DEFAULTS.max_concurrency, -(-shard_bytes // DEFAULTS.max_part_size_bytes))) + 1
    assert total <= bound
    assert ranks != 1024 or total < 20_000


def test_the_spread_layout_is_on_by_default_from_256_ranks_and_can_be_chosen():
    """Issue 26 point 2: ``key_layout="auto"`` spreads from 256 ranks on; ``spread`` and ``step``
    choose either at any world size; anything else is refused."""
    assert SPREAD_FROM_WORLD_SIZE == 256
    assert not DEFAULTS.spreads_rank_keys(255) and DEFAULTS.spreads_rank_keys(256)
    assert ObjectStoreOptions(key_layout="spread").spreads_rank_keys(1)
    assert not ObjectStoreOptions(key_layout="step").spreads_rank_keys(8192)
    with pytest.raises(ConfigError, match="key_layout"):
        ObjectStoreOptions(key_layout="hash")


def test_the_key_layout_defaults_to_spotrun_key_layout_which_spotrun_run_sets(monkeypatch):
    """`spotrun run --key-layout` reaches the workers as $SPOTRUN_KEY_LAYOUT, the default of
    every store's options (an argument wins); a value not among the layouts is refused, naming
    the variable, when the storage opens."""
    monkeypatch.setenv("SPOTRUN_KEY_LAYOUT", "spread")
    assert ObjectStoreOptions().spreads_rank_keys(2)
    assert not ObjectStoreOptions(key_layout="step").spreads_rank_keys(8192)
    monkeypatch.setenv("SPOTRUN_KEY_LAYOUT", "hash")
    with pytest.raises(ConfigError, match=r"\$SPOTRUN_KEY_LAYOUT must be one of"):
        ObjectStoreOptions()
    monkeypatch.delenv("SPOTRUN_KEY_LAYOUT")
    assert ObjectStoreOptions().key_layout == "auto"

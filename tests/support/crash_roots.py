"""What the crash campaign (tests/support/crash_campaign.py) saves and where: the scenario, the
state each step holds (and its bit-exact comparison), and the checkpoint roots - made,
copied, removed, and what identifies each committed object's bytes."""

from __future__ import annotations

import copy
import functools
import inspect
import os
import shutil
from dataclasses import dataclass
from typing import Any

import numpy
import torch

#: The base commits this step; each writer restores it, then saves Scenario.saved_steps.
BASE_STEP = 1
KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Scenario:
    """What a campaign saves, where, and how.

    Attributes:
        backend: ``local`` or ``s3``.
        mode: ``sync`` (``Checkpointer.save``) or ``background`` (periodic saves on the
            background thread).
        bucket: the S3 bucket (``s3`` only).
        work_dir: local scratch directory (local roots, snapshots, results).
    """

    backend: str
    mode: str
    work_dir: str
    bucket: str | None = None

    @property
    def weight_elems(self) -> int:
        """float32 elements of the largest tensor: on local storage a file of more than one
        write chunk (8 MiB) written with O_DIRECT from ``put_stream``'s bounce buffers, the
        way a real shard goes; on S3 small (a one-part multipart upload), as every request
        costs moto milliseconds."""
        return (8 * MIB + 64 * KIB) // 4 if self.backend == "local" else 64 * KIB

    @property
    def saved_steps(self) -> tuple[int, ...]:
        """Steps each writer saves after restoring the base: two in a row on local storage
        (the second while the first, of the same incarnation, is committed); one on S3,
        whose kill points repeat the same requests for a second save, at about a second of
        moto requests per point."""
        return (2, 3) if self.backend == "local" else (2,)

    def uri(self, name: str) -> str:
        """Where the root called ``name`` lives."""
        if self.backend == "s3":
            return f"s3://{self.bucket}/crash/{name}"
        return os.path.join(self.work_dir, "roots", name)


# --- the state saved at each step ---------------------------------------------------

#: float32 elements of the second large tensor and bfloat16 elements of the third: with the
#: largest (Scenario.weight_elems) each gets a shard file of its own with MAX_FILE_SIZE_BYTES.
WEIGHT2_ELEMS, BIAS_ELEMS = 40 * KIB, 32 * KIB
MAX_FILE_SIZE_BYTES = 200 * KIB
#: Local objects stored whole (manifests, incarnation records) are written in chunks of this
#: (several write calls each), where LocalStorage takes the option.
LOCAL_WRITE_CHUNK_BYTES = 2 * KIB
#: S3 files of at least this size are multipart uploads (the first file of each save; the
#: others are single PutObjects).
MULTIPART_THRESHOLD_BYTES = 192 * KIB


def expected_state(step: int, scenario: Scenario) -> dict[str, dict[str, Any]]:
    """The replicated state a writer saves at ``step`` (deterministic: the same bits in
    every process), with several dtypes and special float bit patterns. Never change what
    this returns: it is computed once (the parent computes every step's before forking)."""
    return _generated_state(step, scenario.weight_elems)


@functools.cache
def _generated_state(step: int, weight_elems: int) -> dict[str, dict[str, Any]]:
    g = torch.Generator().manual_seed(1000 + step)
    specials = torch.tensor(
        [0x7FC00001 + step, 0xFFC12345 - 2**32, -(2**31), 0x7F800000, step], dtype=torch.int32
    ).view(torch.float32)  # NaN payloads, -0.0, inf, a denormal
    return {
        "model": {
            "layer.weight": torch.randn(weight_elems, generator=g),
            "layer2.weight": torch.randn(WEIGHT2_ELEMS, generator=g),
            "layer.bias": torch.randn(BIAS_ELEMS, generator=g).to(torch.bfloat16),
            "counts": torch.randint(-(2**40), 2**40, (500,), generator=g, dtype=torch.int64),
            "mask": torch.rand(333, generator=g) > 0.5,
            "specials": specials,
        },
        "meta": {"step": step, "lr": 0.1 / step, "schedule": [step, "warm", None], "nested": {"1": -0.0}},
    }


def set_state(state: dict[str, dict[str, Any]], step: int, scenario: Scenario) -> None:
    """Make the live state (new tensor objects) what :func:`expected_state` says for ``step``."""
    expected = expected_state(step, scenario)
    state["model"].clear()
    state["model"].update({name: tensor.clone() for name, tensor in expected["model"].items()})
    state["meta"].clear()
    state["meta"].update(copy.deepcopy(expected["meta"]))


def scribble(state: dict[str, dict[str, Any]]) -> None:
    """Training goes on: change every live tensor in place (a staged save must not see it)."""
    with torch.no_grad():
        for tensor in state["model"].values():
            if tensor.dtype == torch.bool:
                tensor.logical_not_()
            else:
                tensor.view(torch.uint8).add_(1)


def compare(actual: dict[str, Any], step: int, what: str, scenario: Scenario) -> list[str]:
    """Differences between ``actual`` (name -> state dict) and step ``step``'s saved state."""
    expected = expected_state(step, scenario)
    problems = []
    if sorted(actual) != sorted(expected):
        return [f"{what}: state names {sorted(actual)}, saved {sorted(expected)}"]
    if actual["meta"] != expected["meta"]:
        problems.append(f"{what}: meta {actual['meta']!r}, saved {expected['meta']!r}")
    tensors, saved = actual["model"], expected["model"]
    if sorted(tensors) != sorted(saved):
        return problems + [f"{what}: tensors {sorted(tensors)}, saved {sorted(saved)}"]
    for name, want in saved.items():
        got = tensors[name]
        if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(f"{what}: {name} is {got.dtype} {tuple(got.shape)}, saved {want.dtype} {tuple(want.shape)}")
        elif not numpy.array_equal(got.contiguous().view(torch.uint8).numpy(), want.view(torch.uint8).numpy()):
            problems.append(f"{what}: {name} differs from step {step}'s saved bits")
    return problems


# --- storage ------------------------------------------------------------------------


def make_storage(scenario: Scenario, uri: str, *, durable: bool = True):
    """The writer's storage (``durable``: fsync on; S3: a client of its own, built as
    spotrun builds it) or a checker's (fsync off; S3: a client of boto3's default
    session, which the parent warmed up, so a child builds it in milliseconds)."""
    if scenario.backend == "s3":
        from spotrun.storage.s3 import S3Options, S3Storage, parse_s3_uri

        options = {
            "part_size_bytes": 5 * MIB,
            "max_part_size_bytes": 5 * MIB,  # many parts: many places to crash
            "multipart_threshold_bytes": MULTIPART_THRESHOLD_BYTES,
            "max_concurrency": 2,
            "retry_deadline_s": 60.0,
        }
        if durable:
            return S3Storage.from_uri(uri, **options)
        return S3Storage(*parse_s3_uri(uri), S3Options(**options), client=_s3_client())
    from spotrun.storage import LocalStorage

    accepted = inspect.signature(LocalStorage).parameters
    options = {"fsync": durable, "direct_io": durable, "write_chunk_bytes": LOCAL_WRITE_CHUNK_BYTES}
    return LocalStorage(uri, **{k: v for k, v in options.items() if k in accepted})


def _s3_client():
    """A client of boto3's default session; endpoint and fake credentials come from the
    environment (``AWS_ENDPOINT_URL``); botocore's retries off, as spotrun's."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        config=Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def preload(scenario: Scenario) -> None:
    """Import in the parent what every child needs (and, for S3, load botocore's service
    model into the default session), so that children start in milliseconds. Nothing here
    starts a thread or opens a connection."""
    import spotrun.checkpoint.catalog  # noqa: F401
    import spotrun.checkpoint.claim  # noqa: F401
    import spotrun.checkpoint.restore  # noqa: F401
    import spotrun.storage.local  # noqa: F401
    import spotrun.train.checkpointer  # noqa: F401

    if scenario.backend == "s3":
        import botocore.loaders
        import botocore.session

        import spotrun.storage.s3

        # Every botocore session (spotrun builds one per client) shares one data loader, so
        # the service model is parsed once here rather than in every child (0.4 s each).
        loader = botocore.loaders.create_loader()
        botocore.session.create_loader = lambda *args, **kwargs: loader
        spotrun.storage.s3.make_client(spotrun.storage.s3.S3Options())
        _s3_client()


def copy_root(scenario: Scenario, source: str, dest: str) -> None:
    """Copy every object of a root (a real copy, never links: a change must not reach the base)."""
    if scenario.backend == "local":
        shutil.copytree(source, dest)
        return
    client, bucket = _s3_client(), scenario.bucket
    src_prefix, dest_prefix = source.split("/", 3)[3] + "/", dest.split("/", 3)[3] + "/"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=src_prefix):
        for obj in page.get("Contents", []):
            client.copy_object(
                Bucket=bucket,
                Key=dest_prefix + obj["Key"][len(src_prefix) :],
                CopySource={"Bucket": bucket, "Key": obj["Key"]},
            )


def remove_root(scenario: Scenario, uri: str) -> None:
    """Delete a root, open multipart uploads included (moto keeps them in memory)."""
    if scenario.backend == "local":
        shutil.rmtree(uri, ignore_errors=True)
        return
    client, bucket, prefix = _s3_client(), scenario.bucket, uri.split("/", 3)[3] + "/"
    for upload in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def object_identities(scenario: Scenario, uri: str, storage, keys: list[str]) -> dict[str, str]:
    """What identifies each object's content: local files, the SHA-256 of their bytes;
    S3 objects, the store's own hash of their bytes (the ETag: MD5 of the object, or of
    its parts' MD5s) with size and LastModified, all from one listing (a download per
    object, twice per kill point, would double the campaign's requests)."""
    import hashlib

    from spotrun.errors import ObjectNotFoundError

    if scenario.backend == "local":
        found = {}
        for key in keys:
            try:
                found[key] = "sha256 " + hashlib.sha256(storage.get(key)).hexdigest()
            except ObjectNotFoundError:
                found[key] = "missing"
        return found
    prefix = uri.split("/", 3)[3] + "/"
    listed = {}
    for page in _s3_client().get_paginator("list_objects_v2").paginate(Bucket=scenario.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            listed[obj["Key"][len(prefix) :]] = (
                f"etag {obj['ETag']} size {obj['Size']} modified {obj['LastModified'].isoformat()}"
            )
    return {key: listed.get(key, "missing") for key in keys}


def committed_snapshot(scenario: Scenario, uri: str, storage) -> dict[str, Any]:
    """Every committed object (each complete step's manifest and files, the incarnation
    records) and what identifies its content."""
    from spotrun.checkpoint import catalog
    from spotrun.checkpoint.layout import INCARNATIONS_DIR, file_key

    steps = {}
    for info in catalog.list_steps(storage):
        if info.status == catalog.COMPLETE:
            files = [file_key(info.step, f, info.manifest) for f in info.manifest.files]
            steps[str(info.step)] = [info.manifest_key] + files
    keys = [key for files in steps.values() for key in files]
    keys += [o.key for o in storage.list(f"{INCARNATIONS_DIR}/")]
    return {"committed": steps, "identities": object_identities(scenario, uri, storage, keys)}

"""The other scenarios of ``checkpoint_vs_peers.py``: many tiny tensors, world size 2, S3.

Each returns figure -> list of seconds (one per round); the caller takes medians.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict

from peers import fsync_path

from tests.support.memory_probe import build_training_state, evict_from_page_cache

MIB = 2**20
WORLD2_MARK = "WORLD2-RESULT "


def _timed(samples: dict[str, list[float]], figure: str, fn) -> None:
    started = time.perf_counter()
    fn()
    samples[figure].append(time.perf_counter() - started)


def tiny_tensors(root: str, count: int, rounds: int) -> dict[str, list[float]]:
    """Save and restore ``count`` tensors of 4 float32 each (durable, cold): spotrun
    (``Checkpointer`` of a plain dict: restore replaces its values), DCP (``save``/``load`` in
    place), safetensors (``save_file`` + fsync / ``load_file``)."""
    import torch.distributed.checkpoint as dcp
    from many_tensors import build
    from safetensors.torch import load_file, save_file

    import spotrun
    from spotrun.storage import LocalStorage

    state = build(count, 0, fill=True)
    spot_root, dcp_root, st_path = f"{root}/spotrun", f"{root}/dcp", f"{root}/tiny.safetensors"
    ckpt = spotrun.Checkpointer({"model": state}, storage=LocalStorage(spot_root), handle_signals=False)
    ckpt.restore()
    samples: dict[str, list[float]] = defaultdict(list)
    for step in range(1, rounds + 1):
        for name in os.listdir(spot_root):
            if name.startswith("step-"):
                shutil.rmtree(os.path.join(spot_root, name))
        _timed(samples, "spotrun save", lambda: ckpt.save(step))
        evict_from_page_cache(spot_root)
        _timed(samples, "spotrun restore", ckpt.restore)
        shutil.rmtree(dcp_root, ignore_errors=True)
        _timed(samples, "DCP save", lambda: dcp.save({"model": state}, checkpoint_id=dcp_root))
        evict_from_page_cache(dcp_root)
        _timed(samples, "DCP load", lambda: dcp.load({"model": state}, checkpoint_id=dcp_root))
        _timed(samples, "safetensors save", lambda: (save_file(state, st_path), fsync_path(st_path)))
        evict_from_page_cache(root)
        _timed(samples, "safetensors load", lambda: load_file(st_path))
    return samples


def world2(root: str, size_mib: float, rounds: int) -> dict[str, list[float]]:
    """Replicated state at world size 2 (torchrun, gloo): spotrun ``save`` (each rank writes
    about half) vs DCP ``save`` (its planner spreads replicated tensors over the ranks)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_vs_peers.py"),
        "--world2-worker",
        "--size-mib",
        str(size_mib),
        "--rounds",
        str(rounds),
        "--dir",
        root,
    ]
    proc = subprocess.run(command, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(WORLD2_MARK):
            return json.loads(line[len(WORLD2_MARK) :])
    raise RuntimeError(f"world size 2 run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def world2_worker(root: str, size_mib: float, rounds: int) -> None:
    """One rank of :func:`world2` (started by torchrun)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import spotrun
    from spotrun.storage import LocalStorage

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build_training_state(int(size_mib * MIB))
    spot_root = f"{root}/world2-spotrun"
    ckpt = spotrun.Checkpointer(
        {"model": model, "optimizer": optimizer}, storage=LocalStorage(spot_root), handle_signals=False
    )
    ckpt.restore()
    samples: dict[str, list[float]] = defaultdict(list)

    def collective(figure: str, fn) -> None:
        dist.barrier()
        started = time.perf_counter()
        fn()
        dist.barrier()
        samples[figure].append(time.perf_counter() - started)

    for step in range(1, rounds + 1):
        collective("spotrun save", lambda: ckpt.save(step))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        collective(
            "DCP save",
            lambda: dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/world2-dcp-{step}"),
        )
        dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{root}/world2-dcp-{step}")
            shutil.rmtree(f"{spot_root}/step-{step:09d}")
    if rank == 0:
        print(WORLD2_MARK + json.dumps(samples), flush=True)
    dist.destroy_process_group()


def _delete_prefix(client, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def _server_cpu_s(url: str) -> float:
    """CPU seconds used so far by the moto server listening at ``url`` (found by its port in
    /proc; 0.0 where it cannot be found)."""
    port = url.rsplit(":", 1)[-1].strip("/")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            if not any(b"moto" in part for part in cmdline) or port.encode() not in cmdline:
                continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return 0.0


def _timed_with_cpu(samples: dict[str, list[float]], figure: str, fn, url: str) -> None:
    """Wall seconds, and apart from them this process's and the server's CPU seconds: which
    side a transfer waits on."""
    client_cpu_s, server_cpu_s = time.process_time(), _server_cpu_s(url)
    _timed(samples, figure, fn)
    samples[f"{figure} client cpu"].append(time.process_time() - client_cpu_s)
    samples[f"{figure} server cpu"].append(_server_cpu_s(url) - server_cpu_s)


def s3(size_mib: float, rounds: int) -> dict[str, list[float]]:
    """Against a moto server started here on 127.0.0.1: spotrun ``save``/``restore`` of a
    training state vs boto3's ``upload_file``/``download_file`` of as many bytes (both with
    their default transfer settings)."""
    import spotrun
    from tests.support.s3_server import FAKE_CREDENTIALS, empty_and_delete_bucket, make_client, moto_server

    model, optimizer = build_training_state(int(size_mib * MIB))
    samples: dict[str, list[float]] = defaultdict(list)
    saved_env = dict(os.environ)
    with moto_server() as url, tempfile.TemporaryDirectory(prefix="spotrun-bench-s3-") as scratch:
        os.environ.update(FAKE_CREDENTIALS, AWS_ENDPOINT_URL=url)
        client = make_client(url)
        bucket = f"spotrun-bench-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        try:
            ckpt = spotrun.Checkpointer(
                {"model": model, "optimizer": optimizer}, uri=f"s3://{bucket}/spotrun", handle_signals=False
            )
            ckpt.restore()
            blob = os.path.join(scratch, "blob")
            with open(blob, "wb") as f:
                for per_param in optimizer.state.values():
                    for value in per_param.values():
                        f.write(value.numpy().tobytes())
                for value in model.state_dict().values():
                    f.write(value.numpy().tobytes())
            for step in range(1, rounds + 1):
                _timed_with_cpu(samples, "spotrun save", lambda: ckpt.save(step), url)
                _timed_with_cpu(samples, "spotrun restore", ckpt.restore, url)
                _timed_with_cpu(samples, "boto3 upload_file", lambda: client.upload_file(blob, bucket, "blob"), url)
                _timed_with_cpu(
                    samples,
                    "boto3 download_file",
                    lambda: client.download_file(bucket, "blob", os.path.join(scratch, "copy")),
                    url,
                )
                os.unlink(os.path.join(scratch, "copy"))
                _delete_prefix(client, bucket, f"spotrun/step-{step:09d}/")
            samples["bytes"] = [float(os.path.getsize(blob))]
        finally:
            empty_and_delete_bucket(client, bucket)
            os.environ.clear()
            os.environ.update(saved_env)
    return samples

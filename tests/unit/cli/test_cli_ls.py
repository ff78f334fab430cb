"""`spotrun ls`: what a user sees for complete, incomplete and corrupt steps."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

from tests.jobs.fakeckpt import write_step
from tests.support.paths import GOLDEN, JOBS

CREATED_UNIX_S = 1_764_488_000.5  # 2025-11-30T07:33:20Z


def spotrun_ls(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def bytes_under(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("ls") / "ckpt"
    write_step(str(root), 100, world_size=2, created_unix_s=CREATED_UNIX_S, shard_bytes=3000)
    write_step(str(root), 150, corrupt=True, created_unix_s=CREATED_UNIX_S)
    write_step(str(root), 200, commit=False)
    return root


def test_json_lists_every_step_with_its_status(ckpt):
    done = spotrun_ls(str(ckpt), "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["step"]: row for row in json.loads(done.stdout)}
    assert sorted(rows) == [100, 150, 200]

    complete, corrupt, incomplete = rows[100], rows[150], rows[200]
    assert complete["status"] == "complete" and complete["problem"] is None
    assert complete["world_size"] == 2
    assert complete["reason"] == "periodic"
    assert complete["created_unix_s"] == CREATED_UNIX_S
    assert corrupt["status"] == "corrupt" and "rank-00000." in corrupt["problem"]
    assert incomplete["status"] == "incomplete" and "manifest" in incomplete["problem"]
    assert incomplete["world_size"] is None
    for step, row in rows.items():
        assert row["size_bytes"] == bytes_under(ckpt / f"step-{step:09d}")


def test_table_shows_status_size_and_utc_time(ckpt):
    done = spotrun_ls(str(ckpt))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:2] == ["STEP", "STATUS"]
    by_step = {line.split()[0]: line for line in lines[1:]}
    assert sorted(by_step) == ["100", "150", "200"]
    assert by_step["100"].split()[1] == "complete"
    assert by_step["150"].split()[1] == "corrupt"
    assert by_step["200"].split()[1] == "incomplete"
    assert time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(CREATED_UNIX_S)) in by_step["100"]
    size_kib = bytes_under(ckpt / "step-000000100") / 1024
    assert f"{size_kib:.1f} KiB" in by_step["100"]
    assert "has 100 bytes, manifest recorded 101" in by_step["150"]


def test_file_uri_lists_the_same_steps(ckpt):
    done = spotrun_ls(f"file://{ckpt}", "--json")
    assert done.returncode == 0, done.stderr
    assert [row["step"] for row in json.loads(done.stdout)] == [100, 150, 200]


def test_6_ls_of_a_missing_directory_exits_2(tmp_path):
    """Like ls: a root that does not exist is an error (one line, exit 2), as a table or as JSON."""
    missing = tmp_path / "never-written"
    for args in ([str(missing)], [str(missing), "--json"], [f"file://{missing}"]):
        done = spotrun_ls(*args)
        assert (done.returncode, done.stdout) == (2, ""), args
        [line] = done.stderr.splitlines()
        assert line == f"spotrun: error: no such directory: {missing}"
    assert not missing.exists(), "listing must not create the directory"


def test_6_ls_of_an_empty_directory_exits_0(tmp_path):
    as_table = spotrun_ls(str(tmp_path))
    assert as_table.returncode == 0 and as_table.stdout == f"no checkpoints under {tmp_path}\n"
    as_json = spotrun_ls(str(tmp_path), "--json")
    assert (as_json.returncode, json.loads(as_json.stdout)) == (0, [])


def test_6_ls_of_an_s3_prefix_with_nothing_under_it_exits_2(s3_bucket):
    """S3 has no directories: a prefix exists when some object is stored under it."""
    write_step(f"{s3_bucket.uri}/job", 7)
    done = spotrun_ls(f"{s3_bucket.uri}/other-job")
    assert (done.returncode, done.stdout) == (2, "")
    [line] = done.stderr.splitlines()
    assert line == f"spotrun: error: nothing is stored under {s3_bucket.uri}/other-job (no such prefix)"
    assert spotrun_ls(f"{s3_bucket.uri}/job").returncode == 0


@pytest.mark.parametrize("uri", ["ftp://host/ckpt", ""])
def test_bad_uri_is_one_error_line_and_exit_2(uri):
    done = spotrun_ls(uri)
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("spotrun: error: ")


def test_s3_uri_lists_the_same_statuses(s3_bucket):
    uri = f"{s3_bucket.uri}/job"
    write_step(uri, 7)
    write_step(uri, 8, corrupt=True)
    write_step(uri, 9, commit=False)
    done = spotrun_ls(uri, "--json")  # the fixture's AWS_ENDPOINT_URL reaches the child
    assert done.returncode == 0, done.stderr
    assert [(r["step"], r["status"]) for r in json.loads(done.stdout)] == [
        (7, "complete"),
        (8, "corrupt"),
        (9, "incomplete"),
    ]


def test_missing_bucket_is_one_error_line_and_exit_2(s3_bucket):
    done = spotrun_ls(f"{s3_bucket.uri}-does-not-exist/job")
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("spotrun: error: ") and "does-not-exist" in line


# --- layout: world size and mesh shapes --------------------------------------------------------

BG_JOB = JOBS / "bg_job.py"


@pytest.fixture(scope="module")
def meshes_root(tmp_path_factory) -> pathlib.Path:
    """Manifests with meshes, as the sharded save records them (written through Manifest)."""
    root = tmp_path_factory.mktemp("ls-meshes") / "ckpt"
    write_step(str(root), 10, world_size=2)  # DDP state: no mesh
    write_step(str(root), 20, world_size=4, meshes=[{"shape": [2, 2], "dim_names": ["dp_replicate", "dp_shard"]}])
    write_step(
        str(root), 30, world_size=8, meshes=[{"shape": [2, 4], "dim_names": None}, {"shape": [8], "dim_names": None}]
    )
    write_step(str(root), 40, commit=False)
    return root


def test_layout_column_shows_world_size_and_mesh_shapes(meshes_root):
    done = spotrun_ls(str(meshes_root))
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    layout_at = header.index("LAYOUT")
    size_at = header.index("SIZE")
    layouts = {line.split()[0]: line[layout_at:size_at].strip() for line in lines}
    assert layouts == {"10": "2 ranks", "20": "4 ranks, mesh 2x2", "30": "8 ranks, meshes 2x4 and 8", "40": "-"}


def test_layout_in_json_lists_meshes_with_their_dimension_names(meshes_root):
    done = spotrun_ls(str(meshes_root), "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["step"]: row for row in json.loads(done.stdout)}
    assert rows[10]["world_size"] == 2 and rows[10]["meshes"] == [] and rows[10]["layout"] == "2 ranks"
    assert rows[20]["world_size"] == 4 and rows[20]["layout"] == "4 ranks, mesh 2x2"
    assert rows[20]["meshes"] == [{"shape": [2, 2], "dim_names": ["dp_replicate", "dp_shard"]}]
    assert rows[30]["meshes"] == [{"shape": [2, 4], "dim_names": None}, {"shape": [8], "dim_names": None}]
    assert rows[40]["status"] == "incomplete"
    assert (rows[40]["world_size"], rows[40]["meshes"], rows[40]["layout"]) == (None, None, None)


@pytest.mark.parametrize("golden", ["golden-v1", "golden-v2"])
def test_layout_of_manifests_written_before_meshes_shows_their_ranks(golden):
    """Format 1 and 2 manifests have no meshes field: listed with their world size, meshes []."""
    [row] = json.loads(spotrun_ls(str(GOLDEN / golden), "--json").stdout)
    assert (row["status"], row["world_size"], row["meshes"], row["layout"]) == ("complete", 1, [], "1 rank")
    table = spotrun_ls(str(GOLDEN / golden)).stdout.splitlines()
    assert table[0].split()[:3] == ["STEP", "STATUS", "LAYOUT"]
    assert " 1 rank " in table[1]


@pytest.mark.slow
def test_layout_of_a_real_two_rank_save(tmp_path):
    """A real Checkpointer on 2 ranks (torchrun, gloo) saves replicated state: `2 ranks`, no mesh."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(BG_JOB),
            str(ck),
            str(out),
            "--steps",
            "2",
            "--interval",
            "0",
        ],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=300,
    )
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    [row] = json.loads(spotrun_ls(str(ck), "--json").stdout)
    assert (row["step"], row["status"], row["reason"]) == (2, "complete", "final")
    assert (row["world_size"], row["meshes"], row["layout"]) == (2, [], "2 ranks")
    [_header, line] = spotrun_ls(str(ck)).stdout.splitlines()
    assert line.split()[:4] == ["2", "complete", "2", "ranks"]


# --- the fast tier: steps held in this machine's memory ------------------------------------------


@pytest.fixture
def tiered_root(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """A root with steps 20 and 40 on storage, and a live fast tier (owned by this test process,
    as a running `spotrun run` owns its own) holding steps 24 and 26 of it; another root's tier too."""
    from spotrun.storage.tier_dir import create_tier

    root, memory_dir = tmp_path / "ckpt", tmp_path / "mem"
    write_step(str(root), 20, created_unix_s=CREATED_UNIX_S)
    write_step(str(root), 40, created_unix_s=CREATED_UNIX_S)
    tier = create_tier(str(memory_dir), str(root))
    write_step(tier.steps_root, 24, reason="memory", created_unix_s=CREATED_UNIX_S)
    write_step(tier.steps_root, 26, reason="memory", created_unix_s=CREATED_UNIX_S, world_size=2)
    other = create_tier(str(memory_dir), str(tmp_path / "other-job"))
    write_step(other.steps_root, 99, reason="memory")
    return root, memory_dir


def test_json_gives_every_step_its_tier_memory_or_storage(tiered_root):
    root, memory_dir = tiered_root
    done = spotrun_ls(str(root), "--json", "--memory-dir", str(memory_dir))
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["step"], r["tier"], r["status"]) for r in rows] == [
        (20, "storage", "complete"),
        (24, "memory", "complete"),
        (26, "memory", "complete"),
        (40, "storage", "complete"),
    ]
    assert rows[2]["layout"] == "2 ranks" and rows[2]["reason"] == "memory"


def test_the_tier_of_a_root_is_found_under_any_spelling_of_the_root(tiered_root):
    """`spotrun run` records the root as the workers get it (absolute); `ls` may name it relatively or as file://."""
    root, memory_dir = tiered_root
    for uri, cwd in ((f"file://{root}", None), ("ckpt", root.parent), ("./ckpt/", root.parent)):
        done = spotrun_ls(uri, "--json", "--memory-dir", str(memory_dir), cwd=cwd)
        assert done.returncode == 0, done.stderr
        assert [r["step"] for r in json.loads(done.stdout) if r["tier"] == "memory"] == [24, 26], uri


def test_table_has_a_tier_column_when_the_fast_tier_holds_steps(tiered_root):
    root, memory_dir = tiered_root
    done = spotrun_ls(str(root), "--memory-dir", str(memory_dir))
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    assert header.split()[:3] == ["STEP", "TIER", "STATUS"]
    assert [line.split()[:3] for line in lines] == [
        ["20", "storage", "complete"],
        ["24", "memory", "complete"],
        ["26", "memory", "complete"],
        ["40", "storage", "complete"],
    ]


def test_a_root_without_a_fast_tier_lists_as_before(ckpt, tiered_root):
    """No TIER column (the table scripts read stays as it was); in JSON every step is on storage."""
    _root, memory_dir = tiered_root
    header = spotrun_ls(str(ckpt), "--memory-dir", str(memory_dir)).stdout.splitlines()[0]
    assert header.split() == ["STEP", "STATUS", "LAYOUT", "SIZE", "TIME", "(UTC)", "REASON", "PROBLEM"]
    rows = json.loads(spotrun_ls(str(ckpt), "--json", "--memory-dir", str(memory_dir)).stdout)
    assert {r["tier"] for r in rows} == {"storage"}


def test_a_stale_tier_of_the_root_is_named_and_not_listed(tmp_path):
    """Its `spotrun run` is gone (SIGKILLed): never resumed from, so its steps are not shown as loadable."""
    from spotrun.storage.tier_dir import OWNER_FILE, create_tier

    root, memory_dir = tmp_path / "ckpt", tmp_path / "mem"
    write_step(str(root), 20)
    tier = create_tier(str(memory_dir), str(root))
    write_step(tier.steps_root, 26, reason="memory")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = json.loads((pathlib.Path(tier.path) / OWNER_FILE).read_text())
    owner["pid"] = int(gone.stdout)
    (pathlib.Path(tier.path) / OWNER_FILE).write_text(json.dumps(owner))

    done = spotrun_ls(str(root), "--json", "--memory-dir", str(memory_dir))
    assert done.returncode == 0, done.stderr
    assert [(r["step"], r["tier"]) for r in json.loads(done.stdout)] == [(20, "storage")]
    assert f"the fast tier {tier.path} of this root is stale" in done.stderr
    assert pathlib.Path(tier.path).exists(), "ls only reads: the next spotrun run removes a stale tier"

"""End to end on ``gs://`` (the GCS emulator) and ``az://`` (Azurite): the example trainer under
`spotrun run`, preempted by SIGTERM (exit 143), resumes bit-exactly; a corrupted shard makes the
next start fall back; and a root that cannot work (a missing bucket or container, no
credentials, the extra not installed) stops `spotrun run` with one line and exit 2 before
anything is launched.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from spotrun.checkpoint import catalog
from spotrun.storage import open_storage
from tests.support.ckpt_files import shard_key
from tests.support.trainrun import (
    REFERENCE_SAVE_INTERVAL,
    REFERENCE_STEPS,
    preempt_and_resume_exactly,
    read_log,
    start_supervised,
    torchrun_command,
)

BACKENDS = ["gcs", "azure"]


@pytest.fixture
def cloud_root(request):
    """``(backend, bucket or container fixture)`` of the test's parameter."""
    fixture = {"gcs": "gcs_bucket", "azure": "azure_container"}[request.param]
    return request.param, request.getfixturevalue(fixture)


def spotrun(*args: str, env: dict[str, str] | None = None, python_prelude: str = "") -> subprocess.CompletedProcess:
    """``spotrun ARGS`` in a process of its own; ``python_prelude`` runs first in it."""
    code = f"{python_prelude}\nimport sys\nfrom spotrun.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=180, env=env)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("spotrun: error: ")]


@pytest.mark.slow
@pytest.mark.parametrize("cloud_root", BACKENDS, indirect=True)
def test_preempted_training_resumes_exactly_and_falls_back_from_a_corrupted_shard(
    cloud_root, reference, tmp_path, processes
):
    _, root = cloud_root
    uri = f"{root.uri}/team/run-1"
    preempt_and_resume_exactly(reference, uri, tmp_path, processes)

    storage = open_storage(uri)
    steps = [s.step for s in catalog.list_steps(storage) if s.status == catalog.COMPLETE]
    key = shard_key(storage, REFERENCE_STEPS, 1)
    data = bytearray(storage.get(key))
    data[-1] ^= 0xFF
    storage.put(key, bytes(data))
    log_file = tmp_path / "train.jsonl"
    ran_before = len(read_log(log_file))
    proc = start_supervised(
        uri,
        torchrun_command(REFERENCE_STEPS, REFERENCE_SAVE_INTERVAL, log_file),
        extra_options=["--notice", "none", "--rerun-finished"],
        log_path=tmp_path / "third.log",
    )
    processes.append(proc)
    assert proc.wait(timeout=600) == 0, (tmp_path / "third.log").read_text()[-3000:]
    log_text = (tmp_path / "third.log").read_text()
    assert f"checkpoint step {REFERENCE_STEPS} failed verification" in log_text
    assert f"falling back to step {steps[-2]}" in log_text
    rerun = [row["step"] for row in read_log(log_file)[ran_before:]]
    assert rerun == list(range(steps[-2] + 1, REFERENCE_STEPS + 1))


def run_that_must_not_start(uri: str, tmp_path, **kwargs) -> subprocess.CompletedProcess:
    marker = tmp_path / "launched"
    done = spotrun("run", "--checkpoint-uri", uri, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", **kwargs)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists(), "the command must not start when the storage is unusable"
    [line] = error_lines(done.stderr)
    return line


@pytest.mark.parametrize("cloud_root", BACKENDS, indirect=True)
def test_a_missing_bucket_or_container_stops_the_run_before_it_starts(cloud_root, tmp_path):
    backend, root = cloud_root
    line = run_that_must_not_start(f"{root.uri}-gone/job", tmp_path)
    what = {"gcs": "bucket", "azure": "container"}[backend]
    assert "preflight" in line and f"{what} '{root.name}-gone' does not exist" in line


@pytest.mark.parametrize("cloud_root", BACKENDS, indirect=True)
def test_missing_credentials_stop_the_run_before_it_starts(cloud_root, tmp_path, monkeypatch):
    backend, root = cloud_root
    if backend == "gcs":  # no emulator, no key file, no gcloud login, no metadata server
        monkeypatch.delenv("STORAGE_EMULATOR_HOST")
        monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
        monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
        monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
        expected = "GOOGLE_APPLICATION_CREDENTIALS"
    else:  # no connection string and no account for DefaultAzureCredential
        monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
        monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
        expected = "AZURE_STORAGE_CONNECTION_STRING"
    line = run_that_must_not_start(f"{root.uri}/job", tmp_path)
    assert expected in line


BLOCK_IMPORTS = textwrap.dedent(
    """
    import importlib.abc, sys
    class _NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, _NotInstalled())
    """
)


@pytest.mark.parametrize(
    ("uri", "blocked", "extra"), [("gs://bucket/job", "google", "gcs"), ("az://container/job", "azure", "azure")]
)
def test_a_missing_extra_stops_the_run_before_it_starts_naming_the_extra(uri, blocked, extra, tmp_path):
    line = run_that_must_not_start(uri, tmp_path, python_prelude=BLOCK_IMPORTS.format(blocked={blocked}))
    assert f"pip install 'spotrun[{extra}]'" in line

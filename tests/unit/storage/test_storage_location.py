"""``parse_location``: one object answers the backend questions (which store, remote or not, the
workers' environment, a scratch root beside it, whether the root exists)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from spotrun.control import env as spotrun_env
from spotrun.errors import ConfigError, ObjectNotFoundError
from spotrun.storage import LocalStorage, StorageLocation, parse_location
from spotrun.storage.location import BACKENDS
from spotrun.storage.s3_location import S3_ENDPOINT_URL


def test_every_registered_backend_is_a_location_class():
    for scheme, target in BACKENDS.items():
        module_name, _, class_name = target.partition(":")
        location_class = getattr(importlib.import_module(module_name), class_name)
        assert issubclass(location_class, StorageLocation), scheme


@pytest.mark.parametrize("given", ["ck", "file://ck"])
def test_a_path_or_file_uri_is_a_local_directory(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    location = parse_location(f" {given} ", endpoint_url="http://minio:9000")
    assert not location.is_remote and location.uri == str(tmp_path / "ck")
    storage = location.open()
    assert isinstance(storage, LocalStorage) and storage.uri == location.uri
    assert location.worker_env() == {spotrun_env.CHECKPOINT_URI: str(tmp_path / "ck")}  # no endpoint


def test_an_s3_uri_is_remote_and_passes_its_endpoint_to_the_workers():
    location = parse_location("s3://bucket/jobs/a/", endpoint_url="http://minio:9000")
    assert location.is_remote and location.uri == "s3://bucket/jobs/a"
    assert location.worker_env() == {
        spotrun_env.CHECKPOINT_URI: "s3://bucket/jobs/a/",
        S3_ENDPOINT_URL: "http://minio:9000",
    }
    assert S3_ENDPOINT_URL not in parse_location("s3://bucket/jobs/a").worker_env()


def test_parsing_an_s3_uri_imports_no_boto3():
    code = (
        "import sys; from spotrun.storage import parse_location; "
        "assert parse_location('s3://bucket/job').is_remote; assert 'boto3' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("uri", "endpoint", "message"),
    [
        ("", None, "checkpoint URI is empty"),
        (
            "hdfs://namenode/job",
            None,
            r"unsupported checkpoint URI scheme in 'hdfs://namenode/job': use a local path, "
            r"file://, s3://, gs:// or az://",
        ),
        ("./ck", "minio:9000", "--s3-endpoint-url must be an http:// or https:// URL"),
    ],
)
def test_bad_uri_or_endpoint_is_a_config_error(uri, endpoint, message):
    with pytest.raises(ConfigError, match=message):
        parse_location(uri, endpoint_url=endpoint)


def test_scratch_sibling_of_a_local_root_is_a_new_temporary_directory(tmp_path):
    sibling = parse_location(str(tmp_path / "ck")).scratch_sibling("drill-reference")
    try:
        assert sibling.temporary_dir == sibling.location.uri and os.listdir(sibling.temporary_dir) == []
        assert os.path.basename(sibling.temporary_dir).startswith("spotrun-drill-reference-")
    finally:
        os.rmdir(sibling.temporary_dir)


def test_scratch_sibling_of_an_s3_root_is_beside_its_prefix_with_the_same_endpoint():
    sibling = parse_location("s3://bucket/jobs/a/", endpoint_url="http://minio:9000").scratch_sibling("drill-reference")
    assert sibling.temporary_dir is None and sibling.location.endpoint_url == "http://minio:9000"
    parent, _, name = sibling.location.uri.rpartition("/")
    assert parent == "s3://bucket/jobs/a-drill-reference" and len(name) == 12
    bucket_wide = parse_location("s3://bucket").scratch_sibling("drill-reference")
    assert bucket_wide.location.uri.startswith("s3://bucket/spotrun-drill-reference/")


def test_open_existing_refuses_a_missing_local_root_and_accepts_an_empty_one(tmp_path):
    with pytest.raises(ObjectNotFoundError, match=f"no such directory: {tmp_path / 'nope'}"):
        parse_location(str(tmp_path / "nope")).open_existing()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ObjectNotFoundError, match="not a directory"):
        parse_location(str(tmp_path / "a-file")).open_existing()
    assert parse_location(str(tmp_path / "a-file")).blocked_by_file()
    (tmp_path / "empty").mkdir()
    assert parse_location(str(tmp_path / "empty")).open_existing().list("") == []
    assert not parse_location(str(tmp_path / "empty")).blocked_by_file()


@pytest.mark.parametrize("uri", ["gs:/bucket/job", "az:/container/job", "s3:/bucket/job", "GS:/bucket/job"])
def test_a_scheme_with_one_slash_is_refused_not_taken_for_a_local_directory(uri):
    with pytest.raises(ConfigError, match="one slash"):
        parse_location(uri)


@pytest.mark.parametrize("uri", ["s3://bucket//job", "gs://bucket//job", "az://container//job"])
def test_an_empty_path_component_right_after_the_bucket_is_refused_like_any_other(uri):
    with pytest.raises(ConfigError, match="empty path component"):
        parse_location(uri)

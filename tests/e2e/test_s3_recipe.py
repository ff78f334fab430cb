"""docs/guide/s3.md's recipes, read out of the file and run as printed against a real moto server
(issue 20, from a new user's trial: no recipe took an S3 root from nothing to a running job)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.support.paths import REPO
from tests.support.s3_server import moto_server

RECIPE = REPO / "docs" / "guide" / "s3.md"
#: The port the recipe names; the test's own server listens on a free one instead.
RECIPE_ENDPOINT = "http://127.0.0.1:5000"


def recipe_blocks() -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", RECIPE.read_text(), re.S | re.M)


def block_with(text: str) -> str:
    [block] = [b for b in recipe_blocks() if text in b]
    return block


def clean_env(tmp_path: pathlib.Path, **extra: str) -> dict[str, str]:
    """This environment without any AWS setting (no real account is ever reached), with the
    virtual environment's commands on the PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        HOME=str(tmp_path),
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
    )
    env.update(extra)
    return env


def run_script(script: str, cwd: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_moto_recipe_starts_the_server_the_commands_use():
    server = block_with("moto_server")
    assert server.splitlines() == ["pip install 'moto[server]'", "moto_server -p 5000"]
    assert RECIPE_ENDPOINT in block_with("create_bucket")


@pytest.mark.slow
def test_the_moto_recipe_runs_a_job_on_s3_as_printed(tmp_path):
    """issue 20: bucket, preflight, a supervised 2-rank run and `spotrun ls`, through
    AWS_ENDPOINT_URL only."""
    with moto_server() as url:
        done = run_script(block_with("create_bucket").replace(RECIPE_ENDPOINT, url), tmp_path, clean_env(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "ok: s3://ckpt/gpt can be written, read, listed and deleted" in done.stdout
    [row] = [line.split() for line in done.stdout.splitlines() if line.startswith("20 ")]
    assert row[1] == "complete", done.stdout
    assert "training finished: the checkpoint is step 20 under s3://ckpt/gpt" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("aws") is None, reason="the AWS recipe's commands need the aws command line")
def test_the_aws_recipe_runs_as_printed_against_moto(tmp_path):
    """The AWS block, with its profile written to a credentials file and AWS_ENDPOINT_URL pointing
    at moto (the one setting added), and fewer steps."""
    block = block_with("aws s3 mb")
    [profile] = re.findall(r"^export AWS_PROFILE=(\S+)", block, re.M)
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[{profile}]\naws_access_key_id = testing\naws_secret_access_key = testing\nregion = us-east-1\n"
    )
    with moto_server() as url:
        env = clean_env(tmp_path, AWS_SHARED_CREDENTIALS_FILE=str(credentials), AWS_ENDPOINT_URL=url)
        done = run_script(block.replace("--steps 600", "--steps 20"), tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "make_bucket: my-ckpt-bucket" in done.stdout
    [row] = [line.split() for line in done.stdout.splitlines() if line.startswith("20 ")]
    assert row[1] == "complete", done.stdout

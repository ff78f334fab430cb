"""Issue 12, item 1: spotrun installs into an environment that already holds torch and
another boto3, older or newer, without changing what is there.

A fresh virtual environment already holds torch (this environment's install of it,
hard-linked file by file from its RECORD so that no 900 MB wheel is unpacked again;
removing a link there leaves the original) and boto3 and botocore at spotrun's lower
bounds, read from pyproject.toml. spotrun is installed into it with pip from a wheel of
this checkout; then again after boto3 is upgraded to the newest release the index has
(newer than 1.43.117, the last one the former pin accepted). Each time no distribution
that was there before changes version, and ``spotrun --help``, ``spotrun preflight`` on
a local root and the making of spotrun's S3 client succeed in that environment.

Needs the package index (boto3 and spotrun's other dependencies are downloaded, or taken
from pip's cache); without it the test fails and says so."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.support.paths import REPO

pytestmark = pytest.mark.slow

REPO_ROOT = REPO
#: The last boto3 release the former pin (">=1.43.115,<1.43.118") accepted.
FORMER_PIN_NEWEST = "1.43.117"
PIP_TIMEOUT_S = 240


def lower_bound(name: str) -> str:
    """The ``X`` of ``"name>=X"`` in pyproject.toml's runtime dependencies."""
    match = re.search(rf'"{name}>=([0-9.]+)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert match, f"pyproject.toml declares no {name}>= lower bound"
    return match.group(1)


def _distribution_closure(name: str) -> list[importlib.metadata.Distribution]:
    """``name``'s distribution in this environment and those it requires (no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [name]
    while pending:
        dist = importlib.metadata.distribution(pending.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found:
            continue
        found[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                pending.append(req.name)
    return list(found.values())


def _link_installed(dists: list[importlib.metadata.Distribution], site_packages: Path) -> None:
    """Give ``site_packages`` the installed files of ``dists`` (their RECORD), hard-linked
    where the filesystem allows, else copied. Scripts outside site-packages are left out:
    their first line names this environment's interpreter."""
    for dist in dists:
        for entry in dist.files or []:
            if entry.parts[0] == "..":
                continue
            source = Path(dist.locate_file(entry))
            if not source.is_file():
                continue  # RECORD may list files a later step removed
            target = site_packages / entry
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)


@pytest.fixture
def scratch(tmp_path):
    """A directory on the filesystem of this environment's packages (so hard links work)
    when it can be made there, else ``tmp_path``; removed afterwards."""
    try:
        path = Path(tempfile.mkdtemp(prefix=".install-test-", dir=sys.prefix))
    except OSError:
        yield tmp_path
        return
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run(args: list[str], env: dict[str, str], what: str, timeout_s: float = PIP_TIMEOUT_S) -> str:
    """Run ``args``; fail the test naming ``what`` and showing the output unless it exits 0."""
    needs_index = args[1:4] == ["-m", "pip", "install"]
    hint = "; this test needs the package index (network, or a mirror pip is configured for)"
    try:
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{what} took more than {timeout_s} s{hint if needs_index else ''}\n"
            f"$ {' '.join(args)}\n{exc.stdout or ''}\n{exc.stderr or ''}"
        )
    assert proc.returncode == 0, (
        f"{what} failed (exit {proc.returncode}){hint if needs_index else ''}\n$ {' '.join(args)}\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def _versions(python: Path, env: dict[str, str]) -> dict[str, str]:
    """Every distribution installed in ``python``'s environment: name -> version."""
    out = _run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m; "
            "print('\\n'.join(f\"{d.metadata['Name'].lower()}=={d.version}\" "
            "for d in m.distributions()))",
        ],
        env,
        "listing installed distributions",
    )
    return dict(line.split("==", 1) for line in out.split())


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_spotrun_installs_next_to_an_older_and_a_newer_boto3_without_changing_either(scratch):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    venv = scratch / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            env,
            "asking the new venv for its site-packages",
        ).strip()
    )
    _link_installed(_distribution_closure("torch") + _distribution_closure("pip"), site_packages)
    pip = [str(python), "-m", "pip"]

    # A wheel of this checkout, built from a copy so that the checkout gets no build/ files.
    source = scratch / "source"
    shutil.copytree(REPO_ROOT / "spotrun", source / "spotrun", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    # torch requires setuptools: then the build uses the venv's own instead of downloading it.
    own_setuptools = ["--no-build-isolation"] if (site_packages / "setuptools").is_dir() else []
    _run(
        pip + ["wheel", "--no-deps", *own_setuptools, "-q", "-w", str(scratch / "wheels"), str(source)],
        env,
        "building spotrun's wheel",
    )
    (wheel,) = (scratch / "wheels").glob("spotrun-*.whl")

    root = scratch / "checkpoints"
    oldest = [f"boto3=={lower_bound('boto3')}", f"botocore=={lower_bound('botocore')}"]
    for boto3_specs in (oldest, [f"boto3>{FORMER_PIN_NEWEST}"]):
        _run(pip + ["install", "-q", "--no-compile", *boto3_specs], env, f"installing {boto3_specs}")
        before = _versions(python, env)
        _run(pip + ["install", "-q", "--no-compile", str(wheel)], env, "installing spotrun")
        after = _versions(python, env)
        changed = {name: (version, after.get(name)) for name, version in before.items() if after.get(name) != version}
        assert changed == {}, f"installing spotrun next to {boto3_specs} changed {changed}"
        if boto3_specs is oldest:
            assert [f"boto3=={after['boto3']}", f"botocore=={after['botocore']}"] == oldest
        else:
            assert _version_tuple(after["boto3"]) > _version_tuple(FORMER_PIN_NEWEST)

        assert "spotrun" in after
        spotrun = str(venv / "bin" / "spotrun")
        assert "preflight" in _run([spotrun, "--help"], env, "spotrun --help", timeout_s=60)
        report = _run(
            [spotrun, "preflight", str(root)], env, f"spotrun preflight next to boto3 {after['boto3']}", timeout_s=60
        )
        assert report.startswith(f"ok: {root} ")
        # The S3 backend's client (spotrun's botocore Config) is accepted by this botocore.
        _run(
            [
                str(python),
                "-c",
                "from spotrun.storage.s3_config import S3Options, make_client; "
                "make_client(S3Options(endpoint_url='http://127.0.0.1:9'))",
            ],
            env,
            f"making spotrun's S3 client with boto3 {after['boto3']}",
            timeout_s=60,
        )
        _run(pip + ["uninstall", "-y", "-q", "spotrun"], env, "uninstalling spotrun")

"""Issue 8, section 3, on a real filesystem without hard links: a FUSE mount.

``tests/support/nolink_fs.py`` is a passthrough FUSE filesystem (libfuse 3, mounted by the test
as root) whose ``link`` is not implemented: ``link(2)`` fails there with ``EPERM``, as on
the FUSE mounts of object stores. Two variants of its rename:

* it keeps ``RENAME_NOREPLACE``: spotrun commits with it; the preflight passes and a
  2-rank job is preempted and resumes exactly from a checkpoint root on the mount;
* it refuses the flag (``EINVAL``, as every filesystem served by libfuse 2 does): nothing
  can commit without risking an overwrite, so ``spotrun run`` fails before launching,
  exit 2, naming both missing features.

The fixture installs Debian's ``libfuse3-3`` with apt-get where it is missing, and skips
with the reason where FUSE cannot be mounted (no ``/dev/fuse``, not root, no libfuse 3).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from spotrun.storage import local as local_backend
from spotrun.storage import parse_location
from spotrun.supervisor.preflight import check_storage
from tests.support.trainrun import preempt_and_resume_exactly
from tests.unit.storage.test_commit_primitive import error_line, spotrun_cli

#: The Debian package of libfuse 3 (mfusepy, a test extra, binds it with ctypes).
LIBFUSE3_PACKAGE = "libfuse3-3"
MOUNT_TIMEOUT_S = 60.0
INSTALL_TIMEOUT_S = 600.0


def _libfuse3() -> str | None:
    return ctypes.util.find_library("fuse3")


def _fuse_unavailable() -> str | None:
    """Why a FUSE filesystem cannot be mounted here (``None`` when it can)."""
    if not sys.platform.startswith("linux"):
        return "FUSE mounts are tested on Linux only"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if os.geteuid() != 0:
        return "mounting without fusermount3 needs root"
    if _libfuse3() is None:
        if shutil.which("apt-get") is None:
            return f"libfuse 3 missing and no apt-get to install {LIBFUSE3_PACKAGE}"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", LIBFUSE3_PACKAGE]):
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=INSTALL_TIMEOUT_S
            )
            if done.returncode != 0:
                return f"{' '.join(command)} failed: {(done.stdout + done.stderr).strip()[-800:]}"
        if _libfuse3() is None:
            return f"libfuse 3 still missing after installing {LIBFUSE3_PACKAGE}"
    return None


@contextlib.contextmanager
def nolink_mount(backing, mountpoint, rename_flags: str) -> Iterator[str]:
    """Mount ``tests/support/nolink_fs.py`` over ``backing`` at ``mountpoint``; yields the mount path."""
    backing.mkdir()
    mountpoint.mkdir()
    log_path = mountpoint.parent / f"nolink-fs-{rename_flags}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.nolink_fs",
                str(backing),
                str(mountpoint),
                "--rename-flags",
                rename_flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "FUSE_LIBRARY_PATH": _libfuse3()},
        )
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the FUSE filesystem did not mount: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)  # polling a condition, not synchronising on time
        yield str(mountpoint)
    finally:
        if os.path.ismount(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def fuse_available() -> None:
    reason = _fuse_unavailable()
    if reason is not None:
        pytest.skip(f"cannot mount a FUSE filesystem: {reason}")


def files_under(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)


def test_3_fuse_mount_really_has_no_hard_links(fuse_available, tmp_path):
    with nolink_mount(tmp_path / "backing", tmp_path / "mnt", "honour") as mnt:
        with open(os.path.join(mnt, "a"), "w") as f:
            f.write("a")
        with pytest.raises(PermissionError):  # the kernel reports the FS's ENOSYS as EPERM
            os.link(os.path.join(mnt, "a"), os.path.join(mnt, "b"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_3_local_root_on_fuse_without_hard_links_commits_with_rename_noreplace(
    fuse_available, reference, tmp_path, processes
):
    with nolink_mount(tmp_path / "backing", tmp_path / "mnt", "honour") as mnt:
        root = os.path.join(mnt, "ck")
        assert check_storage(parse_location(root)).commit_primitive == local_backend.RENAME_NOREPLACE
        done = spotrun_cli("preflight", root)
        assert done.returncode == 0 and "rename without replace" in done.stdout, done.stderr
        preempt_and_resume_exactly(reference, root, tmp_path, processes)
        assert os.path.exists(os.path.join(root, "step-000000030"))


def test_3_local_root_on_fuse_without_rename_noreplace_fails_preflight(fuse_available, tmp_path):
    with nolink_mount(tmp_path / "backing", tmp_path / "mnt", "refuse") as mnt:
        root = os.path.join(mnt, "ck")
        marker = tmp_path / "launched"
        done = spotrun_cli(
            "run",
            "--checkpoint-uri",
            root,
            "--notice",
            "none",
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        )
        assert done.returncode == 2, done.stderr
        line = error_line(done.stderr)
        assert "preflight" in line and "no hard links (link: Operation not permitted)" in line
        assert "RENAME_NOREPLACE: Invalid argument" in line and "s3://" in line
        assert "Traceback" not in done.stderr
        assert not marker.exists(), "the job must not start on a root that cannot commit"
        assert files_under(tmp_path / "backing") == []  # the probes are gone

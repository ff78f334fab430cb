"""Fixtures shared by the whole suite: S3 servers, `spotrun run` around fake jobs, the reference run.

The suite runs in two processes (pytest-xdist, ``-n 2`` in pyproject.toml): many tests wait on
clocks (a 36 s save, a deadline, a slow store) rather than on the CPU. Session fixtures run once
per process, except where they say otherwise (:func:`reference`: once per run, by file lock).
"""

import gc
import pathlib
import signal
import threading
import time

import pytest
from filelock import FileLock

# Helpers keep pytest's assertion messages (they were test modules' own functions before).
pytest.register_assert_rewrite("tests.support")

# The S3 servers, the Ceph gateway and the GCS and Azure emulators, as fixtures for every test
# (started only when asked for).
from tests.support.azurite_server import azure_container, azurite_endpoint  # noqa: E402, F401
from tests.support.fake_launch import Spotrun  # noqa: E402
from tests.support.gcs_server import gcs_bucket, gcs_endpoint  # noqa: E402, F401
from tests.support.rgw_server import rgw_bucket, rgw_endpoint  # noqa: E402, F401
from tests.support.s3_server import moto_endpoint, moto_endpoint_enforcing_auth, s3_bucket  # noqa: E402, F401
from tests.support.trainrun import (  # noqa: E402
    REFERENCE_SAVE_INTERVAL,
    REFERENCE_STEPS,
    final_tensors,
    kill_tree,
    last_loss_per_step,
    start_supervised,
    torchrun_command,
)


@pytest.fixture(autouse=True)
def _signal_mask_restored():
    """An in-process emergency save blocks SIGCHLD in the main thread for good (the process is
    meant to exit right after); restore the test process's mask so later tests do not inherit it."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


#: How long threads a test started may take to end after it, in seconds (a thread may be finishing).
THREAD_END_WAIT_S = 10.0


def _spotrun_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("spotrun") and t.is_alive()}


def _close_what_is_left_open() -> None:
    """Close what a test left open, while its fixtures (a moto server, a proxy) still run:
    Checkpointers still reachable, and the background savers and event logs of those already
    dropped (their threads hold them; closing twice is harmless)."""
    import spotrun
    from spotrun.checkpoint.background import BackgroundSaver
    from spotrun.eventlog.records import EventLog

    kinds = ((spotrun.Checkpointer, "close"), (BackgroundSaver, "shutdown"), (EventLog, "close"))
    found: list[list] = [[] for _ in kinds]
    for obj in gc.get_objects():  # one pass (0.2 s with torch loaded); no gc.collect(): garbage is listed too
        for i, (kind, _) in enumerate(kinds):
            if issubclass(type(obj), kind):  # not isinstance: no __class__ property runs
                found[i].append(obj)
    for (_, end), objs in zip(kinds, found):
        for obj in objs:
            try:
                getattr(obj, end)()
            except Exception:  # noqa: BLE001 - a failure the test already saw (or chose to ignore)
                pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """After the test function, before its fixtures end: what it left open is closed."""
    before = _spotrun_threads()
    yield
    if _spotrun_threads() - before:
        _close_what_is_left_open()


@pytest.fixture(autouse=True)
def _no_spotrun_thread_outlives_the_test():
    """No spotrun thread a test started runs on after it: once an event-log writer of an S3
    Checkpointer went on retrying a put to a stopped moto server until interpreter exit.
    What a test left open is closed after it (pytest_runtest_call above); a thread still
    running then is one close() does not end, or one of another object: an error naming it."""
    before = _spotrun_threads()
    yield
    deadline = time.monotonic() + THREAD_END_WAIT_S
    for thread in _spotrun_threads() - before:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    left = sorted(t.name for t in _spotrun_threads() - before)
    if left:
        pytest.fail(
            f"spotrun thread(s) still running {THREAD_END_WAIT_S:.0f} s after the test: {', '.join(left)}",
            pytrace=False,
        )


@pytest.fixture
def processes():
    """Supervisors started by a test; any still running at the end are killed with their trees."""
    started = []
    yield started
    for proc in started:
        kill_tree(proc)


@pytest.fixture
def spotrun_run(tmp_path):
    """``spotrun_run(options, command)``: a `spotrun run` process (:class:`Spotrun`); any still
    running at the end are killed with what they started."""
    started: list[Spotrun] = []

    def start(options, command, **kwargs) -> Spotrun:
        run = Spotrun(tmp_path, options, command, **kwargs)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill_everything()


@pytest.fixture
def state(tmp_path) -> pathlib.Path:
    """A directory where a fake launch command (tests/jobs) writes what it saw and did."""
    path = tmp_path / "state"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted supervised 2-rank run of the example trainer (REFERENCE_STEPS steps,
    a checkpoint every REFERENCE_SAVE_INTERVAL): (per-step losses, final model and optimizer
    tensors, its checkpoint directory). Shared by every test that checks exact resume, in
    every test process: the first to need it runs it under a file lock, the others read it.
    Tests only read its checkpoint directory."""
    shared = tmp_path_factory.getbasetemp().parent  # the same for every xdist worker of a run
    root = shared / "reference"
    with FileLock(str(shared / "reference.lock")):
        if not (root / "done").exists():
            root.mkdir(exist_ok=True)
            log_file = root / "train.jsonl"
            proc = start_supervised(
                str(root / "ck"),
                torchrun_command(REFERENCE_STEPS, REFERENCE_SAVE_INTERVAL, log_file),
                extra_options=["--notice", "none"],
                log_path=root / "supervisor.log",
            )
            try:
                assert proc.wait(timeout=600) == 0, (root / "supervisor.log").read_text()[-3000:]
            finally:
                kill_tree(proc)
            (root / "done").write_text("")
    losses = last_loss_per_step(root / "train.jsonl")
    assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
    return losses, final_tensors(str(root / "ck"), REFERENCE_STEPS), root / "ck"


@pytest.fixture
def figures(request):
    """``figures(line)``: a line of figures (points tried, bytes per second) printed in the
    run's summary, also when the test ran in an xdist worker (whose output is not shown)."""

    def add(line: str) -> None:
        request.node.user_properties.append(("figures", line))

    return add


def pytest_terminal_summary(terminalreporter):
    lines = [
        f"{report.nodeid}: {value}"
        for report in terminalreporter.getreports("passed") + terminalreporter.getreports("failed")
        if report.when == "call"
        for name, value in report.user_properties
        if name == "figures"
    ]
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)

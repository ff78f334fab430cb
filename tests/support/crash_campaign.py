"""Crash-consistency campaign: SIGKILL a checkpoint writer at every persistence point of
its saves, restart after each kill, and check what a user relies on.

Run by tests/e2e/test_crash_consistency.py as ``python -m tests.support.crash_campaign --backend
local|s3 --mode sync|background --work DIR --result FILE [--bucket NAME]`` (a process of
its own, so that it imports torch once and forks from a parent that has never started a
thread). Every worker is a forked child:

1. *base*: commits step 1 (the older complete step every later kill must leave alone).
2. *dry run*: on a copy of the base, a writer restarts (``Checkpointer.restore``, which
   claims its incarnation) and saves step 2 (and 3 on local storage: see
   :attr:`Scenario.saved_steps`) - synchronously, or on the background
   thread (``end_of_step`` with ``background_saves=True``, the live tensors changed while
   the save is in flight) - while :mod:`tests.support.crash_points` only counts the persistence
   points.
3. for each point N: the same writer on a fresh copy of the base, SIGKILLed at point N
   (it records, just before, what identifies every committed object's bytes); then a
   *restart* in a new process checks that

   * every step :func:`spotrun.checkpoint.catalog.list_steps` lists complete loads
     bit-exactly equal to what was saved at that step (the older ones with
     :func:`spotrun.checkpoint.restore.load_step` on the manifest the listing found, the
     newest through the restart below), and no step is corrupt or fenced;
   * every object committed before the kill is still there, byte for byte (local: SHA-256
     of the file; S3: the store's ETag, size and LastModified);
   * ``Checkpointer.restore`` resumes from the newest complete step (at least the newest
     one committed before the kill), with that step's exact state, and without a warning;
   * a save of the next step after that - over whatever the killed incarnation left of a
     save of the same step - commits and loads back exactly.

The result file holds every point's name and problems; the test asserts and prints the
figures. The state is small (three shard files per save; on local storage one of them
just over 8 MiB, so that it goes through ``put_stream``'s O_DIRECT path in two write
chunks; on S3 a few hundred KiB, the first file a multipart upload) so that a campaign
takes seconds. The state, the roots and the object identities are in
:mod:`tests.support.crash_roots`; the hooks in :mod:`tests.support.crash_points`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tests.support.crash_points import LocalHooks, PointCounter, S3Hooks
from tests.support.crash_roots import (
    BASE_STEP,
    MAX_FILE_SIZE_BYTES,
    Scenario,
    committed_snapshot,
    compare,
    copy_root,
    expected_state,
    make_storage,
    object_identities,
    preload,
    remove_root,
    scribble,
    set_state,
)

#: A child still running after this long is ended by SIGALRM (a hang is a failure, not a wait).
CHILD_ALARM_S = 120


# --- the writer ---------------------------------------------------------------------


def background_supported() -> bool:
    """Whether this spotrun's Checkpointer has background periodic saves (issue 9 item 3)."""
    from spotrun import Checkpointer

    return "background_saves" in inspect.signature(Checkpointer).parameters


def _checkpointer(state, storage, **options):
    from spotrun import Checkpointer

    return Checkpointer(
        state, storage=storage, handle_signals=False, max_file_size_bytes=MAX_FILE_SIZE_BYTES, **options
    )


def write_base(scenario: Scenario, storage) -> None:
    state: dict[str, dict] = {"model": {}, "meta": {}}
    set_state(state, BASE_STEP, scenario)
    ckpt = _checkpointer(state, storage)
    ckpt.save(BASE_STEP, reason="periodic")
    ckpt.close()


def run_writer(scenario: Scenario, storage) -> None:
    """Restart from the base (claiming an incarnation), then save ``scenario.saved_steps``."""
    state: dict[str, dict] = {"model": {}, "meta": {}}
    if scenario.mode == "sync":
        ckpt = _checkpointer(state, storage)
        assert ckpt.restore() == BASE_STEP
        for step in scenario.saved_steps:
            set_state(state, step, scenario)
            ckpt.save(step, reason="periodic")
        ckpt.close()
        return
    ckpt = _checkpointer(state, storage, interval_steps=1, background_saves=True)
    assert ckpt.restore() == BASE_STEP
    for step in scenario.saved_steps:
        set_state(state, step, scenario)
        ckpt.end_of_step(step)  # stages the state and returns; the write runs in the background
        scribble(state)  # while the save is in flight
        ckpt.wait_for_save()
    ckpt.close()


def writer_child(scenario: Scenario, uri: str, kill_at: int | None, out_path: str) -> None:
    """Writer on a fresh copy of the base; SIGKILLed at point ``kill_at`` (after writing
    the committed objects' hashes to ``out_path``), or, in the dry run, writes the names
    of every point and the final hashes there."""
    copy_root(scenario, scenario.uri("base"), uri)
    observer = make_storage(scenario, uri, durable=False)  # S3: its client is not hooked

    def on_kill(index: int, name: str) -> None:
        _write_json(out_path, {"index": index, "point": name, **committed_snapshot(scenario, uri, observer)})

    counter = PointCounter(kill_at, on_kill)
    if scenario.backend == "local":
        LocalHooks(uri, counter).install()
    else:
        S3Hooks(counter, uri.split("/", 3)[3]).install()
    run_writer(scenario, make_storage(scenario, uri))
    if kill_at is None:
        _write_json(out_path, {"points": counter.names, **committed_snapshot(scenario, uri, observer)})


# --- the restart after a kill ---------------------------------------------------------


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def check_restart(scenario: Scenario, uri: str, snapshot: dict[str, Any]) -> dict[str, Any]:
    """What a new process finds after the kill; returns ``problems`` and the figures."""
    from spotrun.checkpoint import catalog
    from spotrun.checkpoint.restore import load_committed, load_step

    storage = make_storage(scenario, uri, durable=False)
    problems: list[str] = []
    steps = catalog.list_steps(storage)
    complete = [s.step for s in steps if s.status == catalog.COMPLETE]
    for info in steps:
        if info.status in (catalog.CORRUPT, catalog.FENCED):
            problems.append(f"step {info.step} is {info.status} after the kill: {info.problem}")
    for info in steps:  # the newest complete step is loaded by the restart below
        if info.status != catalog.COMPLETE or info.step == max(complete):
            continue
        try:  # load_committed without its second listing: the manifest the listing found, read again
            loaded = load_step(storage, info.step, info.manifest_key, 0, 1)
            problems += compare(loaded.replicated, info.step, f"listed-complete step {info.step}", scenario)
        except Exception as exc:  # noqa: BLE001 - a step listed complete must load
            problems.append(f"step {info.step} is listed complete but does not load: {type(exc).__name__}: {exc}")
    problems += _changed_since(scenario, uri, storage, snapshot, complete)

    warnings = _Warnings()
    logging.getLogger("spotrun").setLevel(logging.WARNING)
    logging.getLogger("spotrun").addHandler(warnings)
    state: dict[str, dict] = {"model": {}, "meta": {}}
    ckpt = _checkpointer(state, storage)
    restored = ckpt.restore()
    newest_before = max((int(s) for s in snapshot["committed"]), default=0)
    if restored != max(complete, default=0) or restored < newest_before:
        problems.append(
            f"the restart resumed from step {restored}; complete steps {complete}, "
            f"newest committed before the kill {newest_before}"
        )
    problems += compare(state, restored, f"state restored from step {restored}", scenario)
    following = restored + 1  # saved again over the killed incarnation's leftovers, when it was that step
    set_state(state, following, scenario)
    ckpt.save(following, reason="periodic")
    ckpt.close()
    try:
        problems += compare(
            load_committed(storage, following, 0, 1).replicated,
            following,
            f"step {following} saved after the restart",
            scenario,
        )
    except Exception as exc:  # noqa: BLE001
        problems.append(f"step {following} saved after the restart does not load: {type(exc).__name__}: {exc}")
    problems += [f"the restart logged {m}" for m in warnings.messages]
    return {"problems": problems, "complete": complete, "restored": restored}


def _changed_since(scenario: Scenario, uri: str, storage, snapshot: dict[str, Any], complete: list[int]) -> list[str]:
    problems = [
        f"step {step} was complete before the kill and is not now"
        for step in snapshot["committed"]
        if int(step) not in complete
    ]
    before = snapshot["identities"]
    now = object_identities(scenario, uri, storage, sorted(before))
    problems += [
        f"committed {key} changed after the kill: {before[key]}, now {now[key]}"
        for key in sorted(before)
        if now[key] != before[key]
    ]
    return problems


# --- forking ------------------------------------------------------------------------


def _write_json(path: str, doc: Any) -> None:
    with open(path + ".part", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".part", path)


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def in_child(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked child; its exit status (``-signal`` when killed by one)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            signal.alarm(CHILD_ALARM_S)
            # torch's fork handler marks its thread pool for replacement in the child; the
            # first set_num_threads replaces it. Done here, before any thread exists: two
            # threads doing their first tensor operation at once (put_stream's fill threads)
            # would race on the replacement and one would fail with "Invalid thread pool!".
            torch.set_num_threads(1)
            work()
        except BaseException:  # noqa: BLE001 - reported through the exit status
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _checked_in_child(scenario: Scenario, uri: str, snapshot_path: str, result_path: str) -> dict[str, Any]:
    def work() -> None:
        try:
            result = check_restart(scenario, uri, _read_json(snapshot_path))
        except Exception as exc:  # noqa: BLE001
            result = {
                "problems": [f"the restart failed: {type(exc).__name__}: {exc}"],
                "traceback": traceback.format_exc(),
            }
        _write_json(result_path, result)
        remove_root(scenario, uri)

    status = in_child(work)
    if not os.path.exists(result_path):
        return {"problems": [f"the restart process ended with status {status} and no result"]}
    return _read_json(result_path)


def campaign(scenario: Scenario) -> dict[str, Any]:
    """Every kill point of one scenario; returns the figures and each point's problems."""
    started_s = time.monotonic()
    os.makedirs(os.path.join(scenario.work_dir, "roots"), exist_ok=True)
    base = scenario.uri("base")
    for name in ("base", "dry"):  # left by an earlier campaign in the same place
        remove_root(scenario, scenario.uri(name))
    for step in range(BASE_STEP, scenario.saved_steps[-1] + 2):  # computed once, inherited by every child
        expected_state(step, scenario)
    status = in_child(lambda: write_base(scenario, make_storage(scenario, base)))
    if status != 0:
        raise RuntimeError(f"committing the base step failed (status {status})")
    dry_out = os.path.join(scenario.work_dir, "dry.json")
    status = in_child(lambda: writer_child(scenario, scenario.uri("dry"), None, dry_out))
    if status != 0:
        raise RuntimeError(f"the dry run failed (status {status})")
    dry = _read_json(dry_out)
    names: list[str] = dry["points"]
    end_state = _checked_in_child(
        scenario, scenario.uri("dry"), dry_out, os.path.join(scenario.work_dir, "dry-check.json")
    )
    points = []
    for index in range(len(names)):
        uri = scenario.uri(f"p{index:03d}")
        snapshot_path = os.path.join(scenario.work_dir, f"p{index:03d}-snapshot.json")
        status = in_child(lambda: writer_child(scenario, uri, index, snapshot_path))
        if status != -signal.SIGKILL or not os.path.exists(snapshot_path):
            points.append(
                {
                    "index": index,
                    "name": names[index],
                    "problems": [
                        f"the writer was not killed at point {index} (status {status}): the run passed fewer "
                        f"persistence points than the dry run's {len(names)}"
                    ],
                }
            )
            remove_root(scenario, uri)
            continue
        killed_at = _read_json(snapshot_path)["point"]
        checked = _checked_in_child(
            scenario, uri, snapshot_path, os.path.join(scenario.work_dir, f"p{index:03d}-check.json")
        )
        points.append(
            {
                "index": index,
                "name": killed_at,
                "problems": checked["problems"],
                "complete": checked.get("complete"),
                "restored": checked.get("restored"),
            }
        )
    remove_root(scenario, base)
    return {
        "backend": scenario.backend,
        "mode": scenario.mode,
        "tried": len(points),
        "survived": sum(not p["problems"] for p in points),
        "points": points,
        "end_state_problems": end_state["problems"],
        "files_per_save": len(dry["committed"].get(str(scenario.saved_steps[-1]), {})) - 1,
        "seconds": round(time.monotonic() - started_s, 1),
        "cpu_seconds": round(
            sum(
                getattr(resource.getrusage(who), field)
                for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                for field in ("ru_utime", "ru_stime")
            ),
            1,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("local", "s3"), required=True)
    parser.add_argument("--mode", choices=("sync", "background"), required=True)
    parser.add_argument("--work", required=True, help="scratch directory")
    parser.add_argument("--result", required=True, help="where the JSON result goes")
    parser.add_argument("--bucket", help="S3 bucket (s3 only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # before anything runs an operator: no thread pool exists when we fork
    logging.basicConfig(level=logging.ERROR, format="%(process)d %(name)s: %(message)s")
    scenario = Scenario(args.backend, args.mode, os.path.abspath(args.work), args.bucket)
    preload(scenario)
    _write_json(args.result, campaign(scenario))
    return 0


if __name__ == "__main__":
    sys.exit(main())

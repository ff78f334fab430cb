"""Fake training worker that honours save requests.

Loops over "steps"; at each step boundary checks the control channel. On a request it
records the request, writes an emergency checkpoint of the current step (shards, then the
manifest with put_if_absent), writes the commit report and exits 0.

usage: saver.py STATE_DIR [--max-steps N] [--no-manifest] [--exit-without-saving]
                 [--stopped-without-save-at N] [--fenced-at N | --fenced-on-request] [--fenced-exit-code N]
    STATE_DIR/launches        one line per launch
    STATE_DIR/ready           written once the loop runs
    STATE_DIR/request.json    the save request it saw
    STATE_DIR/got-signal      written if any SIGTERM/SIGINT/SIGHUP reached this worker
"""

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import sys
import time

from fakeckpt import write_step

from spotrun.control import env, listeners
from spotrun.control import files as control


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("state_dir", type=pathlib.Path)
    parser.add_argument("--max-steps", type=int, default=0, help="0 = run until asked to save")
    parser.add_argument("--no-manifest", action="store_true", help="report a commit but never write the manifest")
    parser.add_argument("--exit-without-saving", action="store_true", help="on a request, just exit 0")
    parser.add_argument(
        "--stopped-without-save-at",
        type=int,
        default=0,
        help="at this step, report a stop without a save (as when another node's "
        "supervisor found no time for one) and exit 0",
    )
    parser.add_argument(
        "--fenced-at",
        type=int,
        default=0,
        help="at this step, report a fence (as a Checkpointer whose save raised FencedError "
        "does) and exit --fenced-exit-code",
    )
    parser.add_argument(
        "--fenced-on-request",
        action="store_true",
        help="on a save request, report a fence instead of saving (the emergency save was fenced)",
    )
    parser.add_argument("--fenced-exit-code", type=int, default=1)
    args = parser.parse_args()

    def record_signal(signum, frame):
        (args.state_dir / "got-signal").write_text(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, record_signal)

    listeners.announce("checkpointer")  # it speaks spotrun's protocol: no signal on a notice
    worker_env = env.WorkerEnv.from_environ()
    control_dir = worker_env.control_dir
    with open(args.state_dir / "launches", "a") as f:
        f.write(f"{os.getpid()}\n")
    (args.state_dir / "ready").write_text(str(os.getpid()))

    def fenced() -> int:
        control.write_fence_report(
            control_dir,
            control.FenceReport(
                incarnation=worker_env.incarnation,
                newer_incarnation=worker_env.incarnation + 7,
                newer_host="other-host",
                newer_pid=1234,
                newer_supervisor_pid=99,
                message="FencedError: a newer incarnation started",
                fenced_unix_s=time.time(),
            ),
        )
        return args.fenced_exit_code

    step = worker_env.resume_step or 0
    while args.max_steps == 0 or step < args.max_steps:
        time.sleep(0.02)  # one "training step"
        step += 1
        if step == args.fenced_at:
            return fenced()
        if step == args.stopped_without_save_at:
            control.write_stop_report(control_dir, step)
            return 0
        if not control.save_requested(control_dir):
            continue
        request = control.read_save_request(control_dir)
        (args.state_dir / "request.json").write_text(json.dumps(dataclasses.asdict(request)))
        if args.fenced_on_request:
            return fenced()
        if args.exit_without_saving:
            return 0
        write_step(
            worker_env.checkpoint_uri,
            step,
            commit=not args.no_manifest,
            reason="emergency",
            run_id=worker_env.run_id,
            incarnation=worker_env.incarnation,
        )
        control.write_commit_report(control_dir, step)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

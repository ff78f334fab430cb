"""``spotrun gc URI``: delete what a checkpoint root no longer needs, offline.

Old complete steps (by ``--keep-last``/``--keep-every``), incomplete and fenced steps older than
``--incomplete-older-than-s`` (default 1 h), and unfinished writes as old. A save still running
is never touched because its objects are younger than the threshold (which must stay above the
job's ``save_timeout_s``); a killed ``gc`` never leaves a half-deleted step that a start would
resume from. The rules: ``docs/design/internals.md`` (CLI and configuration).
"""

from __future__ import annotations

import argparse
import logging
import time

from spotrun.checkpoint import catalog
from spotrun.checkpoint.retention import Decision, RetentionPolicy, delete_step, plan_gc
from spotrun.cli._shared import add_storage_options, location_of
from spotrun.control.env import DEFAULT_SAVE_TIMEOUT_S
from spotrun.errors import ConfigError
from spotrun.storage.base import Storage, UnfinishedUpload

log = logging.getLogger(__name__)

#: Default age, in seconds, from which an incomplete step or an unfinished upload is dead:
#: well above a save's default bound (``Checkpointer(save_timeout_s=300)``).
DEFAULT_OLDER_THAN_S = 3600.0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``spotrun gc`` to ``sub``."""
    gc = sub.add_parser(
        "gc",
        parents=[common],
        help="delete old steps, dead saves and abandoned uploads under a root",
        description="Delete the complete steps that --keep-last/--keep-every no longer keep (never the newest "
        "complete step, nor the step the newest start resumed from), incomplete and fenced steps whose newest "
        "object is older than --incomplete-older-than-s, interrupted deletions, and abandoned S3 multipart "
        "uploads (local: temporary files of killed writers) as old. It never touches a save that may still "
        "be running: a save's storage operations end within the job's save_timeout_s (default 300 s), so "
        "anything younger than the threshold is kept. Corrupt steps are reported, not deleted. Prints one "
        "line per step and upload, then a summary. Exit code 0, or 2 on an error.",
    )
    gc.add_argument(
        "uri", metavar="URI", help="checkpoint root: local dir, file://, s3://, gs:// or az://bucket/prefix"
    )
    gc.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="N",
        help="keep the N newest complete steps (default: keep every complete step)",
    )
    gc.add_argument(
        "--keep-every",
        type=int,
        default=None,
        metavar="M",
        help="also keep every complete step divisible by M (with --keep-last)",
    )
    gc.add_argument(
        "--incomplete-older-than-s",
        type=float,
        default=DEFAULT_OLDER_THAN_S,
        metavar="S",
        help="delete incomplete and fenced steps and abandoned uploads from this age on, in "
        "seconds (default %(default).0f; keep it above the job's save_timeout_s, 300 s by default: "
        "anything younger may belong to a save still running)",
    )
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    add_storage_options(gc)
    gc.set_defaults(handler=run_gc, default_log_level="warning")


def run_gc(args: argparse.Namespace) -> int:
    """The ``gc`` handler; returns the exit code.

    Raises:
        ConfigError: bad options or URI.
        StorageError: listing or deleting failed (what was deleted stays deleted).
    """
    policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
    older_than_s = args.incomplete_older_than_s
    if not older_than_s >= 0:
        raise ConfigError(f"--incomplete-older-than-s must be >= 0, got {older_than_s}")
    if older_than_s < DEFAULT_SAVE_TIMEOUT_S:
        log.warning(
            "--incomplete-older-than-s %g is below a save's default bound (save_timeout_s=%g s): a save "
            "still running may be deleted",
            older_than_s,
            DEFAULT_SAVE_TIMEOUT_S,
        )
    storage = location_of(args.uri, args).open_existing()
    steps, fences = catalog.list_root(storage)
    protected = {}
    if fences.newest is not None and fences.resumed[fences.newest] is not None:
        protected[fences.resumed[fences.newest]] = (
            f"the step the newest start (incarnation {fences.newest}) resumed from"
        )
    now_unix_s = time.time()
    decisions = plan_gc(steps, policy, protected=protected, now_unix_s=now_unix_s, older_than_s=older_than_s)
    uploads = storage.unfinished_uploads()
    sweeper = _Sweeper(storage, dry_run=args.dry_run, policy=policy)
    sweeper.steps(decisions, {s.step: s for s in steps})
    sweeper.uploads(uploads, now_unix_s=now_unix_s, older_than_s=older_than_s)
    print(sweeper.summary())
    return 0


class _Sweeper:
    """Acts on the decisions (or, in a dry run, only says what it would do), one line each."""

    def __init__(self, storage: Storage, *, dry_run: bool, policy: RetentionPolicy) -> None:
        self.storage = storage
        self.dry_run = dry_run
        self.policy = policy
        self.deleted_steps = self.kept_steps = self.objects = self.size_bytes = 0
        self.aborted = self.kept_uploads = 0
        self.corrupt: list[int] = []

    def steps(self, decisions: list[Decision], infos: dict[int, catalog.StepInfo]) -> None:
        from spotrun.tools.progress import progress_bar

        doomed = [d for d in decisions if d.delete]
        total = sum(infos[d.step].object_count for d in doomed)
        with progress_bar(None if self.dry_run else total, "gc: deleting", unit="object") as bar:
            for decision in decisions:
                info = infos[decision.step]
                if not decision.delete:
                    self.kept_steps += 1
                    if decision.status == catalog.CORRUPT:
                        self.corrupt.append(decision.step)
                    _line(decision.step, decision.status, "kept", decision.reason)
                    continue
                if self.dry_run:
                    self.objects += info.object_count
                    self.size_bytes += info.size_bytes
                else:
                    done = delete_step(
                        self.storage,
                        decision.step,
                        why=f"spotrun gc ({self.policy.describe()}): {decision.reason}",
                        on_deleted=bar.update,
                        objects=info.objects,
                    )
                    self.objects += done.objects
                    self.size_bytes += done.size_bytes
                self.deleted_steps += 1
                _line(decision.step, decision.status, "would delete" if self.dry_run else "deleted", decision.reason)

    def uploads(self, uploads: list[UnfinishedUpload], *, now_unix_s: float, older_than_s: float) -> None:
        for upload in uploads:
            age_s = now_unix_s - upload.time_unix_s
            what = self.storage.unfinished_upload_kind
            if age_s < older_than_s:
                self.kept_uploads += 1
                print(
                    f"{what} {upload.key}: kept, {max(age_s, 0.0):.0f} s old, under the {older_than_s:g} s "
                    "threshold: a save may still be writing it",
                    flush=True,
                )
                continue
            if not self.dry_run:
                self.storage.abort_upload(upload)
            self.aborted += 1
            verb, done = ("abort", "aborted") if upload.upload_id is not None else ("remove", "removed")
            print(
                f"{what} {upload.key}: {'would ' + verb if self.dry_run else done}, {age_s:.0f} s old "
                f"(threshold {older_than_s:g} s)",
                flush=True,
            )

    def summary(self) -> str:
        from spotrun.cli._shared import human_size

        verb = "would delete" if self.dry_run else "deleted"
        text = (
            f"{verb} {self.deleted_steps} step(s) ({self.objects} objects, {human_size(self.size_bytes)}) and "
            f"{self.aborted} unfinished write(s); kept {self.kept_steps} step(s) and {self.kept_uploads} "
            f"unfinished write(s) under {self.storage.uri}"
        )
        if self.corrupt:
            text += f"; corrupt, look at them: step(s) {', '.join(map(str, self.corrupt))}"
        return text


def _line(step: int, status: str, action: str, reason: str) -> None:
    print(f"step {step:<9} {status:<10} {action:<13} {reason}", flush=True)

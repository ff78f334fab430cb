"""The mutation campaign against format-4 steps (issue 21, item 5).

    python -m tests.support.mutation_campaign --work DIR --result FILE

Two real roots, each with two steps of the same job (a model, AdamW and a scheduler): one
saved by one process (replicated state), one by FSDP2 on 2 ranks under real torchrun and gloo
(every tensor in chunks on both ranks). For each root and each edit of tests/support/mutation_edits.py
(on a fresh copy; the newest step edited, digests recomputed), one forked child under a 2 GiB
address-space limit (``RLIMIT_AS``) and a time bound (``alarm``) runs, in order:

1. the read-only tools, in process as the ``spotrun`` console script runs them: ``ls --json``,
   ``verify``, ``export --format hf`` and ``gc --dry-run``;
2. ``Checkpointer.restore()`` into a fresh job, then the restored step and a digest of every
   parameter and optimizer tensor;
3. ``ls --json`` again.

What must hold (a violation is a *failure*, named by its kind): no traceback and no exit code
but the documented ones (``ls`` and ``gc`` 0; ``verify`` 0 or 1; ``export`` 0, or 2 with one
line); no hang (the alarm) and no crash; the read-only tools change nothing under the root and
nothing outside it is ever changed; an export holds the values of the step it names; the
restore resumes either the previous step (*fell back*: its values bit for bit; ``verify``
reported the step, and ``ls`` lists it as not complete after the start) or the newest one with
its untouched values (*harmless*; not for a link or a repeated key); a sound checkpoint of
another job (an edit marked ``self_consistent``) may instead be *refused* with
``StateMismatchError``. The result file holds every edit's outcome and failures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback

from tests.support.paths import JOBS, REPO

WORKER = JOBS / "sharded_job.py"
sys.path.insert(0, str(WORKER.parent))

ADDRESS_SPACE_BYTES = 2 * 2**30
EDIT_TIMEOUT_S = 30  # one edit's tools and restore take about a second when all is well
SAVE_TIMEOUT_S = 300
PREVIOUS, NEWEST = 2, 3
CONCURRENT_CHILDREN = 2
NEWEST_DIR = f"step-{NEWEST:09d}"


def build_roots(work: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{"replicated": root, "sharded": root}``, each with steps 2 and 3, saved in parallel."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    roots = {"replicated": work / "replicated", "sharded": work / "sharded"}
    procs = []
    for name, nproc in (("replicated", None), ("sharded", 2)):
        jobs = json.dumps(
            [
                {"layout": "single" if nproc is None else "fsdp", "ckpt": str(roots[name]), "steps": s}
                for s in (PREVIOUS, NEWEST)
            ]
        )
        launcher = (
            [sys.executable]
            if nproc is None
            else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        )
        procs.append(
            subprocess.Popen(
                launcher + [str(WORKER), "--jobs", jobs, "--out", str(work / f"{name}.json")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for proc in procs:
        out, _ = proc.communicate(timeout=SAVE_TIMEOUT_S)
        if proc.returncode != 0:
            raise SystemExit(f"saving the campaign's roots failed:\n{out[-4000:]}")
    return roots


# --- in the child ---------------------------------------------------------------------------


def tool(*args: str) -> dict:
    """``spotrun ARGS`` in this process, as the console script runs it."""
    from spotrun.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # the interpreter would print this and exit 1
            traceback.print_exc()
            code = 1
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def restore(root: str) -> dict:
    """A fresh job's restore: the step, every tensor's digest, the log lines, or the error."""
    import logging

    import sharded_job
    import torch

    import spotrun

    records = io.StringIO()
    handler = logging.StreamHandler(records)
    logging.getLogger("spotrun").addHandler(handler)
    logging.getLogger("spotrun").setLevel(logging.INFO)
    try:
        model = sharded_job.build("single")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        ckpt = spotrun.Checkpointer(
            {"model": model, "optimizer": opt, "scheduler": sched},
            uri=root,
            handle_signals=False,
            background_saves=False,
        )
        try:
            step = ckpt.restore()
        finally:
            ckpt.close()
        return {
            "step": step,
            "tensors": sharded_job.tensor_digests(model, opt),
            "lr": sched.get_last_lr(),
            "log": records.getvalue(),
        }
    except BaseException as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc)[:2000],
            "traceback": traceback.format_exc()[-3000:],
            "log": records.getvalue(),
        }


def exported(out_dir: pathlib.Path) -> dict[str, str]:
    """Digest of each tensor an export wrote, under its checkpoint name (``model/...``)."""
    import sharded_job
    from safetensors.torch import load_file

    found = {}
    for path in sorted(out_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            found[f"model/{name}"] = sharded_job.digest(tensor)
    return found


def run_edit(root: pathlib.Path, outside: pathlib.Path, hf: pathlib.Path) -> dict:
    """Everything the child does for one edited root (see the module docstring)."""
    result: dict = {"before": snapshot(root, outside)}
    result["ls"] = tool("ls", str(root), "--json")
    result["verify"] = tool("verify", str(root))
    result["export"] = tool("export", str(root), str(hf), "--format", "hf")
    if result["export"]["code"] == 0:
        result["exported"] = exported(hf)
    result["gc"] = tool("gc", str(root), "--dry-run")
    result["after_tools"] = snapshot(root, outside)
    result["restore"] = restore(str(root))
    result["ls_after"] = tool("ls", str(root), "--json")
    result["outside_after"] = snapshot(outside, None)
    return result


def snapshot(root: pathlib.Path, outside: pathlib.Path | None) -> dict[str, list]:
    """Every entry under ``root`` (and ``outside``): kind, size, modification time - never opened."""
    found = {}
    for base in (root, outside):
        if base is None:
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                found[path] = [st.st_mode, st.st_size if not os.path.isdir(path) else 0, st.st_mtime_ns]
    return found


def in_child(root: pathlib.Path, outside: pathlib.Path, hf: pathlib.Path, result_path: pathlib.Path) -> None:
    """The forked child: bounded memory and time, then :func:`run_edit`; never returns."""
    code = 0
    try:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
        signal.alarm(EDIT_TIMEOUT_S)
        result = run_edit(root, outside, hf)
        result_path.write_text(json.dumps(result))
    except BaseException:
        traceback.print_exc()
        code = 3
    finally:
        os._exit(code)


def start_child(place: pathlib.Path) -> int:
    """Fork the child of the edited root ``place/root`` (see :func:`in_child`); its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        in_child(place / "root", place / "outside", place / "hf", place / "result.json")
    return pid


def reap_child() -> tuple[int, dict]:
    """Wait for any child (bounded: each one's alarm ends it); ``(pid, {"exit", "max_rss_mib",
    "result"})``, ``result`` missing when it wrote none."""
    pid, status, usage = os.wait4(-1, 0)
    return pid, {"exit": os.waitstatus_to_exitcode(status), "max_rss_mib": usage.ru_maxrss // 1024}


def read_result(place: pathlib.Path, found: dict) -> dict:
    if (place / "result.json").exists():
        found["result"] = json.loads((place / "result.json").read_text())
    return found


def run_child(place: pathlib.Path) -> dict:
    pid = start_child(place)
    reaped, found = reap_child()
    assert reaped == pid
    return read_result(place, found)


# --- judging --------------------------------------------------------------------------------


def has_traceback(run: dict) -> bool:
    return "Traceback (most recent call last)" in run["err"] + run["out"]


def step_status(ls: dict, step: int) -> str | None:
    try:
        return next((s["status"] for s in json.loads(ls["out"]) if s["step"] == step), None)
    except (ValueError, TypeError, KeyError):
        return None


def judge(edit, found: dict, references: dict) -> tuple[str, list[str]]:
    """``(outcome, failures)``: outcome ``fell back``, ``harmless``, ``refused`` or ``failed``."""
    exit_code = found["exit"]
    if "result" not in found:
        if exit_code == -signal.SIGALRM:
            return "failed", [f"hang: no result within {EDIT_TIMEOUT_S} s"]
        return "failed", [f"crash: the child ended with {exit_code} and no result"]
    result = found["result"]
    failures = []
    documented = {"ls": {0}, "verify": {0, 1}, "export": {0, 2}, "gc": {0}}
    for name, codes in documented.items():
        run = result[name]
        if has_traceback(run):
            last = [line for line in run["err"].splitlines() if line.strip()][-1:]
            failures.append(f"{name}: traceback ({last[0][:160] if last else '?'})")
        elif run["code"] not in codes:
            failures.append(
                f"{name}: exit {run['code']} (documented: {sorted(codes)}): "
                f"{(run['err'].strip().splitlines() or [''])[-1][:160]}"
            )
        elif run["code"] == 2 and len(run["err"].strip().splitlines()) != 1:
            failures.append(f"{name}: exit 2 with {len(run['err'].strip().splitlines())} lines on stderr, not one")
        if any(len(line) > 2000 for line in (run["err"] + run["out"]).splitlines()):
            failures.append(f"{name}: a line of more than 2000 characters")
    if result["after_tools"] != result["before"]:
        failures.append("read-only tools changed the root or outside it")
    outside_before = {p: v for p, v in result["before"].items() if "/outside" in p}
    if result["outside_after"] != outside_before:
        failures.append("something outside the root changed")
    if "exported" in result:
        said = result["export"]["out"].split(",", 1)[0]  # "exported step N"
        step = int(said.split()[-1]) if said.startswith("exported step ") else None
        reference = references.get(step, {}).get("tensors", {})
        wrong = sorted(k for k, v in result["exported"].items() if reference.get(k) != v)
        if step not in references or wrong:
            failures.append(f"export: exported step {step} with values that are not that step's ({wrong[:2]})")
    restored = result["restore"]
    if "error" in restored:
        if restored["error"] == "StateMismatchError" and edit.self_consistent:
            return ("refused" if not failures else "failed"), failures
        failures.append(f"restore: {restored['error']}: {' '.join(restored['message'].split())[:200]}")
        return "failed", failures
    if edit.self_consistent:
        failures.append(
            f"restore: resumed step {restored['step']} of a checkpoint of another job "
            "instead of refusing it (StateMismatchError)"
        )
    same = {k: restored[k] for k in ("step", "tensors", "lr")}
    if same == references[PREVIOUS]:
        outcome = "fell back"
        if result["verify"]["code"] != 1:
            failures.append("verify: passed a step the restore fell back from")
        if step_status(result["ls_after"], NEWEST) == "complete":
            failures.append("ls after the start: the step the restore fell back from still lists as complete")
    elif same == references[NEWEST] and not edit.must_fall_back:
        outcome = "harmless"
        if result["verify"]["code"] != 0:  # the restore checks what verify checks
            failures.append("restore: resumed a step that verify reports as damaged")
    elif same == references[NEWEST]:
        outcome = "failed"
        failures.append("restore: resumed the newest step through a link or a repeated key")
    else:
        outcome = "failed"
        which = "previous" if restored["step"] == PREVIOUS else "newest" if restored["step"] == NEWEST else "another"
        failures.append(f"restore: resumed step {restored['step']} ({which}) with values that are not its own")
    return ("failed" if failures else outcome), failures


def references_of(root: pathlib.Path, scratch: pathlib.Path) -> dict[int, dict]:
    """What a restore gives from the untouched root (the newest step) and from the root
    without its newest step (the previous one)."""
    found = {}
    for step in (NEWEST, PREVIOUS):
        place = scratch / f"reference-{step}"
        shutil.copytree(root, place / "root", symlinks=True)
        (place / "outside").mkdir()
        if step == PREVIOUS:
            shutil.rmtree(place / "root" / NEWEST_DIR)
        child = run_child(place)
        restored = child.get("result", {}).get("restore", {})
        if restored.get("step") != step:
            raise SystemExit(f"the reference restore of step {step} failed: {child}")
        found[step] = {k: restored[k] for k in ("step", "tensors", "lr")}
    if found[NEWEST]["tensors"] == found[PREVIOUS]["tensors"]:
        raise SystemExit("the two steps hold the same values: the campaign could not tell them apart")
    return found


def campaign(work: pathlib.Path) -> dict:
    from tests.support.mutation_edits import EDITS, NewestStep

    started_s = time.monotonic()
    roots = build_roots(work)
    saved_s = time.monotonic() - started_s
    rows = []
    max_rss_mib = 0
    references = {}
    pending = []  # (state, edit number, edit, place)
    for state, root in roots.items():
        scratch = work / f"{state}-runs"
        scratch.mkdir()
        references[state] = references_of(root, scratch)
        for number, edit in enumerate(EDITS):
            place = scratch / f"edit-{number:03d}"
            shutil.copytree(root, place / "root", symlinks=True)
            (place / "outside").mkdir()
            step = NewestStep(place / "root" / NEWEST_DIR)
            edit.apply(step, place / "outside")
            if edit.rewrites:
                step.finish()
            pending.append((state, number, edit, place))
    running: dict[int, tuple] = {}
    while pending or running:
        while pending and len(running) < CONCURRENT_CHILDREN:
            state, number, edit, place = pending.pop(0)
            running[start_child(place)] = (state, number, edit, place, time.monotonic())
        pid, found = reap_child()
        state, number, edit, place, edit_started_s = running.pop(pid)
        found = read_result(place, found)
        max_rss_mib = max(max_rss_mib, found["max_rss_mib"])
        outcome, failures = judge(edit, found, references[state])
        restored = found.get("result", {}).get("restore", {})
        rows.append(
            {
                "state": state,
                "number": number,
                "edit": edit.name,
                "outcome": outcome,
                "failures": failures,
                "restored": restored.get("step", restored.get("error")),
                "verify": found.get("result", {}).get("verify", {}).get("code"),
                "seconds": round(time.monotonic() - edit_started_s, 2),
            }
        )
        if not failures:
            shutil.rmtree(place)
    rows.sort(key=lambda row: (row["state"], row["number"]))
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("fell back", "refused", "harmless", "failed")}
    return {
        "edits": len(EDITS),
        "tried": len(rows),
        **counts,
        "rows": rows,
        "max_rss_mib": max_rss_mib,
        "save_seconds": round(saved_s, 1),
        "seconds": round(time.monotonic() - started_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True, type=pathlib.Path)
    parser.add_argument("--result", required=True, type=pathlib.Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    # Imported once here, before any fork (each child would take seconds to import them); no
    # torch operation runs in this process, so no thread pool exists when it forks.
    import torch

    torch.set_num_threads(1)
    import safetensors.torch  # noqa: F401
    import sharded_job  # noqa: F401
    import torch._dynamo  # noqa: F401  (the optimizer imports it on first use)

    import spotrun.cli  # noqa: F401
    import spotrun.export.hf  # noqa: F401
    import spotrun.train.checkpointer  # noqa: F401

    args.result.write_text(json.dumps(campaign(args.work)))


if __name__ == "__main__":
    main()

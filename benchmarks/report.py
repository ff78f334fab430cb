"""The tables of ``checkpoint_vs_peers.py``: figures, ratios, memory, and the issue's targets."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

MIB = 2**20
BACKGROUND_MISSING = "n/a (background saves not available)"

#: (section, DCP's figure, the limit's figure, rows)
SECTIONS = [
    (
        "durable save",
        "DCP save",
        "dd direct write",
        [
            "spotrun save",
            "spotrun background total",
            "DCP save",
            "DCP async_save total",
            "DCP async_save (reused stager) total",
            "safetensors save_file+fsync",
            "torch.save+fsync",
            "dd direct write",
        ],
    ),
    (
        "cold restore into the live model and optimizer",
        "DCP load",
        "dd direct read",
        ["spotrun restore", "DCP load", "safetensors load_file+copy_", "torch.load+load_state_dict", "dd direct read"],
    ),
    (
        "training blocked by a periodic save (stall)",
        "DCP async_save stall",
        "memcpy into preallocated buffers",
        [
            "spotrun background stall",
            "DCP async_save stall",
            "DCP async_save (reused stager) stall",
            "memcpy, torch's threads",
            "memcpy, one thread",
            "memcpy into preallocated buffers",
        ],
    ),
]


@dataclass
class Results:
    """Everything one run measured (see ``checkpoint_vs_peers.main``)."""

    state_bytes: int
    rounds: int
    samples: Any  # checkpoint_vs_peers.Samples
    missing: dict[str, str]
    memory: dict[str, dict]
    tiny: dict[str, list[float]] | None
    tiny_count: int
    world2: dict[str, list[float]] | None
    world2_mib: float
    s3: dict[str, list[float]] | None


def _median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:6.2f}x" if value is not None and base else "     - "


def _local_table(r: Results) -> None:
    s = r.samples
    print(
        f"\n{'figure (median of %d rounds)' % r.rounds:<44} {'seconds':>8} {'x DCP':>7} {'x limit':>7}"
        f" {'faults':>8} {'user s':>7} {'sys s':>6}  {'min..max s':>13}"
    )
    for section, dcp_figure, limit_figure, rows in SECTIONS:
        print(f"{section} (DCP: {dcp_figure}; limit: {limit_figure})")
        dcp, limit = s.median(dcp_figure), s.median(limit_figure)
        for figure in rows:
            value = s.median(figure)
            if value is None:
                why = next((w for tool, w in r.missing.items() if figure.startswith(tool)), "not measured")
                print(f"  {figure:<42} n/a ({why})")
                continue
            print(
                f"  {figure:<42} {value:8.3f} {_ratio(value, dcp)} {_ratio(value, limit)}"
                f" {s.median(figure, 1) / 1000:7.0f}k {s.median(figure, 2):7.2f} {s.median(figure, 3):6.2f}"
                f"  {s.low(figure):6.3f}..{s.high(figure):.3f}"
            )


def _memory_table(r: Results) -> None:
    if not r.memory:
        return
    print(f"\npeak extra memory (one child process each; x the {r.state_bytes / MIB:.0f} MiB state)")
    for label, result in r.memory.items():
        if "error" in result:
            error = result["error"]
            shown = BACKGROUND_MISSING if "background saves" in error else f"n/a ({error})"
            print(f"  {label:<44} {shown}")
            continue
        print(
            f"  {label:<44} {result['extra_bytes'] / MIB:8.1f} MiB "
            f"{result['extra_bytes'] / result['state_bytes']:6.2f}x"
        )


def _scenario_tables(r: Results) -> None:
    if r.tiny:
        st_save, st_load = _median(r.tiny["safetensors save"]), _median(r.tiny["safetensors load"])
        print(f"\n{r.tiny_count:,} tiny tensors (4 float32 each), microseconds per tensor (x safetensors)")
        for figure, values in r.tiny.items():
            base = st_save if "save" in figure else st_load
            value = _median(values)
            print(f"  {figure:<30} {value / r.tiny_count * 1e6:8.1f} us {_ratio(value, base)}")
    if r.world2:
        dcp = _median(r.world2["DCP save"])
        print(f"\nworld size 2, replicated {r.world2_mib:.0f} MiB state (torchrun, gloo), seconds")
        for figure, values in r.world2.items():
            print(f"  {figure:<30} {_median(values):8.3f} {_ratio(_median(values), dcp)} DCP")
    if r.s3:
        size = r.s3["bytes"][0]
        print(
            f"\nS3 on moto (127.0.0.1), {size / MIB:.0f} MiB, MiB/s (x boto3); CPU seconds of this "
            "process (client) and of the moto server during each: the side a transfer waits on"
        )
        up, down = _median(r.s3["boto3 upload_file"]), _median(r.s3["boto3 download_file"])
        for figure in ("spotrun save", "boto3 upload_file", "spotrun restore", "boto3 download_file"):
            seconds = _median(r.s3[figure])
            base = up if figure in ("spotrun save", "boto3 upload_file") else down
            cpu = ""
            if f"{figure} client cpu" in r.s3:
                cpu = (
                    f"   client {_median(r.s3[f'{figure} client cpu']):5.2f} s CPU, "
                    f"server {_median(r.s3[f'{figure} server cpu']):5.2f} s CPU, wall {seconds:5.2f} s"
                )
            print(f"  {figure:<30} {size / MIB / seconds:8.1f} MiB/s {base / seconds:6.2f}x{cpu}")


def _targets(r: Results) -> list[tuple[str, str, str]]:
    """(target, measured, PASS / MISS / n/a)."""
    s = r.samples
    out: list[tuple[str, str, str]] = []

    def check(
        name: str,
        value: float | None,
        bound: float | None,
        detail: str,
        at_least: bool = False,
        missing: str = "not measured",
    ) -> None:
        if value is None or bound is None:
            out.append((name, missing, "n/a"))
            return
        ok = value >= bound if at_least else value <= bound
        out.append((name, detail, "PASS" if ok else "MISS"))

    save, dcp_save, dd = s.median("spotrun save"), s.median("DCP save"), s.median("dd direct write")
    check("durable save <= DCP save", save, dcp_save, f"{save:.3f} s vs {dcp_save:.3f} s")
    check(
        "durable save <= 1.3x dd direct write",
        save,
        1.3 * dd,
        f"{save:.3f} s vs 1.3 x {dd:.3f} s"
        + (" (DCP itself is under dd: the disk, not the code, bounds it)" if dcp_save < dd else ""),
    )
    restore, dcp_load = s.median("spotrun restore"), s.median("DCP load")
    check("cold restore <= DCP load", restore, dcp_load, f"{restore:.3f} s vs {dcp_load:.3f} s")
    stall, memcpy = s.median("spotrun background stall"), s.median("memcpy into preallocated buffers")
    check(
        "stall <= 1.5x memcpy of the state",
        stall,
        1.5 * memcpy,
        f"{stall or 0:.3f} s vs 1.5 x {memcpy:.3f} s",
        missing=BACKGROUND_MISSING,
    )
    for label, action_label, bound in (
        ("peak extra memory, emergency save <= 0.25x state", "spotrun save (sync, emergency)", 0.25),
        ("peak extra memory, background save <= 1.1x state", "spotrun background save (2 saves)", 1.1),
    ):
        result = r.memory.get(action_label)
        if not result or "error" in result:
            missing = BACKGROUND_MISSING if result and "background saves" in result["error"] else "not measured"
            check(label, None, None, "", missing=missing)
        else:
            x = result["extra_bytes"] / result["state_bytes"]
            check(label, x, bound, f"{x:.2f}x ({result['extra_bytes'] / MIB:.0f} MiB)")
    if r.tiny:
        for what, ours, theirs in (
            ("save", "spotrun save", "safetensors save"),
            ("restore", "spotrun restore", "safetensors load"),
        ):
            a, b = _median(r.tiny[ours]), _median(r.tiny[theirs])
            n = r.tiny_count
            check(
                f"tiny tensors {what} <= 2x safetensors per tensor",
                a,
                2 * b,
                f"{a / n * 1e6:.1f} us vs 2 x {b / n * 1e6:.1f} us",
            )
    else:
        check("tiny tensors <= 2x safetensors per tensor", None, None, "")
    if r.world2:
        a, b = _median(r.world2["spotrun save"]), _median(r.world2["DCP save"])
        check("durable save at world size 2 <= DCP save", a, b, f"{a:.3f} s vs {b:.3f} s")
    for ours, theirs in (("spotrun save", "boto3 upload_file"), ("spotrun restore", "boto3 download_file")):
        if r.s3:
            a, b = _median(r.s3[ours]), _median(r.s3[theirs])
            check(
                f"S3 {ours.split()[1]} >= 0.9x boto3 {theirs.split()[1]}",
                b / a,
                0.9,
                f"{r.s3['bytes'][0] / MIB / a:.1f} vs {r.s3['bytes'][0] / MIB / b:.1f} MiB/s",
                at_least=True,
            )
        else:
            check(f"S3 {ours.split()[1]} >= 0.9x boto3", None, None, "", missing="not run (--s3)")
    return out


def print_all(r: Results) -> None:
    _local_table(r)
    _memory_table(r)
    _scenario_tables(r)
    print("\ntargets (issue 9)")
    for name, detail, verdict in _targets(r):
        print(f"  {verdict:<5} {name:<52} {detail}")

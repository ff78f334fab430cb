"""The scale model's figures as text, and the tables of ``docs/design/scale.md`` (``--markdown``)."""

from __future__ import annotations

from tests.support.scale_model.model import ScaleConfig, run

GIB = 2**30
#: S3's documented request rates per partitioned prefix (PUT/COPY/POST/DELETE, GET/HEAD per second).
S3_PUTS_PER_S, S3_GETS_PER_S = 3500, 5500
#: The fast tier's restore throughput measured in docs/performance.md ("After the stall fix, with
#: S3": a 1 GiB step restored from this node's tier in 0.304 s, one 2-core machine).
FAST_TIER_RESTORE_BYTES_S = GIB / 0.304
#: GCP's preemption notice.
NOTICE_S = 30


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def text(r: dict) -> str:
    """Every figure of one run, one per line."""
    m = r["model"]
    lines = [
        f"model: {m['layers']} layers, hidden {m['hidden']}, FFN {m['ffn']}, vocabulary {m['vocab']}, "
        f"{m['heads']} heads ({m['kv_heads']} KV): {m['parameters'] / 1e9:.2f}B parameters, {m['tensors']} tensors, "
        f"{m['dtype']} parameters and AdamW moments: {_size(m['state_bytes'])} of files",
        f"layout: save {r['layout']['save']} on {r['config']['ranks']} ranks (mesh {r['layout']['mesh']}), "
        f"restore {r['layout']['restore']} on {r['config']['restore_ranks'] or r['config']['ranks']}; "
        f"store: {r['store']}",
        "planned: " + "; ".join(f"{k}: {v}" for k, v in r["planned"].items()),
        f"manifest_bytes: {r['manifest_bytes']} ({_size(r['manifest_bytes'])}; built in {r['manifest_build_s']} s "
        f"on rank 0, parsed in {r.get('manifest_parse_s', '-')} s on each rank)",
        f"reports gathered by every rank: {_size(r['report_bytes_gathered'])}",
        f"index_bytes_per_rank_max: {r['index_bytes_per_rank_max']} (mean {r['index_bytes_per_rank_mean']})",
        f"save: {r['save_objects']} objects; bytes per rank max {_size(r['save_bytes_per_rank']['max'])}, "
        f"per node max {_size(r['save_bytes_per_node']['max'])}",
        "save_requests: " + ", ".join(f"{k} {v}" for k, v in r["save_requests"].items()),
    ]
    if "restore_get_requests" in r:
        received = r["restore_bytes_received_per_rank"]
        lines += [
            "restore_get_requests: " + ", ".join(f"{k} {v}" for k, v in r["restore_get_requests"].items()),
            f"restore bytes read from storage per rank: max {_size(r['restore_bytes_per_rank']['max'])}, "
            f"mean {_size(r['restore_bytes_per_rank']['mean'])}; received from other ranks: max "
            f"{_size(received['max'])}, mean {_size(received['mean'])} (cooperative plan of every rank "
            f"in {r['restore_share_plan_s']} s)",
        ]
    if "non_cooperative" in r:
        n = r["non_cooperative"]
        lines += [
            "without cooperative restore (each rank reads all it needs): restore_get_requests "
            + ", ".join(f"{k} {v}" for k, v in n["restore_get_requests"].items())
            + f"; bytes per rank max {_size(n['restore_bytes_per_rank']['max'])}, "
            f"mean {_size(n['restore_bytes_per_rank']['mean'])}; busiest prefix {n['busiest_prefix_request_share']}",
        ]
    lines += [
        "busiest_prefix_request_share: " + ", ".join(f"{k} {v}" for k, v in r["busiest_prefix_request_share"].items()),
        "planning_s_per_rank: " + ", ".join(f"{k} {v}" for k, v in r["planning_s_per_rank"].items()),
        f"memory: staging per node {_size(r['memory']['staging_bytes_per_node_max'])}, "
        f"fast tier per node {_size(r['memory']['fast_tier_bytes_per_node_max'])}",
    ]
    if "dcp" in r:
        d = r["dcp"]
        lines += [
            f"DCP: .metadata {d['metadata_bytes']} bytes ({_size(d['metadata_bytes'])}, {d['metadata']}; "
            f"{d['chunks']} chunks)",
            "DCP save_requests: " + ", ".join(f"{k} {v}" for k, v in d["save_requests"].items()),
            "DCP restore_get_requests: " + ", ".join(f"{k} {v}" for k, v in d["restore_get_requests"].items()),
            f"DCP restore bytes per rank: max {_size(d['restore_bytes_per_rank']['max'])}, "
            f"mean {_size(d['restore_bytes_per_rank']['mean'])}",
        ]
    lines.append(f"(model ran {r['model_s']} s)")
    return "\n".join(lines)


#: The jobs of docs/design/scale.md: (ranks, layout), 70B, fp32 parameters and moments.
DOC_JOBS = (
    (1024, "fsdp"),
    (1024, "hsdp:16x64"),
    (1024, "fsdp+tp:8"),
    (1024, "ddp"),
    (8192, "fsdp"),
    (8192, "hsdp:128x64"),
    (8192, "ddp"),
)


def markdown(*, s3: bool, node_gbps: float, gpus_per_node: int, jobs=DOC_JOBS) -> str:
    """The figures section of docs/design/scale.md: one run per job, its tables and the times
    derived from them (``node_gbps``: network bandwidth per node)."""
    runs = [run(ScaleConfig(ranks=ranks, layout=layout, s3=s3, gpus_per_node=gpus_per_node)) for ranks, layout in jobs]
    flag = " --s3" if s3 else ""
    out = [
        "Commands (each prints these figures and more; `--json` for all of them):",
        "",
        "```sh",
        *(
            f"python benchmarks/scale_plan.py --ranks {r['config']['ranks']} --params 70e9 --layout "
            f"{r['config']['layout']}{flag}"
            for r in runs
        ),
        "```",
        "",
        "| figure | " + " | ".join(f"{r['layout']['save']}, {r['config']['ranks']} ranks" for r in runs) + " |",
        "| --- |" + " --- |" * len(runs),
    ]

    def row(name: str, values) -> None:
        out.append(f"| {name} | " + " | ".join(values) + " |")

    def gets(figures: dict) -> str:
        return (
            f"{figures['total']:,} ({figures.get('index', 0):,} / {figures.get('header', 0):,} / "
            f"{figures.get('data', 0):,})"
        )

    row("manifest", [_size(r["manifest_bytes"]) for r in runs])
    row(
        "manifest: built on rank 0 / parsed on each rank",
        [f"{r['manifest_build_s']} s / {r['manifest_parse_s']} s" for r in runs],
    )
    row("save reports gathered by every rank", [_size(r["report_bytes_gathered"]) for r in runs])
    row("index file per rank, max", [_size(r["index_bytes_per_rank_max"]) for r in runs])
    row("objects per save", [f"{r['save_objects']:,}" for r in runs])
    row("bytes per rank, max / mean", [_pair(r["save_bytes_per_rank"]) for r in runs])
    row("bytes per node (8 GPUs), max / mean", [_pair(r["save_bytes_per_node"]) for r in runs])
    row("requests per save", [f"{r['save_requests']['total']:,}" for r in runs])
    row("GETs per restore (index / header / data)", [gets(r["restore_get_requests"]) for r in runs])
    row("bytes read from storage per rank, max / mean", [_pair(r["restore_bytes_per_rank"]) for r in runs])
    row(
        "bytes received from other ranks per rank, max",
        [_size(r["restore_bytes_received_per_rank"]["max"]) for r in runs],
    )
    row(
        "without cooperative restore: GETs (index / header / data)",
        [gets(r["non_cooperative"]["restore_get_requests"]) for r in runs],
    )
    row(
        "without cooperative restore: bytes read per rank, max / mean",
        [_pair(r["non_cooperative"]["restore_bytes_per_rank"]) for r in runs],
    )
    row(
        "busiest prefix's share: save / restore (without cooperative restore)",
        [
            f"{r['busiest_prefix_request_share']['save']} / {r['busiest_prefix_request_share']['restore']} "
            f"({r['non_cooperative']['busiest_prefix_request_share']})"
            for r in runs
        ],
    )
    row(
        "planning per rank: save / restore",
        [f"{r['planning_s_per_rank']['save']} s / {r['planning_s_per_rank']['restore']} s" for r in runs],
    )
    row("restore planned", [r["planned"]["restore"].rsplit("(", 1)[-1].rstrip(")") for r in runs])
    row("staging memory per node", [_size(r["memory"]["staging_bytes_per_node_max"]) for r in runs])
    row("fast tier per node (2 steps)", [_size(r["memory"]["fast_tier_bytes_per_node_max"]) for r in runs])
    row("DCP .metadata", [_size(r["dcp"]["metadata_bytes"]) for r in runs])
    row("DCP GETs per restore", [f"{r['dcp']['restore_get_requests']['total']:,}" for r in runs])
    row("DCP bytes read per rank, max", [_size(r["dcp"]["restore_bytes_per_rank"]["max"]) for r in runs])
    out += ["", *_times(runs, node_gbps, gpus_per_node)]
    return "\n".join(out)


def _pair(figures: dict) -> str:
    return f"{_size(figures['max'])} / {_size(figures['mean'])}"


def _times(runs: list[dict], node_gbps: float, gpus_per_node: int) -> list[str]:
    """The times table: a save against GCP's notice, a restore from S3 and from the fast tier."""
    node_bytes_s = node_gbps * 1e9 / 8
    out = [
        f"Times derived from these figures at {node_gbps:g} Gbit/s per node, S3's {S3_PUTS_PER_S:,} PUT "
        f"and {S3_GETS_PER_S:,} GET per second per prefix, and the fast tier's measured "
        f"{FAST_TIER_RESTORE_BYTES_S / GIB:.1f} GiB/s:",
        "",
        "| time | " + " | ".join(f"{r['layout']['save']}, {r['config']['ranks']}" for r in runs) + " |",
        "| --- |" + " --- |" * len(runs),
    ]
    times = []
    for r in runs:
        share = r["busiest_prefix_request_share"]
        # a node's ranks read from S3 and receive from other ranks (gloo over TCP: the node's
        # network, counted in full); the busiest rank's bytes times the ranks of a node
        per_rank = r["restore_bytes_per_rank"]["max"] + r["restore_bytes_received_per_rank"]["max"]
        node_restore = per_rank * gpus_per_node
        times.append(
            {
                "save": r["save_bytes_per_node"]["max"] / node_bytes_s,
                "save_requests": r["save_requests"]["total"] * share["save"] / S3_PUTS_PER_S,
                "restore_bytes": node_restore / node_bytes_s,
                "restore_gets": r["restore_get_requests"]["total"] * share["restore"] / S3_GETS_PER_S,
                "restore_tier": r["save_bytes_per_node"]["max"] / FAST_TIER_RESTORE_BYTES_S,
            }
        )

    def row(name: str, values) -> None:
        out.append(f"| {name} | " + " | ".join(values) + " |")

    row("save: a node's bytes at the node's bandwidth", [f"{t['save']:.1f} s" for t in times])
    row("save: the busiest prefix's requests", [f"{t['save_requests']:.2f} s" for t in times])
    row(
        f"fits GCP's {NOTICE_S} s notice",
        ["yes" if max(t["save"], t["save_requests"]) < NOTICE_S else "no" for t in times],
    )
    row(
        "restore from S3: bytes read and received / the busiest prefix's GETs",
        [f"{t['restore_bytes']:.1f} s / {t['restore_gets']:.2f} s" for t in times],
    )
    row("restore from the fast tier (a node's own step)", [f"{t['restore_tier']:.1f} s" for t in times])
    return out

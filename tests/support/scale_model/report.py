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
        lines += [
            "restore_get_requests: " + ", ".join(f"{k} {v}" for k, v in r["restore_get_requests"].items()),
            f"restore bytes per rank: max {_size(r['restore_bytes_per_rank']['max'])}, "
            f"mean {_size(r['restore_bytes_per_rank']['mean'])}",
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
DOC_JOBS = ((1024, "fsdp"), (1024, "hsdp:16x64"), (1024, "fsdp+tp:8"), (1024, "ddp"), (8192, "fsdp"))


def markdown(*, s3: bool, node_gbps: float, gpus_per_node: int, jobs=DOC_JOBS) -> str:
    """The figures section of docs/design/scale.md: one run per job, its tables and the times
    derived from them (``node_gbps``: network bandwidth per node)."""
    node_bytes_s = node_gbps * 1e9 / 8
    runs = []
    for ranks, layout in jobs:
        config = ScaleConfig(ranks=ranks, layout=layout, s3=s3, gpus_per_node=gpus_per_node)
        runs.append(run(config))
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

    row("manifest", [_size(r["manifest_bytes"]) for r in runs])
    row(
        "manifest: built on rank 0 / parsed on each rank",
        [f"{r['manifest_build_s']} s / {r['manifest_parse_s']} s" for r in runs],
    )
    row("index file per rank, max", [_size(r["index_bytes_per_rank_max"]) for r in runs])
    row("objects per save", [str(r["save_objects"]) for r in runs])
    row("bytes per node (8 GPUs), max", [_size(r["save_bytes_per_node"]["max"]) for r in runs])
    row("requests per save", [f"{r['save_requests']['total']:,}" for r in runs])
    row("GETs per restore", [f"{r['restore_get_requests']['total']:,}" for r in runs])
    row(
        "  of them index / header / data",
        [
            f"{r['restore_get_requests'].get('index', 0):,} / {r['restore_get_requests'].get('header', 0):,} / "
            f"{r['restore_get_requests'].get('data', 0):,}"
            for r in runs
        ],
    )
    row("bytes read per rank at restore, max", [_size(r["restore_bytes_per_rank"]["max"]) for r in runs])
    row(
        "busiest prefix's share, save / restore",
        [f"{r['busiest_prefix_request_share']['save']} / {r['busiest_prefix_request_share']['restore']}" for r in runs],
    )
    row(
        "planning per rank, save / restore",
        [f"{r['planning_s_per_rank']['save']} s / {r['planning_s_per_rank']['restore']} s" for r in runs],
    )
    row("staging memory per node", [_size(r["memory"]["staging_bytes_per_node_max"]) for r in runs])
    row("fast tier per node (2 steps)", [_size(r["memory"]["fast_tier_bytes_per_node_max"]) for r in runs])
    row("DCP .metadata", [_size(r["dcp"]["metadata_bytes"]) for r in runs])
    row("DCP GETs per restore", [f"{r['dcp']['restore_get_requests']['total']:,}" for r in runs])
    row("DCP bytes read per rank, max", [_size(r["dcp"]["restore_bytes_per_rank"]["max"]) for r in runs])
    out += [
        "",
        f"Times derived from these figures at {node_gbps:g} Gbit/s per node, S3's {S3_PUTS_PER_S:,} PUT "
        f"and {S3_GETS_PER_S:,} GET per second per prefix, and the fast tier's measured "
        f"{FAST_TIER_RESTORE_BYTES_S / GIB:.1f} GiB/s:",
        "",
    ]
    out += [
        "| time | " + " | ".join(f"{r['layout']['save']}, {r['config']['ranks']}" for r in runs) + " |",
        "| --- |" + " --- |" * len(runs),
    ]
    for r in runs:
        node_restore = r["restore_bytes_per_rank"]["max"] * gpus_per_node
        share_save, share_restore = (
            r["busiest_prefix_request_share"]["save"],
            r["busiest_prefix_request_share"]["restore"],
        )
        r["_times"] = {
            "save": r["save_bytes_per_node"]["max"] / node_bytes_s,
            "save_requests": r["save_requests"]["total"] * share_save / S3_PUTS_PER_S,
            "restore_s3": max(
                node_restore / node_bytes_s, r["restore_get_requests"]["total"] * share_restore / S3_GETS_PER_S
            ),
            "restore_bytes": node_restore / node_bytes_s,
            "restore_gets": r["restore_get_requests"]["total"] * share_restore / S3_GETS_PER_S,
            "restore_tier": r["save_bytes_per_node"]["max"] / FAST_TIER_RESTORE_BYTES_S,
        }
    row("save: a node's bytes at the node's bandwidth", [f"{r['_times']['save']:.1f} s" for r in runs])
    row("save: its requests on the busiest prefix", [f"{r['_times']['save_requests']:.1f} s" for r in runs])
    row(
        f"fits GCP's {NOTICE_S} s notice",
        ["yes" if max(r["_times"]["save"], r["_times"]["save_requests"]) < NOTICE_S else "no" for r in runs],
    )
    row(
        "restore from S3: bytes / GETs on the busiest prefix",
        [f"{r['_times']['restore_bytes']:.1f} s / {r['_times']['restore_gets']:.0f} s" for r in runs],
    )
    row("restore from the fast tier (a node's own step)", [f"{r['_times']['restore_tier']:.1f} s" for r in runs])
    for r in runs:
        del r["_times"]
    return "\n".join(out)

"""Runs the scale model: the save and the restore of one simulated job, and DCP's layout of the
same state; returns every figure as one JSON-ready dict (``benchmarks/scale_plan.py`` prints it)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass

from spotrun.checkpoint.shard import ShardLimits
from spotrun.train.fast_tier import KEPT_STEPS
from tests.support.scale_model.dcp_side import dcp_save, dcp_save_requests
from tests.support.scale_model.restore_side import (
    SAMPLE_RANKS,
    RestorePlanner,
    dcp_restore_requests,
    restore_requests,
)
from tests.support.scale_model.save_side import SavePlanner, save_requests
from tests.support.scale_model.shapes import shape_for
from tests.support.scale_model.state import Layout, StateBuilder
from tests.support.scale_model.store import Store


@dataclass
class ScaleConfig:
    """One simulated job (the CLI's flags)."""

    ranks: int = 1024
    params: float = 70e9
    layout: str = "fsdp"
    dtype: str = "fp32"
    s3: bool = False
    restore_ranks: int | None = None
    restore_layout: str | None = None
    check_ranks: int = 2
    restore_sample: int = SAMPLE_RANKS
    dcp: bool = True
    restore: bool = True
    non_cooperative: bool = True
    gpus_per_node: int = 8
    step: int = 1000
    layers: int | None = None
    hidden: int | None = None
    ffn: int | None = None
    vocab: int | None = None
    heads: int | None = None
    kv_heads: int | None = None


def _share(prefixes: Counter) -> float:
    total = sum(prefixes.values())
    return max(prefixes.values()) / total if total else 0.0


def _per_node(bytes_of_rank: list[int], gpus_per_node: int) -> list[int]:
    nodes = [0] * -(-len(bytes_of_rank) // gpus_per_node)
    for rank, nbytes in enumerate(bytes_of_rank):
        nodes[rank // gpus_per_node] += nbytes
    return nodes


def run(config: ScaleConfig) -> dict:
    """Every figure of ``config``'s job (see ``docs/design/scale.md``)."""
    started = time.perf_counter()
    shape = shape_for(
        config.params,
        layers=config.layers,
        hidden=config.hidden,
        ffn=config.ffn,
        vocab=config.vocab,
        heads=config.heads,
        kv_heads=config.kv_heads,
    )
    store = Store("s3" if config.s3 else "files", config.ranks)
    layout = Layout.parse(config.layout, config.ranks)
    builder = StateBuilder(shape, layout, config.dtype)
    saved = SavePlanner(builder, store, config.step, ShardLimits())
    classes = saved.classes()
    count = max(1, config.check_ranks)  # evenly spread, the first and the last rank among them
    checked = sorted({round(i * (config.ranks - 1) / max(1, count - 1)) for i in range(count)})
    class_of = {rank: c for c in classes for rank in c.ranks}
    save_s = max(saved.check_rank(rank, class_of[rank]) for rank in checked)
    manifest, gathered_bytes, build_s = saved.manifest(classes)
    restore_layout = Layout.parse(config.restore_layout or config.layout, config.restore_ranks or config.ranks)
    result = _save_figures(config, shape, saved, classes, manifest, gathered_bytes, build_s, save_s, checked)
    result["layout"] = {"save": layout.name, "restore": restore_layout.name, "mesh": list(layout.mesh_shape)}
    if config.restore:
        restore_builder = builder if restore_layout == layout else StateBuilder(shape, restore_layout, config.dtype)
        restorer = RestorePlanner(saved, classes, manifest, restore_builder)
        plan = restorer.plan(sample=config.restore_sample)
        figures = _restore_figures(store, saved, classes, manifest, plan)
        result["busiest_prefix_request_share"]["restore"] = figures.pop("restore_share")
        result["planning_s_per_rank"]["restore"] = figures.pop("restore_plan_s")
        result["planned"]["restore"] = figures.pop("restore_planned")
        result["manifest_parse_s"] = round(restorer.manifest_parse_s, 3)
        result.update(figures)
        if config.non_cooperative or config.dcp:
            alone = restorer.plan(sample=config.restore_sample, cooperative=False)
            if config.non_cooperative:
                figures = _restore_figures(store, saved, classes, manifest, alone)
                result["non_cooperative"] = {
                    k: figures[k] for k in ("restore_get_requests", "restore_bytes_per_rank", "restore_planned")
                }
                result["non_cooperative"]["busiest_prefix_request_share"] = figures["restore_share"]
            if config.dcp:
                result["dcp"] = _dcp_figures(store, saved, alone)
    result["model_s"] = round(time.perf_counter() - started, 1)
    return result


def _save_figures(config, shape, saved, classes, manifest, gathered_bytes, build_s, save_s, checked) -> dict:
    kinds, prefixes = save_requests(saved.store, config.step, classes, len(manifest))
    file_bytes = [0] * config.ranks
    index_bytes = [0] * config.ranks
    files = 0
    for c in classes:
        for rank in c.ranks:
            file_bytes[rank] = sum(r.size_bytes for r in c.files.records)
            index_bytes[rank] = c.files.index_record.size_bytes
        files += len(c.ranks) * (len(c.files.records) + 1)
    nodes = _per_node([f + i for f, i in zip(file_bytes, index_bytes)], config.gpus_per_node)
    return {
        "config": asdict(config),
        "model": {
            **asdict(shape),
            "parameters": shape.parameter_count(),
            "tensors": len(saved.encoded.tensors) + len(saved.encoded.sharded),
            # DTensors with a replicated placement (HSDP: all; FSDP + TP: the norms and their moments)
            "replicated_placement_tensors": sum(
                any(p.is_replicate() for p in t.placements) for t in saved.encoded.sharded.values()
            ),
            "dtype": config.dtype,
            "state_bytes": sum(file_bytes),
        },
        "store": saved.store.kind,
        "manifest_bytes": len(manifest),
        "manifest_build_s": round(build_s, 3),
        "report_bytes_gathered": gathered_bytes,
        "index_bytes_per_rank_max": max(index_bytes),
        "index_bytes_per_rank_mean": round(sum(index_bytes) / config.ranks),
        "save_objects": files + 1,
        "save_bytes_per_rank": {"max": max(file_bytes), "mean": round(sum(file_bytes) / config.ranks)},
        "save_bytes_per_node": {"max": max(nodes), "mean": round(sum(nodes) / len(nodes))},
        "save_requests": {"total": sum(kinds.values()), **dict(kinds)},
        "busiest_prefix_request_share": {"save": round(_share(prefixes), 4)},
        "planning_s_per_rank": {"save": round(save_s, 3)},
        "memory": {
            "staging_bytes_per_rank_max": max(file_bytes),
            "staging_bytes_per_node_max": max(_per_node(file_bytes, config.gpus_per_node)),
            "fast_tier_bytes_per_node_max": KEPT_STEPS * max(nodes),
        },
        "planned": {
            "save": f"{len(classes)} classes of ranks with same-sized files, one rank each through the product's "
            f"file planning; ranks {checked} also through plan_writes from their own DTensors",
        },
    }


def _restore_figures(store, saved, classes, manifest, plan) -> dict:
    gets, prefixes, per_rank = restore_requests(store, plan, saved, classes, len(manifest))
    restoring = sum(count for count, _ in per_rank)
    received = [(count, reads.received) for count, reads in plan.classes]
    how = (
        "cooperative: who reads what by share_plan.plan_from_digests for every rank, then " if plan.cooperative else ""
    )
    return {
        "restore_get_requests": {"total": round(sum(gets.values())), **{k: round(v) for k, v in gets.items()}},
        "restore_bytes_per_rank": {
            "max": max(b for _, b in per_rank),
            "mean": round(sum(c * b for c, b in per_rank) / restoring),
        },
        "restore_bytes_received_per_rank": {
            "max": max(b for _, b in received),
            "mean": round(sum(c * b for c, b in received) / restoring),
        },
        "restore_share": round(_share(prefixes), 4),
        "restore_plan_s": round(max(reads.plan_s for _, reads in plan.classes), 3),
        "restore_share_plan_s": round(plan.share_s, 3),
        "restore_planned": f"{how}{len(plan.classes)} ranks through ChunkReader.plan_units ({plan.method})",
    }


def _dcp_figures(store, saved, plan) -> dict:
    dcp = dcp_save(saved)
    gets, per_rank = dcp_restore_requests(store, plan, dcp.metadata_bytes)
    kinds = dcp_save_requests(store, dcp)
    restoring = sum(count for count, _ in per_rank)
    return {
        "metadata_bytes": dcp.metadata_bytes,
        "metadata": dcp.how,
        "chunks": dcp.chunks,
        "save_requests": {"total": sum(kinds.values()), **dict(kinds)},
        "restore_get_requests": {"total": round(sum(gets.values())), **{k: round(v) for k, v in gets.items()}},
        "restore_bytes_per_rank": {
            "max": max(b for _, b in per_rank),
            "mean": round(sum(c * b for c, b in per_rank) / restoring),
        },
    }

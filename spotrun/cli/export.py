"""``spotrun export URI [--step N] --format hf OUT``: a step's model weights as Hugging Face
sharded safetensors (:mod:`spotrun.export.hf`)."""

from __future__ import annotations

import argparse

from spotrun.cli._shared import add_storage_options

#: Hugging Face's default largest shard (transformers' ``save_pretrained``, huggingface_hub's
#: ``save_torch_state_dict``). Kept here, not in :mod:`spotrun.export.plan`: building the
#: parser must not import torch (every ``spotrun`` command builds it).
DEFAULT_MAX_SHARD_SIZE = "5GB"


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``export`` to ``sub``."""
    p = sub.add_parser(
        "export",
        parents=[common],
        help="write a step's model weights as Hugging Face safetensors",
        description="Write one top-level state of a complete checkpoint step (the model, by default) as "
        "Hugging Face sharded safetensors: model-00001-of-0000K.safetensors files and "
        "model.safetensors.index.json (also for one file); loadable with "
        "huggingface_hub.load_torch_model, transformers or safetensors. Sharded (FSDP2, tensor parallel) "
        "checkpoints are assembled into full tensors, one output file in memory at a time. Tensor names "
        "are the state_dict() keys. Other files in OUT (config.json, a tokenizer) are left alone.",
    )
    p.add_argument("uri", metavar="URI", help="checkpoint root: local dir, file://, s3://, gs:// or az://bucket/prefix")
    p.add_argument("out", metavar="OUT", help="output directory or s3://bucket/prefix")
    p.add_argument("--format", choices=("hf",), default="hf", help="output format (default %(default)s)")
    p.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="the step to export; it must be complete (default: the newest complete step)",
    )
    p.add_argument(
        "--state",
        default="model",
        metavar="NAME",
        help="the top-level state to export, a key of Checkpointer(state={...}) (default %(default)s)",
    )
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help="most tensor bytes per file: 5GB, 500MB (powers of 1000), 2GiB (powers of 1024) or "
        "bytes; a larger tensor gets a file of its own (default %(default)s, as Hugging Face)",
    )
    p.add_argument(
        "--drop-tied",
        action="store_true",
        help="write a tied weight (an output head sharing the embedding) once, under the name "
        "the checkpoint stored it as, as huggingface_hub.save_torch_state_dict does (for "
        "safetensors.torch.load_model); default: under every name (for load_torch_model(strict=True))",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model*.safetensors files and index an earlier export left in OUT (default: refuse)",
    )
    add_storage_options(p)
    p.set_defaults(handler=_cmd_export, default_log_level="warning")


def _cmd_export(args: argparse.Namespace) -> int:
    from spotrun.cli._shared import human_size, location_of
    from spotrun.errors import ExportError
    from spotrun.export.hf import export_hf
    from spotrun.export.plan import parse_size

    max_shard_size_bytes = parse_size(args.max_shard_size)
    source = location_of(args.uri, args).open_existing()
    out_location = location_of(args.out, args)
    out = out_location.open()
    if out_location.blocked_by_file():
        raise ExportError(f"{out.uri} is not a directory: the output is a directory (or s3://bucket/prefix)")
    result = export_hf(
        source,
        out,
        step=args.step,
        state_name=args.state,
        max_shard_size_bytes=max_shard_size_bytes,
        tied="drop" if args.drop_tied else "copy",
        overwrite=args.overwrite,
    )
    plan = result.plan
    count = sum(len(s.tensors) for s in plan.shards)
    print(
        f"exported step {plan.step}, state {plan.state_name!r}: {count} tensors, "
        f"{human_size(plan.total_size_bytes)}, to {result.out_uri}"
    )
    width = max(len(name) for name in result.file_sizes)
    tensors_in = {s.filename: len(s.tensors) for s in plan.shards}
    for name, size_bytes in result.file_sizes.items():
        count = tensors_in.get(name)
        what = "index" if count is None else f"{count} tensor{'s' if count != 1 else ''}"
        print(f"  {name.ljust(width)}  {human_size(size_bytes):>10}  {what}")
    for key, kept in plan.tied.items():
        how = "left out (--drop-tied)" if plan.dropped_tied else "written as a copy of it"
        print(f"tied: {key} is {kept}; {how}")
    if plan.skipped:
        more = f" and {len(plan.skipped) - 5} more" if len(plan.skipped) > 5 else ""
        print(f"not exported (not tensors): {', '.join(plan.skipped[:5])}{more}")
    for name in result.removed:
        print(f"removed {name} (from an earlier export)")
    return 0

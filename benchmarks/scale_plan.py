"""The scale model: spotrun's save and restore plans for a simulated job of thousands of ranks,
planned by the product's own code in one process with no tensor data (meta tensors), and DCP's
layout of the same state for comparison. What it computes and how: docs/design/scale.md.

    python benchmarks/scale_plan.py --ranks 1024 --params 70e9 --layout fsdp [--s3] [--json]
    python benchmarks/scale_plan.py --ranks 1024 --layout hsdp:16x64 --restore-ranks 512 --restore-layout hsdp:8x64
    python benchmarks/scale_plan.py --markdown --s3      # the figures of docs/design/scale.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from tests.support.scale_model.model import ScaleConfig, run  # noqa: E402
from tests.support.scale_model.report import markdown, text  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=1024, help="world size of the save (default 1024)")
    parser.add_argument(
        "--params", type=float, default=70e9, help="model size: the nearest Llama 3 shape (8e9, 70e9, 405e9)"
    )
    parser.add_argument("--layout", default="fsdp", help="ddp, fsdp, hsdp:RxS or fsdp+tp:T (default fsdp)")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="parameters and AdamW's moments (torch keeps the moments in the parameter's dtype; "
        "default fp32: FSDP2's sharded parameters with bf16 compute)",
    )
    parser.add_argument("--s3", action="store_true", help="count S3's requests (multipart parts, ranged GETs)")
    parser.add_argument("--restore-ranks", type=int, help="world size of the restore (default: the save's)")
    parser.add_argument("--restore-layout", help="layout of the restore (default: the save's)")
    parser.add_argument(
        "--check-ranks", type=int, default=2, help="ranks also planned from their own DTensors (default 2)"
    )
    parser.add_argument(
        "--restore-sample", type=int, default=64, help="restoring ranks planned when they form no classes"
    )
    parser.add_argument("--no-dcp", action="store_true", help="leave out DCP's figures")
    parser.add_argument(
        "--cooperative-only",
        action="store_true",
        help="leave out the figures without cooperative restore (each rank reading all it needs itself)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8)
    for name in ("layers", "hidden", "ffn", "vocab", "heads", "kv-heads"):
        parser.add_argument(f"--{name}", type=int, help=f"override the shape's {name}")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one JSON object")
    output.add_argument("--markdown", action="store_true", help="the docs page's tables (runs its list of jobs)")
    parser.add_argument("--node-gbps", type=float, default=25.0, help="--markdown: network bandwidth per node, Gbit/s")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(s3=args.s3, node_gbps=args.node_gbps, gpus_per_node=args.gpus_per_node))
        return 0
    config = ScaleConfig(
        ranks=args.ranks,
        params=args.params,
        layout=args.layout,
        dtype=args.dtype,
        s3=args.s3,
        restore_ranks=args.restore_ranks,
        restore_layout=args.restore_layout,
        check_ranks=args.check_ranks,
        restore_sample=args.restore_sample,
        dcp=not args.no_dcp,
        non_cooperative=not args.cooperative_only,
        gpus_per_node=args.gpus_per_node,
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn,
        vocab=args.vocab,
        heads=args.heads,
        kv_heads=args.kv_heads,
    )
    try:
        result = run(config)
    except ValueError as exc:  # a layout that does not fit its rank count
        parser.error(str(exc))
    print(json.dumps(result, indent=None) if args.json else text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

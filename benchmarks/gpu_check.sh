#!/usr/bin/env bash
# The GPU check, in under 10 minutes on one GPU: the tests marked `gpu` (pinned staging, the
# device-to-host copies issued together, every CUDA generator restored, restores into device
# tensors, NCCL jobs on every device stopped and resumed bit-exactly; tests/gpu/), then the engine
# benchmark with the state on the GPU (benchmarks/checkpoint_vs_peers.py --device cuda).
#
#   benchmarks/gpu_check.sh [OUT_DIR]          (default OUT_DIR: gpu-check; logs and figures go there)
#
# Needs python3 with a CUDA build of torch and spotrun's runtime dependencies. A machine without
# network access gets the missing ones as wheels in a directory named by WHEELS, fetched beforehand
# on a machine with access, for that machine's Python (3.12 here):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     blake3 tenacity boto3 botocore s3transfer jmespath
#   WHEELS=.whl benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${1:-gpu-check}
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spotrun-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/spotrun-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
status=0
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import sys, torch, spotrun; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
} 2>&1 | tee "$out/machine.txt"
# The tests: about 2 minutes (three short torchrun jobs per layout).
timeout 360 python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu tests/gpu -v -rs 2>&1 | tee "$out/gpu-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# The engine against DCP, safetensors and torch.save on a 2 GiB state on the GPU: about 2 minutes.
timeout 210 python3 benchmarks/checkpoint_vs_peers.py --device cuda --size-mib 2048 --rounds 3 \
    --no-memory --no-tiny --no-world2 2>&1 | tee "$out/engine-cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status

#!/usr/bin/env bash
# Cloud VM startup script: install spotrun + PyTorch and run the training job under
# systemd (deploy/vm/spotrun-train.service). Use it as
#   AWS:   user data (runs on the first boot only; the enabled unit starts on later boots)
#   GCP:   metadata key startup-script (runs on every boot: this script is idempotent)
#   Azure: custom data / cloud-init (first boot)
# on a Debian/Ubuntu image with Python >= 3.10 (and the NVIDIA driver on GPU images).
#
# Edit the settings below, or pass them in the environment. The project is installed
# from a git checkout, which also provides the unit file and the example configs, so
# the VM runs exactly the deploy files of that revision.
set -euo pipefail

# ---- settings -------------------------------------------------------------------
# Where the project comes from (required): a git URL the VM can clone, and a tag/commit.
SPOTRUN_GIT_URL="${SPOTRUN_GIT_URL:?set SPOTRUN_GIT_URL to the spotrun git repository}"
SPOTRUN_GIT_REF="${SPOTRUN_GIT_REF:-main}"
# Which config of configs/ to use on this VM: aws-spot | gce-spot | azure-spot | local.
# An existing /etc/spotrun/config.yaml is never overwritten (bring your own that way).
SPOTRUN_CONFIG_NAME="${SPOTRUN_CONFIG_NAME:-aws-spot}"
# PyTorch: PyPI's Linux x86_64 wheel is the CUDA build; for CPU-only VMs use
# https://download.pytorch.org/whl/cpu.
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://pypi.org/simple}"
# Checkpoint bucket and prefix (read by the config's ${SPOTRUN_BUCKET}/${SPOTRUN_PREFIX}).
SPOTRUN_BUCKET="${SPOTRUN_BUCKET:-my-training-bucket}"
SPOTRUN_PREFIX="${SPOTRUN_PREFIX:-gpt-small/run-1}"
# The trainer: torchrun -m MODULE ARGS, one process per GPU (1 without GPUs).
SPOTRUN_TRAIN_MODULE="${SPOTRUN_TRAIN_MODULE:-spotrun.examples.train_gpt}"
SPOTRUN_TRAIN_ARGS="${SPOTRUN_TRAIN_ARGS:---steps 600}"
gpus="$( (nvidia-smi --list-gpus 2>/dev/null || true) | grep -c '^GPU' || true)"
SPOTRUN_NPROC_PER_NODE="${SPOTRUN_NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}"
# ----------------------------------------------------------------------------------

PREFIX=/opt/spotrun
SRC="$PREFIX/src"
VENV="$PREFIX/venv"
log() { echo "spotrun-startup: $*" >&2; }

if ! command -v git >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    log "installing git and python3-venv"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends git python3-venv ca-certificates
fi

id spotrun >/dev/null 2>&1 || useradd --system --home-dir /var/lib/spotrun --shell /usr/sbin/nologin spotrun

# Install (or update) only when the wanted revision is not the installed one.
mkdir -p "$PREFIX"
if [ ! -d "$SRC/.git" ]; then
    git clone --quiet "$SPOTRUN_GIT_URL" "$SRC"
fi
git -C "$SRC" fetch --quiet origin "$SPOTRUN_GIT_REF"
wanted="$(git -C "$SRC" rev-parse FETCH_HEAD)"
if [ "$(cat "$PREFIX/installed-rev" 2>/dev/null || true)" != "$wanted" ]; then
    log "installing spotrun $wanted with torch $TORCH_VERSION"
    git -C "$SRC" checkout --quiet --detach "$wanted"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
    # The gs:// and az:// backends' client libraries come with the extras (configs/gce-spot.yaml
    # and configs/azure-spot.yaml use them).
    "$VENV/bin/pip" install --quiet "${SRC}[gcs,azure]"
    install -m 0644 "$SRC/deploy/vm/spotrun-train.service" /etc/systemd/system/spotrun-train.service
    echo "$wanted" > "$PREFIX/installed-rev"
fi

# Config: an existing file is kept, so it can be edited on the VM or baked into the image.
install -d -m 0755 /etc/spotrun
if [ ! -f /etc/spotrun/config.yaml ]; then
    install -m 0644 "$SRC/configs/$SPOTRUN_CONFIG_NAME.yaml" /etc/spotrun/config.yaml
fi
# Variables for the unit (and for ${...} in the config). Credentials: on AWS the
# instance profile, on GCE the VM's service account, on Azure its managed identity need
# none (Azure needs the account's name: AZURE_STORAGE_ACCOUNT); for another S3-compatible
# store add AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and SPOTRUN_S3_ENDPOINT_URL /
# AWS_ENDPOINT_URL_S3 here, or better from the cloud's secret manager. Mode 0600: only
# root (systemd) reads it.
if [ ! -f /etc/spotrun/env ]; then
    umask 077
    cat > /etc/spotrun/env <<ENV
SPOTRUN_BUCKET=$SPOTRUN_BUCKET
SPOTRUN_PREFIX=$SPOTRUN_PREFIX
SPOTRUN_NPROC_PER_NODE=$SPOTRUN_NPROC_PER_NODE
SPOTRUN_TRAIN_MODULE=$SPOTRUN_TRAIN_MODULE
SPOTRUN_TRAIN_ARGS=$SPOTRUN_TRAIN_ARGS
ENV
    if [ -n "${AZURE_STORAGE_ACCOUNT:-}" ]; then
        echo "AZURE_STORAGE_ACCOUNT=$AZURE_STORAGE_ACCOUNT" >> /etc/spotrun/env
    fi
fi

systemctl daemon-reload
systemctl enable spotrun-train.service
# A no-op if the unit already runs. After a finished run the trainer restores its last
# step, sees that nothing is left to do and exits 0.
systemctl start --no-block spotrun-train.service
log "spotrun-train started: journalctl -u spotrun-train -f"

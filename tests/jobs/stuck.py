"""Fake worker stuck outside the training loop, deaf to SIGTERM, with a Checkpointer.

It creates a :class:`spotrun.Checkpointer` (which starts the supervisor watch under
``spotrun run``), then ignores SIGTERM and sleeps forever, as a rank blocked in a collective
that never returns would: it never reaches a step boundary, so only the watch's kill can
end it once the supervisor is gone.

usage: stuck.py STATE_DIR
    STATE_DIR/ready    this process's pid, written once the Checkpointer exists
"""

import os
import pathlib
import signal
import sys
import time

import torch

import spotrun


def main() -> int:
    state_dir = pathlib.Path(sys.argv[1])
    ckpt = spotrun.Checkpointer({"model": {"w": torch.zeros(4)}}, handle_signals=False)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (state_dir / "ready.tmp").write_text(str(os.getpid()))
    os.replace(state_dir / "ready.tmp", state_dir / "ready")
    while True:
        time.sleep(60)
    ckpt.close()


if __name__ == "__main__":
    sys.exit(main())

"""The README's library loop, read out of README.md as printed, and the README's commands for it.

From a new user's trial (issue 20): the loop seeded only torch, so `spotrun drill` failed on
the states of Python's `random` and NumPy, which spotrun saves and compares although the loop
never draws from them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.support.paths import REPO

README = REPO / "README.md"


def readme_blocks(language: str) -> list[str]:
    """The README's fenced blocks of ``language``, without their fences."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


def readme_loop() -> str:
    """The library guide's training loop, exactly as printed."""
    [loop] = [block for block in readme_blocks("python") if "spotrun.Checkpointer(" in block and "while step" in block]
    return loop


def readme_command(first_words: str) -> list[str]:
    """The README's command line for the loop (saved as ``train.py``) that starts with ``first_words``."""
    [line] = [
        line
        for block in readme_blocks("sh")
        for line in block.splitlines()
        if line.startswith(first_words) and line.endswith("train.py")
    ]
    return shlex.split(line)


def user_env() -> dict[str, str]:
    """The environment of a user whose virtual environment is active: ``torchrun`` on the PATH."""
    return {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


def test_the_readme_loop_is_complete_and_seeds_every_generator_spotrun_saves():
    loop = readme_loop()
    compile(loop, "train.py", "exec")
    assert "MyModel" not in loop and "model = " in loop and "dataset = " in loop  # nothing left for the user to fill in
    for seeding in ("random.seed(", "np.random.seed(", "torch.manual_seed("):
        assert seeding in loop


@pytest.mark.slow
def test_the_readme_loop_passes_the_readme_drill(tmp_path):
    """issue 20: `spotrun drill` as the README prints it, on the README's loop as printed, passes:
    the resumed step is bit-identical to an uninterrupted run's, every RNG state included."""
    (tmp_path / "train.py").write_text(readme_loop())
    words = readme_command("spotrun drill ")
    result = subprocess.run(
        [sys.executable, "-m", "spotrun", *words[1:]],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "PASSED" in result.stdout and "is bit-identical on every rank" in result.stdout, result.stdout

"""The documentation: a short README, and the site under docs/ built by MkDocs in strict mode.

A broken link or anchor, a missing page or a page left out of the nav fails the build
(mkdocs.yml turns each into a warning, --strict each warning into a failure). The CLI and
configuration references are generated while the site is built (docs/hooks/generate.py): the
tests check that they name every subcommand and option, so the generation is real.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.support.paths import REPO

ROOT = REPO
README = ROOT / "README.md"
README_MAX_BYTES = 16 * 1024


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site, built once with ``mkdocs build --strict`` into a temporary directory."""
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # a banner about MkDocs 2, not about these docs
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "WARNING" not in output, output[-6000:]
    return site_dir


def page_html(site: pathlib.Path, doc: str) -> str:
    """The built HTML of ``doc`` (a path under docs/, such as ``guide/drill.md``)."""
    stem = doc[: -len(".md")]
    built = site / "index.html" if stem == "index" else site / stem.removesuffix("/index") / "index.html"
    return built.read_text()


def html_ids(html: str) -> set[str]:
    return set(re.findall(r'\sid="([^"]+)"', html))


def sh_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_the_site_builds_in_strict_mode(site):
    assert (site / "index.html").is_file()
    assert not (site / "hooks").exists(), "the hook is a build script, not a page"


def test_readme_is_at_most_16_kb():
    assert README.stat().st_size <= README_MAX_BYTES, f"README.md is {README.stat().st_size} bytes"


def test_readme_first_sh_block_holds_the_two_setup_commands():
    """`.ci/run` runs the second line of the README's first sh block (comments and blank lines aside)."""
    lines = [
        line for line in sh_blocks(README.read_text())[0].splitlines() if line.strip() and not line.startswith("#")
    ]
    assert len(lines) == 2, lines
    main_job, test_suite = lines
    assert main_job.startswith("python3 -m venv .venv") and "pip install -e . " in main_job
    assert "spotrun run -- torchrun" in main_job
    assert test_suite.startswith("python3 -m venv .venv") and "pip install -e '.[test]'" in test_suite
    assert test_suite.endswith("&& pytest")


def test_readme_and_contributing_links_resolve_to_files_and_anchors(site):
    """Links that leave the site (the README's into docs/, CONTRIBUTING.md's) are not checked by
    mkdocs: every relative one must name an existing file, and an anchor in a docs page must exist."""
    for source in (README, ROOT / "CONTRIBUTING.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            assert (ROOT / path).exists(), f"{source.name}: {target}: no such file"
            if anchor:
                assert path.startswith("docs/") and path.endswith(".md"), f"{source.name}: {target}"
                ids = html_ids(page_html(site, path.removeprefix("docs/")))
                assert anchor in ids, f"{source.name}: {target}: no such anchor"


def test_the_guide_loop_is_the_readme_loop():
    """docs/guide/training-loop.md prints the README's loop, which tests/e2e/test_readme_loop.py runs."""
    [readme_loop] = [b for b in python_blocks(README.read_text()) if "spotrun.Checkpointer(" in b]
    guide = (ROOT / "docs" / "guide" / "training-loop.md").read_text()
    assert readme_loop in python_blocks(guide)
    assert sh_blocks(README.read_text())[1] in sh_blocks(guide)


def test_the_cli_reference_is_generated_from_every_subcommand_and_option(site):
    from spotrun.cli import _build_parser

    html = page_html(site, "reference/cli.md")
    ids = html_ids(html)
    [subparsers] = [a for a in _build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    assert len(subparsers.choices) >= 8
    for name, parser in subparsers.choices.items():
        assert f"spotrun-{name}" in ids, f"spotrun {name} is not in the CLI reference"
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in html, f"spotrun {name} {flag} is not in the CLI reference"


def test_the_configuration_reference_is_generated_from_every_option(site):
    from spotrun.supervisor.config import SupervisorConfig

    html = page_html(site, "reference/configuration.md")
    options = [f for f in dataclasses.fields(SupervisorConfig) if "option" in f.metadata]
    assert len(options) >= 20
    for field in options:
        assert f'id="{field.name}"' in html, f"{field.name} is not in the configuration reference"
        first_words = field.metadata["option"]["help"].split("(")[0].split(";")[0][:30]
        assert first_words.lower() in html.lower(), f"{field.name}'s help is not in the configuration reference"


def test_the_python_api_lists_every_checkpointer_setting_with_its_line(site):
    import inspect

    from spotrun.train.options import CheckpointerOptions

    html = page_html(site, "reference/python-api.md")
    parameters = set(inspect.signature(__import__("spotrun").Checkpointer).parameters)
    for field in dataclasses.fields(CheckpointerOptions):
        assert field.name in parameters
        assert f"<code>{field.name}</code></td>" in html, f"{field.name} is not in the Python API page"
    assert "Consecutive failed periodic saves tolerated" in html  # the line under the field

"""The package's layout holds: rooms import only rooms below them, and the torch-free rooms stay so.

The layers are read from the source with ``ast`` (nothing is imported), so a new import against
the grain, or a module loose at the top, fails here before it can erode the layout
(docs: CONTRIBUTING.md, "The house").
"""

from __future__ import annotations

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

import spotrun

PACKAGE = pathlib.Path(spotrun.__file__).parent

#: Each room's layer: a module may import only from rooms of a lower layer (or its own room).
LAYERS = {
    "errors": 0,
    "_version": 0,
    "tools": 1,
    "control": 2,
    "storage": 3,
    "notices": 3,
    "checkpoint": 4,
    "state": 5,
    "data": 5,
    "eventlog": 5,
    "train": 6,
    "supervisor": 6,
    "export": 7,
    "drill": 7,
    "__init__": 8,  # the package's public names (spotrun.Checkpointer, ...)
    "examples": 9,
    "cli": 9,
    "__main__": 10,
}
#: The modules allowed loose at the package's top level.
TOP_LEVEL_MODULES = {"__init__", "__main__", "errors", "_version"}
#: Rooms a supervisor process imports: torch must stay out of them (it takes seconds to load,
#: and a SIGTERM right after `spotrun run` starts must find its handlers installed).
TORCH_FREE_ROOMS = ("tools", "control", "storage", "notices", "supervisor", "eventlog", "cli")
#: The modules of a torch-free room that import torch, on use: process groups and their bounded collectives.
TORCH_MODULES_IN_TORCH_FREE_ROOMS = {"spotrun.tools.dist", "spotrun.tools.collectives"}


def room_of(module: str) -> str:
    """``spotrun.train.saving`` -> ``train``; ``spotrun`` -> ``__init__``; ``spotrun.errors`` -> ``errors``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.cache
def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(module: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """Every ``spotrun`` module that ``module`` imports (also inside functions), with its line."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from spotrun.x import y` imports spotrun.x, and spotrun.x.y where y is a module
            names.append((node.module, node.lineno))
            names += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    known = modules()
    return [(name, line) for name, line in names if name in known and name.startswith("spotrun")]


def test_the_top_level_holds_only_the_package_entry_points():
    loose = {path.stem for path in PACKAGE.glob("*.py")}
    assert loose <= TOP_LEVEL_MODULES, f"modules loose at the top: {sorted(loose - TOP_LEVEL_MODULES)}"


def test_every_room_says_what_it_does():
    for room in sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py")):
        assert room in LAYERS, f"spotrun/{room}/ has no layer in LAYERS"
        doc = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) <= 12, f"spotrun/{room}/__init__.py: a few lines on the room"
        assert "import" in doc.lower(), f"spotrun/{room}/__init__.py: say which rooms it may import"


def test_rooms_import_only_rooms_below_them():
    against = []
    for module, path in modules().items():
        room = room_of(module)
        for target, line in imported_modules(module, path):
            target_room = room_of(target)
            if target_room != room and LAYERS[target_room] >= LAYERS[room]:
                against.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {room} -> {target_room} ({target})")
    assert not against, "imports against the layering:\n" + "\n".join(against)


def test_the_layering_check_catches_an_import_against_the_grain(tmp_path):
    """The check above can fail: a storage module importing the training library is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from spotrun.train.checkpointer import Checkpointer\n")
    targets = [room_of(name) for name, _ in imported_modules("spotrun.storage.bad", bad)]
    assert "train" in targets and LAYERS["train"] >= LAYERS["storage"]


@pytest.mark.parametrize("room", TORCH_FREE_ROOMS)
def test_torch_free_rooms_import_no_torch(room):
    code = (
        "import importlib, pkgutil, sys\n"
        f"import spotrun.{room} as room\n"
        f"skip = {sorted(TORCH_MODULES_IN_TORCH_FREE_ROOMS)!r}\n"
        f"for info in pkgutil.walk_packages(room.__path__, 'spotrun.{room}.'):\n"
        "    if info.name in skip or info.name.endswith('__main__'):\n"
        "        continue\n"
        "    importlib.import_module(info.name)\n"
        "    assert 'torch' not in sys.modules, f'{info.name} imports torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_supervisor_starts_without_importing_torch():
    """`spotrun run --help` loads no torch: the supervisor installs its signal handlers at once."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "spotrun", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "spotrun.supervisor.run" in imported or "spotrun.cli" in imported  # the log is real
    assert "torch" not in imported, "spotrun run imported torch"


def test_the_supervisor_shares_the_save_rule_without_importing_torch():
    """`spotrun run` must install its signal handlers at once: importing torch (seconds on a
    busy machine) before that would let an early SIGTERM kill it."""
    code = "import sys, spotrun.cli, spotrun.supervisor.estimate; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


#: The longest a module or a function may grow before it is split (issue 22's measure).
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_stay_short_enough_to_read():
    too_long = []
    for module, path in modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{module}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {lines} lines")
    assert not too_long, "split these:\n" + "\n".join(too_long)

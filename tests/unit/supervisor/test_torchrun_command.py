"""Reading a torchrun command line without importing torch: the same answer as torchrun's own
parser for every spelling it covers, and torchrun's parser for everything else."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spotrun.supervisor import torchrun_command
from spotrun.supervisor.torchrun_command import read_torchrun_command

FIELDS = ("nnodes", "nproc_per_node", "rdzv_backend", "rdzv_conf", "standalone")


def torch_parser_options() -> dict[str, bool]:
    """Every option string of the installed torch's torchrun parser: takes a value or not."""
    from torch.distributed.run import get_args_parser

    options = {}
    for action in get_args_parser()._actions:
        for name in action.option_strings:
            if name not in ("-h", "--help"):
                options[name] = action.nargs != 0
    return options


def test_the_table_is_the_installed_torchruns_options():
    """A torch release that adds, drops or changes an option fails here (the table must
    follow); at run time an option missing from the table goes to torchrun's parser."""
    torch_options = torch_parser_options()
    long_names = {name for name in torch_options if name.startswith("--")}
    assert {"--" + name[2:].replace("_", "-") for name in long_names} == set(torchrun_command._OPTION_TAKES_VALUE)
    for name, takes_value in torch_options.items():
        long_name = torchrun_command._SHORT_OPTIONS.get(name, name)
        assert torchrun_command._OPTION_TAKES_VALUE["--" + long_name[2:].replace("_", "-")] == takes_value, name
    for name in long_names:  # every spelling the table accepts is one torchrun accepts
        if "_" in name:
            assert name.replace("_", "-") in torch_options, name
        elif "-" in name[2:]:
            assert "--" + name[2:].replace("-", "_") in torch_options, name


COMMAND_LINES = [
    ["--standalone", "--nproc-per-node", "2", "train.py", "--steps", "10"],
    ["--nnodes=1:4", "--nproc_per_node=8", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "-m", "pkg.train"],
    ["--nnodes", "2", "--nproc-per-node", "auto", "--rdzv-conf", "last_call_timeout=5,join_timeout=9", "train.py"],
    ["--max-restarts", "3", "-r", "3", "-t", "0", "--log-dir", "/tmp/x", "--no-python", "echo", "--nnodes", "9"],
    ["--nnodes", "3", "--nproc-per-node", "1", "--standalone", "--shutdown-timeout", "90", "train.py"],
    ["train.py"],
]


@pytest.mark.parametrize("args", COMMAND_LINES, ids=lambda args: " ".join(args)[:40])
def test_the_common_spellings_read_as_torchruns_parser_reads_them(args, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    fast = torchrun_command._parse_common(args)
    assert fast is not None
    exact = torchrun_command._parse(args)
    assert {f: str(getattr(fast, f)) for f in FIELDS} == {f: str(getattr(exact, f)) for f in FIELDS}


@pytest.mark.parametrize(
    "args",
    [
        ["--nproc-per", "2", "train.py"],  # an abbreviation: argparse's rules decide
        ["--nnodes", "2"],  # no training script: torchrun's parser reports it
        ["--standalone=1", "train.py"],
        ["--no-such-option", "train.py"],
        ["-mpkg.train"],
        ["--", "train.py"],
    ],
)
def test_anything_else_goes_to_torchruns_parser(args):
    assert torchrun_command._parse_common(args) is None


def test_an_environment_default_goes_to_torchruns_parser(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "1:2")
    assert torchrun_command._parse_common(["--standalone", "train.py"]) is None
    launch = read_torchrun_command(["torchrun", "--nproc-per-node", "2", "train.py"])
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (1, 2, 2)


def test_an_abbreviation_is_read_by_torchruns_parser():
    launch = read_torchrun_command(["torchrun", "--nproc-per", "3", "--nnodes", "1:2", "train.py"])
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (1, 2, 3)


def test_reading_a_plain_torchrun_command_does_not_import_torch():
    """The supervisor reads the launch command before starting it: importing torch there
    took over 2 s and hundreds of MiB."""
    code = (
        "import sys; from spotrun.supervisor.torchrun_command import read_torchrun_command as r\n"
        "launch = r(['torchrun', '--standalone', '--nproc-per-node', '2', 'train.py'])\n"
        "assert (launch.min_nodes, launch.nproc_per_node, launch.standalone) == (1, 2, True), launch\n"
        "print('torch' in sys.modules)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("PET_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False", out.stderr

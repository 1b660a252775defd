"""utils/environment.py: which processes are qkmla's command line (whose thread variables are
checked before torch loads), read from the original command line."""

import pytest

from qkmla.utils.environment import command_line_name


@pytest.mark.parametrize("argv,command", [
    (["python", "-m", "qkmla", "train", "--steps", "2"], "train"),
    (["python", "-X", "dev", "-m", "qkmla", "--help"], None),  # no subcommand: argparse answers
    (["python", "-mqkmla", "cache-size"], "cache-size"),
    (["python", "-m", "qkmla.train", "--steps", "2"], "train"),
    (["/venv/bin/python", "/venv/bin/qkmla", "plot", "runs/x"], "plot"),  # the console script
    (["python", "-m", "pytest", "tests"], None),
    (["python", "-m", "qkmla.cli"], None),
    (["python", "bench_decode.py", "train"], None),  # a script that imports qkmla
    (["python", "-c", "import qkmla"], None),
    (["python"], None),
    # combined interpreter options (the first of c, m, W, X takes the rest of the word or the next)
    (["python", "-Bm", "qkmla.train", "--steps", "3"], "train"),
    (["python", "-Bum", "qkmla", "verify"], "verify"),
    (["python", "-BmPkg", "qkmla"], None),  # -m Pkg: another module, whose argument is qkmla
    (["python", "-Wd", "-m", "qkmla", "demo"], "demo"),
    (["python", "-W", "ignore", "-OO", "-m", "qkmla", "demo"], "demo"),
    (["python", "-Bc", "import qkmla", "qkmla", "train"], None),
    (["python", "-Xdev", "/venv/bin/qkmla", "plot"], "plot"),
    (["python", "-B", "-m"], None),
])
def test_command_line_name(argv, command):
    assert command_line_name(argv) == command

"""``torchrun --nproc_per_node N -m qkmla.train ...``: the same arguments as ``qkmla train``.

It is ``qkmla train`` itself (``cli.commands.main``), not a second dispatcher: the one place that
turns a refusal, the machine's error, a closed pipe, a signal or a non-UTF-8 path into one line
and an exit status serves both."""

import sys


def main(argv=None) -> int:
    from ..cli.commands import main as qkmla_main

    return qkmla_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

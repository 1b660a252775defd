"""``torchrun --nproc_per_node N -m qkmla.train ...``: the same arguments as ``qkmla train``, and
the same runner (:func:`~qkmla.utils.command.run_command`): a refusal, the machine's error, a closed
pipe, a signal or a non-UTF-8 path reads as it does for ``qkmla train``."""

import sys

from ..utils.command import option_dests, run_command
from ..utils.errors import Parser
from .cli import add_train_arguments, run_train


def main(argv=None) -> int:
    parser = Parser(prog="qkmla train")
    add_train_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what the command line gives, as qkmla train has it (a resume keeps the rest)
    return run_command("train", lambda: run_train(args), lambda: option_dests(parser))


if __name__ == "__main__":
    sys.exit(main())

"""``torchrun --nproc_per_node N -m qkmla.train ...``: the same arguments as ``qkmla train``."""

import json
import sys

from ..utils.environment import check_launch
from ..utils.errors import Parser, environment_message
from ..utils.startup import command_started
from ..utils.threads import apply_threads
from .cli import add_train_arguments, exit_code, train_config_from_args, train_flag_message
from .trainer import train


def main(argv=None) -> int:
    p = Parser(prog="qkmla train")
    add_train_arguments(p)
    args = p.parse_args(argv)
    try:
        command_started()  # Ctrl-C is KeyboardInterrupt again: train's own handling (utils.startup)
        check_launch()
        config = train_config_from_args(args)
        apply_threads(args.threads, "train")
        status = train(config)
    except ValueError as e:  # a refused argument or run directory: one line, no traceback
        print(f"qkmla train: {train_flag_message(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # a full disk, a read-only file, a rank that never joined (CollectiveTimeout, a
        # MachineError): one line naming the path or the variable (status.json says it too)
        message = environment_message(e)
        if message is None:
            raise
        print(f"qkmla train: {message}", file=sys.stderr)
        return 1
    print(json.dumps(status))
    return exit_code(status)


if __name__ == "__main__":
    sys.exit(main())

"""``torchrun --nproc_per_node N -m qkmla.train ...``: the same arguments as ``qkmla train``."""

import argparse
import json
import sys

from .cli import add_train_arguments, train_config_from_args
from .trainer import train


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qkmla.train")
    add_train_arguments(p)
    status = train(train_config_from_args(p.parse_args(argv)))
    print(json.dumps(status))
    return 0 if status["status"] in ("done", "time limit") else 1


if __name__ == "__main__":
    sys.exit(main())

"""How every qkmla command reports a refused argument: one line, ``qkmla COMMAND: ARGUMENT:
message``, exit status 2. Kept free of heavy imports so any command can use it."""

from __future__ import annotations

import argparse
import re


class Parser(argparse.ArgumentParser):
    """argparse with qkmla's error format (``--help`` still shows the usage)."""

    def error(self, message: str):
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message, flags=re.S)
        if m:
            message = f"{m.group(1)}: {m.group(2)}"
        self.exit(2, f"{self.prog}: {message}\n")


def flag_message(message: str, fields) -> str:
    """An error naming a field as the option that sets it: 'grad_clip: ...' -> '--grad-clip: ...'
    (``fields``: the names that are options of the command)."""
    m = re.match(r"(\w+): ", message)
    if m and m.group(1) in set(fields):
        return f"--{m.group(1).replace('_', '-')}: " + message[m.end():]
    return message

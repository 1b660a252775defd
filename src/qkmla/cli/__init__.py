"""The ``qkmla`` command and what only it runs: the demo and the exactness checks (``verify``)."""

from .commands import main

__all__ = ["main"]

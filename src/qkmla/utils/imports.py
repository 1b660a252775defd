"""SIGINT and SIGTERM held while a C extension module initializes, for the length of a command.

Python runs a signal's handler at the next bytecode of the main thread, wherever that is. While a
C++ extension initializes it can be Python code that the initializer called: triton's libtriton
(nanobind) builds Python enums as it loads, and transformers and ``torch.compile`` load it on a
command's first use. An exception raised there (KeyboardInterrupt, or the
:class:`~qkmla.utils.errors.Terminated` that SIGTERM raises) cannot pass back through the C++
frames, and the process aborts: "terminate called after throwing an instance of
'nanobind::python_error'", exit 134 and a hundred lines, where the command should stop in one line.

:func:`extension_inits_held` puts a finder first on ``sys.meta_path`` that gives every extension
module a loader whose initialization runs inside :func:`~qkmla.utils.files.signals_held`: a
signal that arrives then is acted on as the initializer returns, by the handler in force (an
initializer takes milliseconds). Only extension modules: a Python import (one that fails, one that
waits on a child process) takes its signal where it lands, as without qkmla. A second Ctrl-C (or
SIGTERM) during the same initializer is acted on at once, so a stuck one can still be stopped.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from importlib.machinery import ExtensionFileLoader

from .files import signals_held


class HeldExtensionLoader(ExtensionFileLoader):
    """An extension module's loader whose two initialization phases (the module's ``PyInit``
    function, then its multi-phase ``exec`` slots) hold SIGINT and SIGTERM until they return."""

    def create_module(self, spec):
        with signals_held(second_acts=True):
            return super().create_module(spec)

    def exec_module(self, module):
        with signals_held(second_acts=True):
            super().exec_module(module)


class HeldExtensionFinder:
    """A ``sys.meta_path`` finder that asks the finders after it and gives an extension module's
    spec a :class:`HeldExtensionLoader` (the same name and file); every other spec is theirs."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        for finder in list(sys.meta_path):
            if finder is cls:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if type(spec.loader) is ExtensionFileLoader:  # exactly the stock one: another's subclass is left alone
            spec.loader = HeldExtensionLoader(spec.loader.name, spec.loader.path)
        return spec


@contextmanager
def extension_inits_held():
    """``with extension_inits_held():`` extension modules imported inside initialize with SIGINT and
    SIGTERM held (module docstring). Only in the main thread, where Python runs handlers; nested,
    the outer one keeps its place."""
    if threading.current_thread() is not threading.main_thread() or HeldExtensionFinder in sys.meta_path:
        yield
        return
    sys.meta_path.insert(0, HeldExtensionFinder)
    try:
        yield
    finally:
        try:
            sys.meta_path.remove(HeldExtensionFinder)
        except ValueError:  # another's code took it out already
            pass

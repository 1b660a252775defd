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
waits on a child process) takes its signal where it lands, as without qkmla. A second Ctrl-C
during the same initializer is acted on at once, so a stuck one can still be stopped.

Unheld, a signal there had three outcomes by where it landed: an abort; lost (nanobind's own first
calls swallow the exception, and the command went on to write its output); or an ImportError, that
an importer taking optional dependencies would take for a missing package. A module whose
initializer ran to its end, and whose import the held signal then fails, is kept: importing it
again in the same process (a notebook that runs a command twice) hands it back rather than
initializing it a second time, which nanobind refuses with an abort ("refusing to add duplicate
key"). Extension modules loaded by path (``importlib.util.spec_from_file_location``: the launchers
triton and inductor compile) bypass the finder; they are C or pybind11 modules, which run no Python
as they initialize.
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

    # {file: module} initialized to the end, whose import a held signal then failed (module docstring)
    initialized: dict = {}

    def create_module(self, spec):
        kept = self.initialized.get(self.path)
        if kept is not None:
            return kept
        with signals_held(second_acts=True):
            return super().create_module(spec)

    def exec_module(self, module):
        if self.initialized.get(self.path) is module:  # initialized before; nothing to run again
            del self.initialized[self.path]
            return
        done = False
        try:
            with signals_held(second_acts=True):
                super().exec_module(module)
                done = True
        except BaseException:
            if done:  # the held signal, acted on after the initializer returned: keep what it built
                self.initialized[self.path] = module
            raise


class HeldExtensionFinder:
    """A ``sys.meta_path`` finder that asks the finders after it and gives an extension module's
    spec a :class:`HeldExtensionLoader` (the same name and file); every other spec is theirs."""

    holds_extension_inits = True  # how one knows another (this module imported twice, or reloaded)

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        for finder in list(sys.meta_path):
            if getattr(finder, "holds_extension_inits", False):
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


def holding_extension_inits() -> bool:
    """Whether a :class:`HeldExtensionFinder` (of this module, or of a copy of it) is on ``sys.meta_path``."""
    return any(getattr(f, "holds_extension_inits", False) for f in sys.meta_path)


def hold_extension_inits() -> None:
    """Extension modules initialize with the signals held for the rest of this process (a process
    that runs qkmla's work and nothing else: an experiment's worker)."""
    if not holding_extension_inits():
        sys.meta_path.insert(0, HeldExtensionFinder)


@contextmanager
def extension_inits_held():
    """``with extension_inits_held():`` extension modules imported inside initialize with SIGINT and
    SIGTERM held (module docstring). Only in the main thread, where Python runs handlers; nested,
    the outer one keeps its place."""
    if threading.current_thread() is not threading.main_thread() or holding_extension_inits():
        yield
        return
    sys.meta_path.insert(0, HeldExtensionFinder)
    try:
        yield
    finally:
        with signals_held():  # a Ctrl-C here must not leave the finder in place for later commands
            try:
                sys.meta_path.remove(HeldExtensionFinder)
            except ValueError:  # another's code took it out already
                pass

"""qkmla.utils.imports: signals held while an extension module initializes, and only then."""

import signal
import subprocess
import sys
import textwrap
from importlib.machinery import ExtensionFileLoader, SourceFileLoader
from pathlib import Path

import pytest

from qkmla.utils.files import signals_held
from qkmla.utils.imports import HeldExtensionFinder, HeldExtensionLoader, extension_inits_held

SRC = str(Path(__file__).resolve().parents[2] / "src")


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = "import sys; sys.path.insert(0, %r)\n" % SRC + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_finder_wraps_stock_extension_loaders_only():
    spec = HeldExtensionFinder.find_spec("_csv")  # a stdlib extension module
    assert type(spec.loader) is HeldExtensionLoader and isinstance(spec.loader, ExtensionFileLoader)
    assert spec.loader.path == spec.origin
    assert isinstance(HeldExtensionFinder.find_spec("json.decoder", __import__("json").__path__).loader,
                      SourceFileLoader)
    assert HeldExtensionFinder.find_spec("no_such_module_qkmla") is None


def test_finder_is_installed_only_inside():
    assert HeldExtensionFinder not in sys.meta_path
    with extension_inits_held():
        assert sys.meta_path[0] is HeldExtensionFinder
        with extension_inits_held():  # nested: one entry
            assert sys.meta_path.count(HeldExtensionFinder) == 1
        assert sys.meta_path[0] is HeldExtensionFinder
    assert HeldExtensionFinder not in sys.meta_path


def test_signals_held_acts_after_and_a_second_acts_at_once():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reached = []
        with pytest.raises(KeyboardInterrupt):
            with signals_held(second_acts=True):
                signal.raise_signal(signal.SIGINT)
                reached.append("after one")
        assert reached == ["after one"]
        with pytest.raises(KeyboardInterrupt):
            with signals_held(second_acts=True):
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
                reached.append("after two")
        assert reached == ["after one"]
        with pytest.raises(KeyboardInterrupt):  # without second_acts both wait for the end (renames)
            with signals_held():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
                reached.append("after two, held")
        assert reached == ["after one", "after two, held"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_signals_held_delivers_each_arrival_in_order_and_never_escalates_sigterm():
    """A handler that does not raise (the trainer's first request, the grid's): a second Ctrl-C
    delivers the first, then itself, at once; a third goes straight to the handler; two SIGTERMs
    (a kill of the group and of the pid) stay held and are delivered once, at the end."""
    calls = []
    record = lambda signum, frame: calls.append((signum, "inside" if inside else "after"))  # noqa: E731
    previous = {s: signal.signal(s, record) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        inside = True
        with signals_held(second_acts=True):
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
            assert calls == []
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert calls == [(signal.SIGTERM, "inside"), (signal.SIGINT, "inside"), (signal.SIGINT, "inside")]
            signal.raise_signal(signal.SIGINT)
            assert len(calls) == 4 and signal.getsignal(signal.SIGINT) is record
            inside = False
        assert len(calls) == 4  # nothing delivered twice
        calls.clear()
        with signals_held(second_acts=True):
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
            inside = True
            assert calls == []
            inside = False
        assert calls == [(signal.SIGTERM, "after")]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# An extension module's initializer that calls Python code (as nanobind's do) with a signal already
# arrived: _imp.exec_dynamic, wrapped, sends the signal and runs Python bytecode before initializing.
SIGNAL_IN_INIT = """
    import _imp, os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    {extra}
    original = _imp.exec_dynamic
    def exec_dynamic(module):
        if module.__name__ == "_csv":
            os.kill(os.getpid(), {signum})
            for _ in range(1000):
                time.sleep(0.001)  # bytecodes: an unheld handler raises here, inside the initializer
            print("initializer ran to its end", flush=True)
        return original(module)
    from qkmla.utils.imports import extension_inits_held  # (which imports _csv: imported again below)
    _imp.exec_dynamic = exec_dynamic
    sys.modules.pop("_csv", None)
    try:
        with {context}:
            import _csv
        print("imported")
    except {caught} as e:
        print("stopped after the import:", type(e).__name__)
"""


@pytest.mark.parametrize("signum, extra, caught", [
    (signal.SIGINT, "", "KeyboardInterrupt"),
    (signal.SIGTERM, "signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit('term')))",
     "SystemExit"),
], ids=["SIGINT", "SIGTERM"])
def test_a_signal_inside_an_extension_initializer_is_acted_on_after_it(tmp_path, signum, extra, caught):
    held = run(SIGNAL_IN_INIT.format(signum=int(signum), extra=extra, caught=caught,
                                     context="extension_inits_held()"), tmp_path)
    assert held.returncode == 0, held.stderr
    assert held.stdout.splitlines() == ["initializer ran to its end", f"stopped after the import: {caught}"]
    # the same without the hold: the handler raises inside the initializer, before its end
    bare = run(SIGNAL_IN_INIT.format(signum=int(signum), extra=extra, caught=caught,
                                     context="__import__('contextlib').nullcontext()"), tmp_path)
    assert bare.stdout.splitlines() == [f"stopped after the import: {caught}"], bare.stdout + bare.stderr


# The same through create_module (a single-phase module's PyInit), and an import tried again after
# the held signal failed the first: the module initialized once is handed back, not initialized twice.
SIGNAL_IN_CREATE_THEN_REIMPORT = """
    import _imp, os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from qkmla.utils.imports import extension_inits_held
    initialized = []
    def wrap(original, phase):
        def run(arg):
            name = getattr(arg, "name", getattr(arg, "__name__", None))
            if name == "_csv":
                if phase == "{phase}" and phase not in initialized:
                    os.kill(os.getpid(), signal.SIGINT)
                    for _ in range(1000):
                        time.sleep(0.001)
                initialized.append(phase)
            return original(arg)
        return run
    _imp.create_dynamic = wrap(_imp.create_dynamic, "create")
    _imp.exec_dynamic = wrap(_imp.exec_dynamic, "exec")
    sys.modules.pop("_csv", None)
    for attempt in (1, 2):
        try:
            with extension_inits_held():
                import _csv
            print(attempt, "imported after", initialized, _csv.reader is not None)
        except KeyboardInterrupt:
            print(attempt, "interrupted after", initialized)
"""


@pytest.mark.parametrize("phase, expected", [
    # PyInit interrupted after its end: not kept (CPython keeps a single-phase module's definition)
    ("create", ["1 interrupted after ['create']", "2 imported after ['create', 'create', 'exec'] True"]),
    # the exec slots ran to their end: the module is kept, and neither phase runs again
    ("exec", ["1 interrupted after ['create', 'exec']", "2 imported after ['create', 'exec'] True"]),
])
def test_both_phases_are_held_and_an_initialized_module_is_not_initialized_twice(tmp_path, phase, expected):
    r = run(SIGNAL_IN_CREATE_THEN_REIMPORT.replace("{phase}", phase), tmp_path)
    assert r.stdout.splitlines() == expected, r.stdout + r.stderr


def test_a_signal_inside_a_python_import_is_acted_on_where_it_lands(tmp_path):
    """Only extension modules are held: a Python import that takes a Ctrl-C stops there, and one
    that fails after it (an optional dependency, caught by its importer) still ends interrupted."""
    (tmp_path / "slow_module.py").write_text(textwrap.dedent("""
        import os, signal, time
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            time.sleep(0.001)
        open("finished", "w").close()
        raise ImportError("an optional dependency that is not there")
    """))
    r = run("""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, ".")
        from qkmla.utils.imports import extension_inits_held
        try:
            with extension_inits_held():
                try:
                    import slow_module
                except ImportError:
                    print("optional module missing")
                print("went on")
        except KeyboardInterrupt:
            print("interrupted")
    """, tmp_path)
    assert r.stdout.splitlines() == ["interrupted"], r.stdout + r.stderr
    assert not (tmp_path / "finished").exists()

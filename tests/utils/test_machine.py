"""What every results file records about the machine, the allocator's environment included."""

import os
import re
import shutil
import subprocess

import pytest

from qkmla.utils.machine import ALLOCATOR_ENV, allocator_env, env_prefix, machine, recorded_command, source_commit


def test_the_allocator_environment_is_recorded_and_reruns_as_a_command_prefix(monkeypatch):
    for name in list(os.environ):
        if name.startswith(ALLOCATOR_ENV):
            monkeypatch.delenv(name)
    assert allocator_env() == {} and env_prefix() == "" and machine()["allocator_env"] == {}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "17179869184")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "17179869184")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # not an allocator setting
    assert machine()["allocator_env"] == {"MALLOC_MMAP_THRESHOLD_": "17179869184",
                                          "MALLOC_TRIM_THRESHOLD_": "17179869184"}
    assert env_prefix() == "MALLOC_MMAP_THRESHOLD_=17179869184 MALLOC_TRIM_THRESHOLD_=17179869184 "
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2 /opt/extra.so")  # a space-separated list
    monkeypatch.setenv("MALLOC_CONF", "background_thread:true")  # jemalloc's
    assert env_prefix().startswith("LD_PRELOAD='/usr/lib/libjemalloc.so.2 /opt/extra.so' "
                                   "MALLOC_CONF=background_thread:true MALLOC_MMAP_THRESHOLD_=")


def test_machine_names_the_cpu_and_torch():
    info = machine()
    assert info["cores"] >= 1 and info["torch_threads"] >= 1 and info["cpu"] and info["torch"]


def test_the_recorded_command_reruns_as_it_ran(monkeypatch):
    for name in list(os.environ):
        if name.startswith(ALLOCATOR_ENV):
            monkeypatch.delenv(name)
    assert recorded_command("benchmarks/bench_train.py", []) == "python benchmarks/bench_train.py"
    assert (recorded_command("benchmarks/bench_decode.py", ["--contexts", "4096", "--out", "my results.json"])
            == "python benchmarks/bench_decode.py --contexts 4096 --out 'my results.json'")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setattr("sys.argv", ["bench_train.py", "--quick"])
    assert recorded_command("benchmarks/bench_train.py") == "MALLOC_ARENA_MAX=2 python benchmarks/bench_train.py --quick"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_source_commit_names_the_checkout_and_whether_it_was_edited(tmp_path):
    assert source_commit(tmp_path) is None  # not a checkout
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, env=env)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "first")
    clean = source_commit(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", clean)
    (tmp_path / "results.json").write_text("{}")  # an untracked file leaves it clean
    assert source_commit(tmp_path) == clean
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "bench.json").write_text("{}")
    git("add", "benchmarks")
    git("commit", "-q", "-m", "results")
    clean = source_commit(results)  # asked from inside a subfolder, as the benchmarks do
    (results / "bench.json").write_text('{"rewritten": true}')  # its own results: still clean
    assert source_commit(results) == clean and source_commit(tmp_path) == clean
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_commit(tmp_path) == clean + "+dirty"
    assert source_commit(results) == clean + "+dirty"

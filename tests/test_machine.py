"""What every results file records about the machine, the allocator's environment included."""

import os

from qkmla.machine import ALLOCATOR_ENV, allocator_env, env_prefix, machine, recorded_command


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

"""qkmla's benchmarks, each a module run from the repository root with qkmla installed
(``pip install -e .``)::

    python -m benchmarks.bench_decode --threads 1 --overwrite

What each measures and its committed result: docs/benchmarks.md. Every one writes its results
record through :func:`benchmarks.common.start_record`.
"""

"""The GPU suite: ``python -m benchmarks.gpu.run`` (see :mod:`benchmarks.gpu.run`)."""

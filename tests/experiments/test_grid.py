"""experiments/grid.py: the grid's own types."""

import errno
import pickle

from qkmla.experiments.grid import GridFailed


def test_grid_failed_survives_pickling():
    """A grid run in a worker process reports its failure by pickling it back: the error's
    number, text, path and the statuses of the runs that ended all arrive."""
    failed = GridFailed(OSError(errno.ENOSPC, "No space left on device", "/out/runs/a/metrics.jsonl"),
                        {"a": {"status": "failed"}})
    back = pickle.loads(pickle.dumps(failed))
    assert isinstance(back, GridFailed) and isinstance(back, OSError)
    assert (back.errno, back.strerror, back.filename) == (errno.ENOSPC, "No space left on device",
                                                           "/out/runs/a/metrics.jsonl")
    assert back.statuses == {"a": {"status": "failed"}} and str(back) == str(failed)

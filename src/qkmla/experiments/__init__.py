"""``qkmla experiment NAME``: grids of training runs that test the papers' claims.

Each experiment is one command, resumable (finished runs are skipped), with a ``--quick``
size for tests. It writes ``OUT/results.jsonl`` (one row per run), PNG figures,
``OUT/summary.json`` and ``OUT/summary.md``. See docs/results.md for what they found.
"""

from __future__ import annotations

from .base import Experiment, Options, Report, run_experiment
from .compression import EXPERIMENT as COMPRESSION
from .length import EXPERIMENT as LENGTH
from .lp_paper import EXPERIMENT as LP_PAPER
from .lp_sweep import EXPERIMENT as LP_SWEEP
from .lr_sweep import EXPERIMENT as LR_SWEEP
from .norm_mode import EXPERIMENT as NORM_MODE
from .qk_clip import EXPERIMENT as QK_CLIP
from .qknorm_confirm import EXPERIMENT as QKNORM_CONFIRM
from .qknorm_vs_clip import EXPERIMENT as QKNORM_VS_CLIP
from .retrieval import EXPERIMENT as RETRIEVAL
from .v4_compare import EXPERIMENT as V4_COMPARE

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (LR_SWEEP, QK_CLIP, NORM_MODE, LP_SWEEP, LENGTH, COMPRESSION,
                                                           RETRIEVAL, QKNORM_VS_CLIP, LP_PAPER,
                                                           QKNORM_CONFIRM, V4_COMPARE)}

__all__ = ["EXPERIMENTS", "Experiment", "Options", "Report", "run_experiment"]

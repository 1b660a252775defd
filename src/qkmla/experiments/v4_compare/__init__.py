"""``v4-compare``: DeepSeek-V4's attention (one shared key = value vector per token, its own
RMSNorm, an unweighted per-head RMSNorm on the query, partial RoPE, sinks: model variant ``v4``)
against blockwise QK-normed MLA (the paper's) and plain MLA, at equal cache values per token
(148 per layer) and parameters within 2%; the protocol is in docs/results.md, committed before
any run.

Stages, in the order the runs are planned (the plan is made again after every run):

1. Rate bracket at the 600-step horizon on the tuning seeds 2000 and 2001: each arm at Muon
   2.5e-3, 5e-3 and 1e-2, the lowest mean validation loss chosen; a best rate at an end adds
   the next one out (a factor 2) once.
2. Main seeds 2100-2107, seed by seed, every arm at its chosen rate, the same data order and
   the same initial embedding and MLPs (``GPTConfig.init_seed``).

The report tests the three pairs (v4 - QK-normed MLA, v4 - plain MLA, QK-normed MLA - plain
MLA) on test loss with paired t tests and Holm's adjustment only once every main seed of every
arm is in. Runs are resumable one by one; one worker.
"""

from ..base import Experiment
from .design import measure, plan, thin_metrics
from .report import report

EXPERIMENT = Experiment("v4-compare", "pre-registered: DeepSeek-V4's shared-KV attention vs QK-normed MLA vs plain "
                        "MLA at equal cache bytes and parameters, rates tuned per arm, paired seeds", plan, report,
                        measure, adaptive=True, thin_metrics=thin_metrics, reads_seeds=False)

__all__ = ["EXPERIMENT"]

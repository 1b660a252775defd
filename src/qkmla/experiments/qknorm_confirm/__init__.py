"""``qknorm-confirm``: the pre-registered confirmation of qknorm-vs-clip's direction on fresh
seeds and longer horizons (the protocol is in docs/results.md, committed before any run).

Arms, all at Muon 5e-3 with qknorm-vs-clip's model, data and optimizer: plain MLA, blockwise
QK-normed MLA, QK-Clip at tau = 17 and at tau = 20.6. Seeds 1000-1011, each giving every arm
the same initial weights and batches. Horizons by branching one warmup-stable-decay run per
arm and seed: the stable phase is trained in stretches to steps 480, 960 and 1,920 (each
continuing the one before, ``Run.start_from``), and from each a 1 - sqrt decay to zero ends at
600, 1,200 and 2,400 steps; the 600-step branch is qknorm-vs-clip's recipe step for step,
which the reproduction check tests against its committed seeds 0-6. A rate check runs plain
MLA and QK-norm at 2.5e-3 and 1e-2 on two seeds. Primary endpoints: test loss at 2,400 steps,
QK-norm minus each other arm, Holm over the three; the report computes no test until every
seed is in. Runs are ordered seed by seed (``design.all_runs``) and resumable one by one.
"""

from ..base import Experiment
from .design import all_runs, measure, plan, thin_metrics
from .report import report

EXPERIMENT = Experiment("qknorm-confirm", "pre-registered confirmation: QK-norm vs plain MLA vs QK-Clip 17 / 20.6, "
                        "fresh seeds, WSD branches at 600 / 1,200 / 2,400 steps", plan, report, measure,
                        adaptive=True, thin_metrics=thin_metrics, reads_seeds=False,
                        design=all_runs)

__all__ = ["EXPERIMENT"]

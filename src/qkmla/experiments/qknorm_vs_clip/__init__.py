"""``qknorm-vs-clip``: the seed paper's central comparison (its 5.1-5.4) as a reviewer would
run it: QK-normed MLA against plain MLA and a QK-Clip that actually clips, each at a
learning rate tuned at the horizon reported, on whole held-out plays, with paired seeds.

Design:

* Data: the embedded full ``shakespeare`` corpus split by play (``split="plays"``: two plays
  validate, two others test, none seen in training), one token per character.
* Model: 4 layers, 3 heads of width 64 (embedding 192; MLA d_n 44, d_r 20, d_c 128, direct
  q_proj), a 128-token context, 1.77M parameters; batch 32, 4,096 tokens a step. A
  unit-gain QK-normed head's logits are capped at sqrt(64) = 8, not 5.66 as at width 32.
* Variants: plain MLA; QK-Clip at tau = 100 (Kimi K2, the paper); QK-Clip at a tau that
  clips transiently (``transient_tau``: between plain MLA's late-run max logit and its peak,
  at most 0.8 of the peak, from plain MLA's seed-0 run at its chosen rate); blockwise
  QK-normed MLA (the paper's method); the same with a learnable per-head logit scale.
* Optimizer: Muon for the hidden matrices, AdamW for the embedding and the gains
  (``optimizer="muon"``); WSD: linear warmup over the first 5% of the steps, constant, then
  1 - sqrt decay to zero over the last 20%; weight decay 0.1; gradient clipping at 1.0.
  Every variant sees the same tokens: a seed fixes the initial weights (the QK norm gains and
  logit scales are extra parameters that start at constants) and the batch order.

Stages, in the order the runs are planned (and so finish; the plan is made again after
every run, since later stages depend on earlier results):

1. Learning-rate bracket, seed 0: each variant at 3 rates a factor 2 apart around its best
   Muon rate in the 300-step lr-sweep; when the best (lowest loss over every validation
   window) is at an end of the bracket, the next rate out is added (at most
   ``MAX_EXTENSIONS`` times). Plain MLA's bracket comes first: the transient tau needs it.
2. Seeds 1 and 2 of every variant at its chosen rate: the main comparison.
3. Stress test (the paper's 5.4): every variant at 3x and 10x its chosen rate, seed 0,
   gradient clipping off.
4. Extra seeds (up to ``MAX_SEEDS``) for the headline pairs whose per-seed differences
   spread by more than a third of their mean.

A QK-Clip run whose plain MLA twin (same rate, seed and clipping) finished without any
logit above tau is not trained: the clip never fires, so it is that run step for step
(``Run.same_as``; tested in ``tests/experiments/test_qknorm_vs_clip.py``).

Each run is scored after training (``measure``): validation loss over every window of the
validation plays, test loss, perplexity and next-character accuracy over every window of
the test plays, last-word-of-line accuracy on the test plays (``heldout.py``), loss spikes,
when QK-Clip clipped, and thinned per-step curves.
"""

from ..base import Experiment
from .design import measure, plan
from .report import report

EXPERIMENT = Experiment("qknorm-vs-clip", "QK-norm vs QK-Clip vs plain MLA on held-out plays: lr brackets at the "
                        "horizon, paired seeds, stress test", plan, report, measure, adaptive=True, reads_seeds=False)

__all__ = ["EXPERIMENT"]

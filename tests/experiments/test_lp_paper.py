"""lp-paper's rate choice and paired report on made-up rows (the grid runs in test_experiments)."""

import math

import pytest

from qkmla.experiments import Options
from qkmla.experiments.lp_paper import BRACKET, PS, chosen_rates, report, score


def _row(p, lr, seed, best, final=None, stage="bracket", status="done"):
    final = best if final is None else final
    return {"p": p, "lr": lr, "seed": seed, "stage": stage, "status": status, "best_val_loss": best,
            "final_val_loss": final, "initial_loss": math.log(65), "logit_scale": 8.0,
            "val_curve": None if best is None else [[50, best + 0.1], [100, best], [150, final]]}


def test_a_best_rate_at_an_end_of_the_bracket_waits_for_the_next_rate_out():
    lows = [_row(2.0, lr, 1, loss) for lr, loss in zip(BRACKET, (1.60, 1.50, 1.55))]  # interior: chosen
    ends = [_row(3.0, lr, 1, loss) for lr, loss in zip(BRACKET, (1.45, 1.50, 1.55))]  # lowest rate best: extend
    running = [_row(4.0, lr, 1, None, status="running") for lr in BRACKET]
    assert chosen_rates(lows + ends + running) == {2.0: BRACKET[1]}
    extended = ends + [_row(3.0, 3e-4, 1, 1.47)]  # the extension is worse: the old end stands
    assert chosen_rates(extended)[3.0] == BRACKET[0]
    # A run that ended non-finite loses, however low its loss got before it did.
    diverged = [_row(4.0, lr, 1, loss, status=st) for lr, loss, st in
                zip(BRACKET, (1.6, 1.5, 1.40), ("done", "done", "non-finite"))]
    assert score(diverged[2]) == math.inf and chosen_rates(diverged)[4.0] == BRACKET[1]


def test_report_pairs_each_p_with_p2_seed_by_seed_at_each_ones_own_rate(tmp_path):
    rows, winners = [], {2.0: 1, 3.0: 1, 4.0: 2}  # p = 4 wins at another rate than p = 2
    for p, offset in zip(PS, (0.0, -0.01, 0.02)):
        losses = (1.60, 1.50, 1.55) if winners[p] == 1 else (1.60, 1.56, 1.52)
        rows += [_row(p, lr, 1, loss + offset) for lr, loss in zip(BRACKET, losses)]
        if winners[p] == 2:  # best at the top end: the extension out (3e-2) is worse
            rows.append(_row(p, 3e-2, 1, 1.58 + offset))
        lr = BRACKET[winners[p]]
        rows += [_row(p, lr, seed, 1.5 + offset + 0.001 * seed, stage="seed") for seed in (2, 3)]
        rows += [_row(p, other, 2, 9.0, stage="seed") for other in BRACKET if other != lr]  # not at its rate
    out = report(rows, Options(tmp_path))
    s = out.summary
    assert s["chosen_lr"] == {"2": BRACKET[1], "3": BRACKET[1], "4": BRACKET[2]}
    assert s["by_p"]["3"]["seeds"] == [1, 2, 3] and s["by_p"]["2"]["min_step"] == 100
    d3 = s["paired"]["p3 - p2"]["best_val_loss"]
    assert d3["n"] == 3 and d3["diffs"] == pytest.approx([-0.01] * 3) and d3["negative"] == 3
    assert s["paired"]["p4 - p2"]["best_val_loss"]["diffs"] == pytest.approx([0.02 + 0.52 - 0.50, 0.02, 0.02])
    assert s["paired_without_bracket_seed"]["p4 - p2"]["final_val_loss"]["diffs"] == pytest.approx([0.02, 0.02])
    assert "p3 - p2" in out.table and (tmp_path / "lp_paper.png").is_file()


def test_a_run_that_ended_non_finite_counts_at_the_initial_loss(tmp_path):
    rows = [_row(p, lr, 1, loss) for p in (2.0, 3.0) for lr, loss in zip(BRACKET, (1.60, 1.50, 1.55))]
    rows += [_row(2.0, BRACKET[1], 2, 1.5, stage="seed"), _row(3.0, BRACKET[1], 2, 1.2, stage="seed",
                                                               status="non-finite")]
    s = report(rows, Options(tmp_path)).summary
    assert s["by_p"]["3"]["non_finite"] == [2]
    assert s["paired"]["p3 - p2"]["final_val_loss"]["diffs"] == pytest.approx([0.0, math.log(65) - 1.5])

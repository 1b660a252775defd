"""lp-paper's rate choice and paired report on made-up rows (the grid runs in test_experiments)."""

import math

from qkmla.experiments import Options
from qkmla.experiments.lp_paper import BRACKET, PS, chosen_rates, report


def _row(p, lr, seed, best, final=None, stage="bracket", status="done"):
    final = best if final is None else final
    return {"p": p, "lr": lr, "seed": seed, "stage": stage, "status": status, "best_val_loss": best,
            "final_val_loss": final, "logit_scale": 8.0,
            "val_curve": None if best is None else [[50, best + 0.1], [100, best], [150, final]]}


def test_a_best_rate_at_an_end_of_the_bracket_waits_for_the_next_rate_out():
    lows = [_row(2.0, lr, 1, loss) for lr, loss in zip(BRACKET, (1.60, 1.50, 1.55))]  # interior: chosen
    ends = [_row(3.0, lr, 1, loss) for lr, loss in zip(BRACKET, (1.45, 1.50, 1.55))]  # lowest rate best: extend
    running = [_row(4.0, lr, 1, None, status="running") for lr in BRACKET]
    assert chosen_rates(lows + ends + running) == {2.0: BRACKET[1]}
    extended = ends + [_row(3.0, 3e-4, 1, 1.47)]  # the extension is worse: the old end stands
    assert chosen_rates(extended)[3.0] == BRACKET[0]
    diverged = [_row(4.0, lr, 1, loss, status=st) for lr, loss, st in
                zip(BRACKET, (1.6, 1.5, math.inf), ("done", "done", "non-finite"))]
    assert chosen_rates(diverged)[4.0] == BRACKET[1]


def test_report_pairs_each_p_with_p2_seed_by_seed(tmp_path):
    rows = []
    for p, offset in zip(PS, (0.0, -0.01, 0.02)):
        rows += [_row(p, lr, 1, loss + offset) for lr, loss in zip(BRACKET, (1.60, 1.50, 1.55))]
        rows += [_row(p, BRACKET[1], seed, 1.5 + offset + 0.001 * seed, stage="seed") for seed in (2, 3)]
    out = report(rows, Options(tmp_path))
    s = out.summary
    assert s["chosen_lr"] == {"2": BRACKET[1], "3": BRACKET[1], "4": BRACKET[1]}
    assert s["by_p"]["3"]["seeds"] == [1, 2, 3] and s["by_p"]["2"]["min_step"] == 100
    d3 = s["paired"]["p3 - p2"]["best_val_loss"]
    assert d3["n"] == 3 and all(abs(d + 0.01) < 1e-12 for d in d3["diffs"]) and d3["negative"] == 3
    assert s["paired"]["p4 - p2"]["final_val_loss"]["positive"] == 3
    assert "p3 - p2" in out.table and (tmp_path / "lp_paper.png").is_file()

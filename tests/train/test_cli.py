"""``qkmla train``'s options as a TrainConfig (``train/cli.py``), resume's settings above all."""

import json
import re

from qkmla.cli import main

RUN = ["train", "--preset", "debug", "--batch-size", "2", "--block-size", "16", "--eval-interval", "50",
       "--no-progress"]


def lrs(out) -> list[float]:
    return [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_lengthened_resume_keeps_the_warmup_the_run_had(tmp_path):
    """The default warmup (20 steps, or every step of a shorter run) followed --steps: a 3-step run, warmed up
    over its 3 steps, lengthened to 10 on resume took a 10-step warmup and went back below its peak lr at
    step 4. It keeps the 3-step warmup now, then decays over the new total; a typed --warmup-steps applies."""
    out = tmp_path / "run"
    assert main([*RUN, "--steps", "3", "--out", str(out)]) == 0
    assert main([*RUN, "--steps", "10", "--out", str(out), "--resume"]) == 0
    lr = lrs(out)
    assert len(lr) == 10 and lr[2] == max(lr) == 1e-3  # the peak at the end of the warmup, step 3
    assert all(a >= b for a, b in zip(lr[2:], lr[3:]))  # then the cosine decay only
    typed = tmp_path / "typed"
    assert main([*RUN, "--steps", "3", "--out", str(typed)]) == 0
    assert main([*RUN, "--steps", "10", "--warmup-steps", "5", "--out", str(typed), "--resume"]) == 0
    assert lrs(typed)[4] == max(lrs(typed)) == 1e-3  # the typed warmup: its peak at step 5


def test_a_resume_shorter_than_the_stored_warmup_names_it(tmp_path, capsys):
    """Review 14c: a run started with --warmup-steps 40, resumed with --steps 10, was refused as
    "--warmup-steps: expected an int from 0 to the run's steps (10; ...), got 40", a flag the resume never
    typed. The refusal says the 40 is the stored run's, and a typed warmup resumes."""
    out = tmp_path / "run"
    assert main([*RUN, "--steps", "50", "--warmup-steps", "40", "--max-seconds", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*RUN, "--steps", "10", "--out", str(out), "--resume"]) == 2
    assert re.match(r"qkmla train: --steps: 10 is fewer than the stored run's warmup of 40 steps \(its "
                    r"--warmup-steps\); give --warmup-steps too \(at most 10\), or more --steps$",
                    capsys.readouterr().err.strip().splitlines()[-1])
    assert main([*RUN, "--steps", "10", "--warmup-steps", "5", "--out", str(out), "--resume"]) == 0


def refusal(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_resume_to_no_further_step_is_named_before_any_other_refusal(tmp_path, capsys):
    """Review 15b: a run done at step 4, resumed with --min-lr-ratio 0, was told "give more --steps or a shorter
    --warmup-steps", and following the second half was refused as "already at step 4"; so was a run at step 3
    resumed with --steps 2 --warmup-steps 3, told "--warmup-steps: ... up to 2". The step comes first now."""
    out = tmp_path / "run"
    assert main([*RUN, "--steps", "4", "--out", str(out)]) == 0
    already = f"qkmla train: --steps: the run in {out} is already at step 4; pass --steps above it to train further"
    for more in ([], ["--min-lr-ratio", "0"], ["--min-lr-ratio", "0", "--warmup-steps", "1"],
                 ["--steps", "3", "--warmup-steps", "4"], ["--steps", "2"]):
        assert refusal(capsys, [*RUN, "--out", str(out), "--resume", *more]) == already


def test_a_shortened_resume_names_its_warmup_as_the_defaults(tmp_path, capsys):
    """Review 15b: a 30-step run (default warmup 20) stopped at step 1 and resumed with --steps 10 warms up over
    the default's 10 steps, and --min-lr-ratio's refusal called those 10 "the stored run's, kept on --resume".
    Only a warmup the stored run trained with is called so."""
    out = tmp_path / "run"
    assert main([*RUN, "--steps", "30", "--max-seconds", "0", "--out", str(out)]) == 0
    line = refusal(capsys, [*RUN, "--steps", "10", "--min-lr-ratio", "0", "--out", str(out), "--resume"])
    assert "a warmup of 10 steps (--warmup-steps; by default 20, or --steps if fewer)" in line, line
    kept = tmp_path / "kept"
    assert main([*RUN, "--steps", "10", "--max-seconds", "0", "--out", str(kept)]) == 0
    line = refusal(capsys, [*RUN, "--steps", "11", "--min-lr-ratio", "0", "--out", str(kept), "--resume"])
    assert "a warmup of 10 steps (the stored run's, kept on --resume" in line, line


def test_a_run_of_an_experiments_grid_is_refused_as_out(tmp_path, refused):
    """`train --out EXP/runs/RUN --resume --steps 50` lengthened the experiment's run without a word (the
    experiment then read it as trained with other settings); a new run beside the grid's, the same."""
    exp = tmp_path / "exp"
    run = exp / "runs" / "mla_s0"
    assert main([*RUN, "--steps", "2", "--out", str(run)]) == 0  # before the directory is an experiment's: allowed
    (exp / "summary.json").write_text(json.dumps({"experiment": "lr-sweep"}))
    before = (run / "metrics.jsonl").read_text()
    (tmp_path / "link").symlink_to(run)
    for out, extra in ((run, ["--resume"]), (run, ["--overwrite"]), (exp / "runs" / "mine", []),
                       (run / ".." / run.name, ["--resume"]), (tmp_path / "link", ["--resume"])):
        refused([*RUN, "--steps", "4", "--out", str(out), *extra],
                rf"--out: .*{out.resolve().name} is a run of the experiment in .*exp \(qkmla experiment's own "
                r"directory\)")
    assert (run / "metrics.jsonl").read_text() == before and not (exp / "runs" / "mine").exists()
    copy = tmp_path / "copy"
    assert main([*RUN, "--steps", "2", "--out", str(copy)]) == 0

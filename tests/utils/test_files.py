"""Issue 27, class 1: nothing a user owns is overwritten or destroyed. Every command that writes
refuses its own input and an existing output without --overwrite, and writes to a temporary
name then renames, so a full disk (a file size limit here: it fails the same way, as root too)
leaves the previous file whole and ends in one line naming the path."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qkmla.cli import main
from qkmla.utils.files import check_output, save_safetensors, write_text


def _limited(code: str, limit: int, cwd) -> subprocess.CompletedProcess:
    """Run python ``code`` with files limited to ``limit`` bytes (SIGXFSZ ignored: the write fails)."""
    prelude = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "x.safetensors"
    save_safetensors({"a": torch.zeros(4)}, path)
    before = path.read_bytes()
    r = _limited(f"""
        import torch
        from qkmla.utils.files import save_safetensors
        try:
            save_safetensors({{"a": torch.zeros(100000)}}, {str(path)!r})
        except OSError as e:
            print(e.errno, e.filename)
        """, 20000, tmp_path)
    assert r.stdout.split() == ["27", str(path)], r.stderr  # EFBIG, naming the file
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["x.safetensors"]
    write_text(tmp_path / "t.txt", "new")
    assert (tmp_path / "t.txt").read_text() == "new"


def test_check_output(tmp_path):
    (tmp_path / "in.txt").write_text("x")
    (tmp_path / "out.txt").write_text("y")
    os.link(tmp_path / "in.txt", tmp_path / "alias.txt")
    with pytest.raises(ValueError, match="--out: .*in.txt is an input of this command"):
        check_output("--out", [tmp_path / "in.txt"], [tmp_path / "in.txt"], overwrite=True)
    with pytest.raises(ValueError, match="--out: .*alias.txt is an input of this command"):  # the same file
        check_output("--out", [tmp_path / "alias.txt"], [tmp_path / "in.txt"], overwrite=True)
    with pytest.raises(ValueError, match="--out: .*out.txt already exists; pass --overwrite"):
        check_output("--out", [tmp_path / "out.txt"], [], overwrite=False)
    check_output("--out", [tmp_path / "out.txt", tmp_path / "new.txt"], [tmp_path / "in.txt"], overwrite=True)


def test_plot_refuses_its_input_and_an_existing_figure(tmp_path, refused, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--steps", "2", "--batch-size", "2", "--block-size", "8",
                 "--eval-iters", "1", "--no-progress", "--out", str(run)]) == 0
    metrics = (run / "metrics.jsonl").read_bytes()
    refused(["plot", str(run), "--out", str(run / "metrics.jsonl"), "--overwrite"], "is an input of this command")
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    refused(["plot", str(run), "--out", str(tmp_path / "c.png")], "c.png already exists; pass --overwrite")
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png"), "--overwrite"]) == 0


def test_demo_refuses_to_replace_a_demo_before_training(tmp_path, refused):
    (tmp_path / "demo.json").write_text("{}")
    refused(["demo", "--out", str(tmp_path), "--steps", "1", "--preset", "debug"],
            r"--out: .* already holds a demo \(demo.json\); pass --overwrite")
    assert (tmp_path / "demo.json").read_text() == "{}" and not (tmp_path / "mla_lr0.003").exists()


def test_training_that_meets_a_full_disk_keeps_its_checkpoint_metrics_and_status(tmp_path):
    """Resumed under a file size limit the next checkpoint cannot meet: the run stops with one
    line naming the checkpoint, and the step-2 checkpoint, the metrics and the status stay."""
    run = tmp_path / "run"
    args = ["train", "--preset", "debug", "--batch-size", "2", "--block-size", "8", "--eval-iters", "1",
            "--ckpt-interval", "2", "--no-progress", "--out", str(run)]
    assert main(args + ["--steps", "2"]) == 0
    checkpoint = (run / "checkpoint.safetensors").read_bytes()
    r = _limited(f"import sys; from qkmla.cli import main; sys.exit(main({args + ['--steps', '4', '--resume']!r}))",
                 len(checkpoint) // 2, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"qkmla train: {run / 'checkpoint.safetensors'}: File too large"
    assert (run / "checkpoint.safetensors").read_bytes() == checkpoint
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and status["checkpoint_step"] == 2 and "File too large" in status["error"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert not [p for p in os.listdir(run) if ".tmp" in p]


def test_training_never_replaces_files_that_are_not_its_own(tmp_path, refused):
    """A transformers checkpoint's config.json, a user's `lock` file, the training data itself:
    refused with --overwrite too (--overwrite replaces a run, not whatever shares its names)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    for flags in ([], ["--overwrite"], ["--resume"]):
        refused(["train", "--steps", "1", "--no-progress", "--out", str(hf)] + flags,
                r"--out: .*config.json is not a qkmla run's file \(a JSON file without the 'train' a run writes\)")
    assert json.loads((hf / "config.json").read_text()) == {"model_type": "deepseek_v3"}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "lock").write_text("my notes")
    refused(["train", "--steps", "1", "--no-progress", "--out", str(mine)], r"--out: .*lock is not a qkmla lock file")
    assert (mine / "lock").read_text() == "my notes"
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--steps", "1", "--batch-size", "2", "--block-size", "8",
                 "--eval-iters", "1", "--no-progress", "--out", str(run)]) == 0
    (run / "metrics.jsonl").write_text("x" * 2000)  # as if it were the user's text
    refused(["train", "--steps", "1", "--no-progress", "--tokenizer", "byte", "--block-size", "8", "--out", str(run),
             "--data", str(run / "metrics.jsonl"), "--overwrite"], r"--data: .*metrics.jsonl is a file of the run "
                                                                     r"directory")
    assert (run / "metrics.jsonl").read_text() == "x" * 2000


def _dead_pid() -> int:
    """The pid of a process that has ended (reaped: no process has it now, barring reuse)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_clear_stale_removes_only_what_dead_processes_left(tmp_path):
    """A killed write leaves NAME.tmpPID (a file or a directory) and, in the middle of replacing
    a directory, NAME.replacedPID with NAME missing; the next write removes the first and puts the
    second back. A live process's temporary (a concurrent writer: here this one) stays."""
    from qkmla.utils.files import clear_stale

    dead = _dead_pid()
    (tmp_path / f"out.tmp{dead}").mkdir()
    (tmp_path / f"out.tmp{dead}" / "w").write_text("half")
    (tmp_path / f"out.replaced{dead}").mkdir()
    (tmp_path / f"out.replaced{dead}" / "old").write_text("the user's")
    (tmp_path / f"out.tmp{os.getpid()}").write_text("being written")
    (tmp_path / f"outer.tmp{dead}").write_text("another name's")
    assert sorted(p.name for p in clear_stale(tmp_path / "out")) == [f"out.replaced{dead}", f"out.tmp{dead}"]
    assert sorted(os.listdir(tmp_path)) == ["out", f"out.tmp{os.getpid()}", f"outer.tmp{dead}"]
    assert (tmp_path / "out" / "old").read_text() == "the user's"
    (tmp_path / f"out.replaced{dead}").mkdir()  # with OUT present, a moved-aside copy is only a leftover
    clear_stale(tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out", f"out.tmp{os.getpid()}", f"outer.tmp{dead}"]
    assert clear_stale(tmp_path / "missing" / "out") == []


def test_signals_held_acts_on_a_signal_once_the_block_ends():
    import signal

    from qkmla.utils.files import signals_held

    done = []
    with pytest.raises(KeyboardInterrupt):
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the signal")  # not cut short
    assert done == ["after the signal"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_write_directory_keeps_the_old_directory_on_failure_and_replaces_it_whole(tmp_path):
    from qkmla.utils.files import write_directory

    out = tmp_path / "out"
    write_directory(out, lambda tmp: (tmp / "a").write_text("old"))
    assert os.listdir(tmp_path) == ["out"] and (out / "a").read_text() == "old"

    def full(tmp):
        (tmp / "a").write_text("new")
        raise OSError(28, "No space left on device", str(tmp / "a"))

    with pytest.raises(OSError, match="No space left") as e:
        write_directory(out, full)
    assert e.value.filename == str(out) and os.listdir(tmp_path) == ["out"] and (out / "a").read_text() == "old"
    write_directory(out, lambda tmp: (tmp / "b").write_text("new"))
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["b"]


def test_written_files_get_the_umask_mode_or_keep_the_replaced_files(tmp_path):
    """safetensors writes through a private temporary (mode 0600): a checkpoint or a converted model
    was readable by its owner alone, so on a shared machine nobody else could load it. A new file
    now gets the mode the umask gives any new file; a replaced file keeps its own mode."""
    from qkmla.utils.files import write_directory

    def mode(path):
        return os.stat(path).st_mode & 0o777

    old = os.umask(0o027)
    try:
        save_safetensors({"a": torch.zeros(4)}, tmp_path / "new.safetensors")
        assert mode(tmp_path / "new.safetensors") == 0o640
        write_text(tmp_path / "t.txt", "x")
        os.chmod(tmp_path / "t.txt", 0o604)
        write_text(tmp_path / "t.txt", "y")  # a replaced file keeps the mode its owner gave it
        assert mode(tmp_path / "t.txt") == 0o604
        def fill(tmp):
            from safetensors.torch import save_file

            save_safetensors({"a": torch.zeros(4)}, tmp / "m.safetensors")
            save_file({"b": torch.ones(2)}, str(tmp / "direct.safetensors"))  # as transformers' save_pretrained does

        write_directory(tmp_path / "d", fill)
        assert {p.name: mode(p) for p in (tmp_path / "d").iterdir()} == {"m.safetensors": 0o640,
                                                                        "direct.safetensors": 0o640}
    finally:
        os.umask(old)


def test_make_directory_says_what_is_in_the_way(tmp_path):
    """``mkdir -p`` over a symbolic link to nothing says only "File exists"; the refusal names the link."""
    from qkmla.utils.files import make_directory

    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("x")
    for path, why in ((tmp_path / "link", "link is a symbolic link to .*nowhere, which does not exist"),
                      (tmp_path / "link" / "sub", "link is a symbolic link to .*nowhere, which does not exist"),
                      (tmp_path / "afile" / "sub", "afile is a file, not a directory")):
        with pytest.raises(ValueError, match=f"^--out: cannot make the run directory .* \\(.*{why}\\)$"):
            make_directory("--out", path, "run directory")
    assert make_directory("--out", tmp_path / "a" / "b").is_dir()


def test_a_file_named_through_a_symbolic_link_replaces_the_link_and_only_a_directory_output_follows_it(tmp_path):
    """A run's files, a figure, a results file: a link by that name is replaced, never followed (it
    could lead into another run, past its lock, or onto another command's checkpoint, which
    check_output judged by the link's own directory). A command's own output directory (convert's
    --out) follows a link of this user's, resolved once (output_directory)."""
    from qkmla.utils.files import output_directory, write_directory

    (tmp_path / "real.txt").write_text("old")
    (tmp_path / "file-link").symlink_to(tmp_path / "real.txt")
    write_text(tmp_path / "file-link", "new")
    assert not (tmp_path / "file-link").is_symlink() and (tmp_path / "real.txt").read_text() == "old"
    (tmp_path / "real").mkdir()
    (tmp_path / "dir-link").symlink_to(tmp_path / "real")
    write_directory(tmp_path / "dir-link", lambda tmp: (tmp / "f.txt").write_text("x"))
    assert not (tmp_path / "dir-link").is_symlink() and list((tmp_path / "real").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir-link", "file-link", "real", "real.txt"]

    (tmp_path / "mine").symlink_to(tmp_path / "real")
    assert output_directory("--out", tmp_path / "mine") == tmp_path / "real"
    assert output_directory("--out", tmp_path / "real") == tmp_path / "real"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"^--out: .*dangling is a symbolic link to .*nowhere, which does not exist"):
        output_directory("--out", tmp_path / "dangling")
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    with pytest.raises(ValueError, match=r"^--out: .*loop-a is a symbolic link in a loop of links"):
        output_directory("--out", tmp_path / "loop-a")
    if os.geteuid() == 0:  # root can give a link another owner: one not followed, as the kernel's rule in /tmp
        (tmp_path / "theirs").symlink_to(tmp_path / "real")
        os.lchown(tmp_path / "theirs", 12345, 12345)
        with pytest.raises(ValueError, match=r"^--out: .*theirs is a symbolic link of another user"):
            output_directory("--out", tmp_path / "theirs")


def test_a_replaced_directory_keeps_its_modes_and_a_mode_less_file_system_still_takes_the_write(tmp_path,
                                                                                               monkeypatch):
    from qkmla.utils.files import write_directory

    def fill(tmp):
        (tmp / "kept.txt").write_text("a")
        (tmp / "new.txt").write_text("b")

    old = os.umask(0o022)
    try:
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "kept.txt").write_text("old")
        os.chmod(tmp_path / "d" / "kept.txt", 0o640)
        os.chmod(tmp_path / "d", 0o750)
        write_directory(tmp_path / "d", fill)
        modes = {p.name: os.stat(p).st_mode & 0o777 for p in (tmp_path / "d").iterdir()}
        assert modes == {"kept.txt": 0o640, "new.txt": 0o644} and os.stat(tmp_path / "d").st_mode & 0o777 == 0o750

        def no_modes(*args, **kwargs):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "chmod", no_modes)  # vfat, some network mounts
        assert write_text(tmp_path / "t.txt", "x").read_text() == "x"
    finally:
        os.umask(old)


def test_an_input_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path):
    """One check for every file a command reads (--data, --sweep, --calibration-text, a config.json):
    a FIFO is read forever and a link to nothing said only "no such file"."""
    from qkmla.utils.files import check_input_file, input_file_problem

    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "f.txt")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "fifo")
    assert input_file_problem(tmp_path / "f.txt") is None and input_file_problem(tmp_path / "link") is None
    dangling = f"is a symbolic link to {tmp_path / 'nowhere'}, which does not exist"
    assert input_file_problem(tmp_path / "dangling") == dangling
    assert input_file_problem(tmp_path) == "is a directory"
    assert input_file_problem(tmp_path / "fifo") == "is not a regular file (a FIFO)"
    assert input_file_problem(tmp_path / "none") == "does not exist"
    assert input_file_problem("") == "is an empty path"  # Path("") is ".": "is a directory"
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    assert input_file_problem(tmp_path / "loop-a") == "is a symbolic link in a loop of links"
    assert input_file_problem(tmp_path / ("a" * 300)).startswith("cannot be looked up (File name too long)")
    with pytest.raises(ValueError, match=r"^--sweep: the results file .*fifo is not a regular file"):
        check_input_file("--sweep", tmp_path / "fifo", "results file")
    assert check_input_file("--sweep", str(tmp_path / "link")) == tmp_path / "link"


def test_the_commands_name_an_input_that_is_not_a_regular_file(tmp_path, refused):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "fifo")
    refused(["train", "--data", str(tmp_path / "fifo"), "--steps", "1", "--out", str(tmp_path / "r")],
            r"--data: expected one of .* or a path to a text file, got .*fifo': it is not a regular file \(a FIFO")
    refused(["experiment", "norm-mode", "--sweep", str(tmp_path / "dangling"), "--out", str(tmp_path / "e")],
            r"--sweep: the results file .*dangling is a symbolic link to .*nowhere, which does not exist")
    refused(["convert", "--hf", str(tmp_path), "--out", str(tmp_path / "c")],
            r"--hf: .*config.json does not exist; a Hugging Face checkpoint directory has a config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "fifo"]
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "metrics.jsonl")  # plot read it forever
    refused(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "p.png")],
            r"runs: .*run/metrics.jsonl is not a regular file \(a FIFO")


def test_the_python_entry_points_name_an_input_that_is_not_a_regular_file(tmp_path):
    from qkmla.experiments.base import Options, sweep_lr
    from qkmla.integrations.transformers.generate import load_hf_dir

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(ValueError, match=r"hf_dir: .*config.json is a symbolic link to .*nowhere.json, which does not"):
        load_hf_dir(tmp_path / "ckpt")
    (tmp_path / "lr-sweep" / "results.jsonl").mkdir(parents=True)  # the default sweep path: not the default lr
    with pytest.raises(ValueError, match=r"sweep: the lr-sweep results .*results.jsonl is a directory"):
        sweep_lr(Options(out=tmp_path / "norm-mode"))
    assert sweep_lr(Options(out=tmp_path / "elsewhere" / "x"))[1].startswith("default")  # absent: the default


@pytest.mark.parametrize("figures, refused", [
    (["curves.png"], {"curves.png"}),
    (None, {"curves.png", "s.png", "mine.png"}), ("curves.png", {"curves.png", "s.png", "mine.png"}),
    ({"x.png": 1}, {"curves.png", "s.png", "mine.png"}), ([["curves.png"]], {"curves.png", "s.png", "mine.png"}),
])
def test_an_experiments_own_figures_are_those_its_summary_lists(tmp_path, figures, refused):
    """plot --overwrite refuses the figures an experiment's summary.json lists; a list edited into
    anything else counts every figure as the experiment's (a string matched substrings; a
    nested list let plot replace curves.png)."""
    from qkmla.utils.files import drawn_by

    (tmp_path / "summary.json").write_text(json.dumps({"experiment": "x", "figures": figures}))
    assert {n for n in ("curves.png", "s.png", "mine.png") if drawn_by("experiment", tmp_path / n)} == refused
    assert not drawn_by("train", tmp_path / "curves.png")


def test_a_summary_that_is_not_a_regular_file_is_not_read(tmp_path):
    """A FIFO named summary.json blocked plot --overwrite for ever: only a regular file is read."""
    from qkmla.utils.files import drawn_by

    os.mkfifo(tmp_path / "summary.json")
    assert drawn_by("experiment", tmp_path / "mine.png")

"""Arguments of ``qkmla train`` (also ``torchrun -m qkmla.train``), mapped onto TrainConfig.

Every option's range is checked by :class:`~qkmla.train.config.TrainConfig` when the
arguments are parsed, before any work; its message names the option (``--grad-clip: ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Optional

from ..utils.checked import is_int
from ..utils.environment import dist_environment
from ..utils.errors import flag_message, notice, one_line
from ..model.gpt import ATTENTION_VARIANTS, GPT_PRESETS
from ..utils.threads import add_threads_argument
from .config import DEFAULT_WARMUP_STEPS, TrainConfig, weight_decay_past_lr
from .data import SPLITS
from .optim import MUON_ADJUST, OPTIMIZERS, SCHEDULES, WSD_DECAY_FRACTION, lr_multiplier


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig(out="unused")
    p.add_argument("--preset", default=d.preset, choices=sorted(GPT_PRESETS))
    p.add_argument("--attn", default=d.attn, choices=ATTENTION_VARIANTS)
    p.add_argument("--qk-norm-p", type=float, default=None, help="p of the -lp variants (>= 1)")
    p.add_argument("--learnable-logit-scale", action="store_const", const=True, default=None,
                   help="learn one logit scale per head (always on for -l2/-lp; lifts the temperature cap "
                        "of RMS QK norm)")
    p.add_argument("--softmax-scale", type=float, default=None, metavar="TAU",
                   help="logit scale tau > 0 (initial value when learned); default (d_n + d_r)^-1/2, "
                        "sqrt(d) for -l2/-lp")
    p.add_argument("--steps", type=int, default=d.steps, help=">= 1")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate, > 0")
    p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS)
    p.add_argument("--muon-adjust-lr", default=None, choices=MUON_ADJUST,
                   help=f"with --optimizer muon (default {d.muon_adjust_lr})")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help=">= 0")
    p.add_argument("--schedule", default=d.schedule, choices=SCHEDULES)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help=f"0 to --steps (default {DEFAULT_WARMUP_STEPS}, or --steps if fewer)")
    p.add_argument("--min-lr-ratio", type=float, default=None,
                   help=f"the lr the decay ends at / peak lr, in [0, 1], with --schedule cosine or wsd (default "
                        f"{d.min_lr_ratio}); reached at step --steps, one past the last step trained, which is one "
                        f"decay step above it (a short decay ends well above it)")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm, >= 0; 0 disables clipping")
    p.add_argument("--qk-clip", type=float, default=None, metavar="TAU", help="QK-Clip threshold > 0 (Kimi K2: 100)")
    p.add_argument("--qk-clip-alpha", type=float, default=None,
                   help=f"with --qk-clip: the query's share, in [0, 1] (default {d.qk_clip_alpha})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (split over ranks), >= 1")
    p.add_argument("--block-size", type=int, default=None, help="context length, >= 2 (default: the preset's)")
    p.add_argument("--eval-interval", type=int, default=d.eval_interval, help=">= 1")
    p.add_argument("--eval-iters", type=int, default=d.eval_iters, help=">= 1")
    p.add_argument("--ckpt-interval", type=int, default=d.ckpt_interval, help=">= 1")
    p.add_argument("--log-heads", action="store_true", help="also log every head's max logit")
    p.add_argument("--data", default=d.data, help="tiny_shakespeare, shakespeare, or a text file")
    p.add_argument("--tokenizer", default=d.tokenizer, choices=("char", "byte"))
    p.add_argument("--split", default=d.split, choices=SPLITS,
                   help="tail: the last 10%% validates; plays: whole plays held out for validation and test "
                        "(--data shakespeare)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="0 to 2**32 - 1 (torch's CPU generator keeps a seed's low 32 bits)")
    p.add_argument("--out", default=None, help="run directory (default: a new runs/<preset>-<attn>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in OUT")
    p.add_argument("--max-seconds", type=float, default=None, help="stop (checkpointed) after this long, >= 0")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP under torchrun")
    p.add_argument("--dist-timeout", type=float, default=d.dist_timeout,
                   help="seconds a collective waits for a rank under torchrun before the job fails (> 0)")
    add_threads_argument(p)


def train_flag_message(message: str) -> str:
    """A TrainConfig error with its field named as the ``qkmla train`` option."""
    return flag_message(message, (f.name for f in dataclasses.fields(TrainConfig)))


# What a launch decides, never taken from the stored run on --resume.
PER_LAUNCH = ("out", "resume", "overwrite", "progress", "max_seconds", "dist_timeout", "fsdp")


def given_options(argv: list) -> set:
    """The dests of the ``qkmla train`` options that ``argv`` gives (not left at their defaults)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_train_arguments(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_known_args(argv)[0]))


def stored_settings(out) -> dict:
    """The TrainConfig fields the run in ``out`` was trained with (its checkpoint's record), or {}
    where there is none to read (the trainer then says why it cannot resume)."""
    import json
    from pathlib import Path

    from .checkpoint import FILENAME, read_metadata

    try:
        stored = json.loads(read_metadata(Path(out) / FILENAME)["config"]).get("train")
    except Exception:  # no checkpoint, or a damaged one: train() refuses the resume naming it
        return {}
    return stored if isinstance(stored, dict) else {}


def _decays(config: TrainConfig) -> bool:
    """Whether any step of ``config``'s schedule reads its ``min_lr_ratio``: the last step has the most
    decay progress, so it is the one to look at (0 and 1 as the ratio give it the same lr otherwise)."""
    last = config.steps - 1
    return lr_multiplier(last, config.steps, config.schedule, config.warmup_for, 0.0) != \
        lr_multiplier(last, config.steps, config.schedule, config.warmup_for, 1.0)


def _no_decay_reason(config: TrainConfig, kept_warmup: bool = False) -> str:
    """Why the last step of ``config``'s schedule is still at the peak lr (``_decays`` is False), and the way out.
    The warmup is blamed only where the same run without one decays (a shorter warmup then helps); otherwise
    it is wsd's decay, which starts only at its last fifth of the steps, or a run of a single step.
    ``kept_warmup``: the warmup is a resumed run's own (:func:`_resumed_warmup`), not the default's."""
    n = config.steps
    if n == 1:
        return "a run of 1 step has no step to decay over; give more --steps, or drop it"
    if config.warmup_for > 0 and _decays(config.replace(warmup_steps=0)):
        # A resume's warmup kept from the stored run was said as the default's ("by default 20, or --steps if
        # fewer": 11 for --steps 11, where the run kept its 10)
        reason = (f"a warmup of {config.warmup_for} steps (the stored run's, kept on --resume; --warmup-steps "
                  f"to change it)" if kept_warmup else
                  f"a warmup of {config.warmup_for} steps (--warmup-steps; by default {DEFAULT_WARMUP_STEPS}, or "
                  f"--steps if fewer)")
        ways = "more --steps or a shorter --warmup-steps"
    else:
        start = int(n * (1 - WSD_DECAY_FRACTION))
        reason = (f"--schedule {config.schedule} decays over the last {WSD_DECAY_FRACTION:.0%} of the steps, "
                  f"from step {start + 1} of {n}")
        ways = "more --steps"
    return f"the last of the {n} steps is still at the peak lr ({reason}); give {ways}, or drop it"


def stored_step(out) -> Optional[int]:
    """The step the checkpoint in ``out`` was saved at, or None where there is none to read."""
    from pathlib import Path

    from .checkpoint import FILENAME, read_metadata

    try:
        return int(read_metadata(Path(out) / FILENAME)["step"])
    except Exception:  # no checkpoint, or a damaged one: train() refuses the resume naming it
        return None


def _resumed_warmup(stored: dict, given: dict, typed: set, out=None):
    """The warmup a resume takes: the one the stored run warmed up with when neither gives one. The default
    (20, or every step of a shorter run) follows ``steps``: a 3-step run lengthened to 10 on resume had
    warmed up over 3 steps and, its default now 10, went back below its peak lr to warm up again."""
    old, new = stored.get("steps"), given.get("steps")
    kept = stored.get("warmup_steps")
    if "warmup_steps" not in typed and isinstance(kept, int) and isinstance(new, int) and kept > new:
        # refused as TrainConfig's "--warmup-steps: expected ... got 40", a flag this command did not type
        raise ValueError(f"--steps: {new} is fewer than the stored run's warmup of {kept} steps (its --warmup-steps); "
                         f"give --warmup-steps too (at most {new}), or more --steps")
    if "warmup_steps" in typed or kept is not None or not isinstance(old, int) \
            or isinstance(old, bool) or not isinstance(new, int):
        return given.get("warmup_steps")
    return min(DEFAULT_WARMUP_STEPS, old, new)  # a shortened run: the default's own, as before


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Raises ValueError naming the option for any value out of its range. With ``--resume``, a
    setting the command line does not give (``args.argv``) is the stored run's, not the option's
    default: ``qkmla train --out DIR --resume`` continues the run as it was set up (a resume of a
    run at --lr 0.01 went on at the default 0.001 once a new --lr applied on resume)."""
    # Every option's dest is the TrainConfig field of the same name; only --no-progress is inverted.
    names = {f.name for f in dataclasses.fields(TrainConfig)} & set(vars(args))
    given = {n: getattr(args, n) for n in names}
    unset = [n for n in ("muon_adjust_lr", "qk_clip_alpha", "min_lr_ratio") if given.get(n) is None]
    for name in unset:  # left unset: TrainConfig's default stands
        given.pop(name, None)
    typed, own, already, stored = set(), None, None, {}
    if args.resume and args.out is not None and getattr(args, "argv", None) is not None:
        typed = given_options(args.argv)
        stored = stored_settings(args.out)
        for name, value in stored.items():
            if name in names and name not in typed and name not in PER_LAUNCH:
                given[name] = value
        done, steps = stored_step(args.out), given.get("steps")
        if done is not None and is_int(steps) and 0 < steps <= done:
            # The trainer's own refusal, said in place of the schedule's refusals below: their advice ("a shorter
            # --warmup-steps", "at most 3") was refused next, by this one (probe15 R9, review 15b). Not before
            # the other checks (the trainer's of --data, of an edited config.json), which it would hide.
            already = (f"--steps: the run in {args.out} is already at step {done}; pass --steps above it to train "
                       "further")
        try:
            given["warmup_steps"] = _resumed_warmup(stored, given, typed, args.out)
        except ValueError:
            if already is not None:
                raise ValueError(already) from None
            raise
        own = stored.get("warmup_steps")  # the warmup the stored run trained with
        if own is None and is_int(stored.get("steps")):
            own = min(DEFAULT_WARMUP_STEPS, stored["steps"])
    try:
        config = TrainConfig(**given, progress=not args.no_progress)
    except ValueError as e:
        if str(e).startswith("weight_decay: times lr "):  # both are options here: named as such
            raise ValueError(weight_decay_past_lr("--weight-decay", "--lr", given["weight_decay"],
                                                  given["lr"])) from None
        # the warmup's bound is the steps': told "up to 2", a run already at step 3 refused that next
        warmup = str(e).startswith("warmup_steps:")
        raise ValueError(already if already and warmup else train_flag_message(str(e))) from None
    # A resume keeps the weights the run's seed drew and goes on with the data order its checkpoint's RNG
    # state holds: --seed 7 on a resume of a seed-1337 run trained exactly as without it, while config.json
    # recorded seed 7 (probe 19). (RESUMABLE keeps seed for the grid's branches, which name their own.)
    if "seed" in typed and is_int(stored.get("seed")) and config.seed != stored["seed"]:
        raise ValueError(f"--seed: read by nothing on --resume: the run in {args.out} drew its weights with seed "
                         f"{stored['seed']} and its data order goes on from its checkpoint; drop --seed (or give "
                         f"{stored['seed']}), or pass --overwrite instead of --resume to train from seed {config.seed}")
    # Options that only another option reads: given without it, they would change nothing without
    # a word. (Checked after their ranges, so a bad value is named as such first.)
    for name, reader, add, read in (
            ("muon_adjust_lr", "--optimizer muon", "--optimizer muon", config.optimizer == "muon"),
            ("qk_clip_alpha", "--qk-clip", "--qk-clip TAU", config.qk_clip is not None),
            # a constant schedule never decays, so it has no final lr to set
            ("min_lr_ratio", "--schedule cosine or wsd", "--schedule cosine", config.schedule != "constant")):
        if name not in unset and not read:
            raise ValueError(train_flag_message(f"{name}: only read with {reader}, which this command does not "
                                                f"give; drop it or add {add}"))
    if "qk_clip_alpha" not in unset and config.qk_clip is not None and config.attn == "mla":
        # qk_clip_ reads alpha for MHA/GQA/MQA only: --attn mla --qk-clip 100 --qk-clip-alpha 0.9 trained exactly as 0.5
        raise ValueError("--qk-clip-alpha: read by nothing with --attn mla: MLA's QK-Clip splits each head's factor "
                         "its own way (sqrt(gamma) on the content query and key, gamma on the RoPE query); the query's "
                         "share is for --attn mha, gqa or mqa; drop it")
    if "min_lr_ratio" not in unset and config.schedule != "constant" and not _decays(config):
        # The warmup (by default 20 steps, or every step of a shorter run) can cover every step the decay
        # would take: --steps 9 --schedule wsd --min-lr-ratio 0 ended at the peak lr without a word (probe14 N13).
        # "the stored run's" only where it is: a shortened run's default follows the new --steps (review 15b)
        kept = args.resume and "warmup_steps" not in typed and config.warmup_for == own
        raise ValueError(already or train_flag_message(f"min_lr_ratio: never read: {_no_decay_reason(config, kept)}"))
    # --fsdp shards over torchrun's ranks (the trainer reads it only when there are several): in a
    # single process it would change nothing without a word.
    if config.fsdp and dist_environment()[0] == 1:
        raise ValueError("--fsdp: shards the model over torchrun's ranks, and this process is the only one "
                         "(WORLD_SIZE unset or 1); drop it, or launch with `torchrun --nproc_per_node N -m qkmla.train "
                         "... --fsdp`")
    return config


# A run a signal stopped (checkpointed) exits as a shell reports the signal, as qkmla's other
# commands do (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), so a scheduler can tell it from a failure (1).
EXIT_CODES = {"done": 0, "time limit": 0, "interrupted": 130, "stopped": 143}


def exit_code(status: dict) -> int:
    """The exit status of ``qkmla train`` for the run's final ``status``: 128 + the signal that stopped
    it (its ``signal``), where one did."""
    import signal

    if status["status"] in ("interrupted", "stopped") and hasattr(signal, str(status.get("signal"))):
        return 128 + getattr(signal, status["signal"])
    return EXIT_CODES.get(status["status"], 1)


def check_not_an_experiments_run(out) -> None:
    """Refuse ``--out`` inside an experiment's ``OUT/runs/``: each run there is the experiment's (its
    grid trains them through the API), and ``train --resume --steps 50`` on one lengthened it without
    a word; the experiment then read it as trained with other settings. A copy elsewhere is the
    user's to train on."""
    from ..utils.files import directory_kind

    if out is None:  # a fresh directory under ./runs/ (the trainer names it): not when ./ is an experiment's
        kind = directory_kind(Path.cwd())
        if kind is not None and kind[0] == "experiment":
            raise ValueError(f"--out: not given, and the default, a new directory under runs/, would be a run of the "
                             f"experiment in {Path.cwd()} (qkmla experiment's own directory), which it could not "
                             "resume; give --out, or run from another directory")
        return
    out = Path(out).resolve()  # EXP/runs/RUN/../RUN and a link into EXP/runs are the experiment's run too
    kind = directory_kind(out.parent.parent) if out.parent.name == "runs" else None
    if kind is not None and kind[0] == "experiment":
        raise ValueError(f"--out: {out} is a run of the experiment in {out.parent.parent} (qkmla experiment's own "
                         "directory), which its grid trains and reports; resume the experiment with qkmla experiment, "
                         "or copy the run elsewhere and train the copy")


def run_train(args: argparse.Namespace) -> int:
    """``qkmla train``'s work, from its parsed arguments: the run's status printed as one JSON line,
    and the exit status it gives (:func:`exit_code`)."""
    import json

    from ..utils.environment import check_launch
    from ..utils.threads import apply_threads
    from .trainer import train

    check_launch()  # torchrun's variables without torchrun would wait for ranks that never come
    config = train_config_from_args(args)  # every option checked before the threads are measured
    check_not_an_experiments_run(config.out)
    apply_threads(args.threads, "train")
    status = train(config)
    print(json.dumps(status))
    if status["status"] == "non-finite":
        # Said on stderr too: the JSON line alone (stdout, often a log file) gave a bare exit 1 (probe 18, --lr 1e30)
        notice(one_line(f"qkmla train: {diverged_line(status, config)}"))
    return exit_code(status)


def diverged_line(status: dict, config: TrainConfig) -> str:
    """One line for a run that stopped at a NaN/inf loss, gradient or weight (status ``non-finite``): where, what
    is kept, and the options that steer it."""
    kept = status.get("checkpoint_step") or 0
    where = (f"its last finite checkpoint (step {kept}) is kept in {status['out']}" if status.get("last_checkpoint")
             else f"it wrote no checkpoint; {status['out']} keeps its log")
    error = status.get("error", "a non-finite value")
    if status.get("step") == 0 and error.startswith("loss is ") and error.endswith(" at step 1"):
        # The first loss is the initial model's, before any update: --softmax-scale 3e38 (float32's largest) gave
        # a NaN there, and the line blamed --lr, which no step had yet applied (probe 19).
        given = (("softmax_scale", config.softmax_scale), ("qk_norm_p", config.qk_norm_p))
        model = ", ".join([f"--attn {config.attn}"] + [f"--{name.replace('_', '-')} {value:g}"
                                                       for name, value in given if value is not None])
        return (f"{model}: the model is not finite as it starts: {error}, before any update (status non-finite), "
                f"so no --lr, --grad-clip or --qk-clip can help; {where}; change these settings")
    return (f"--lr {config.lr:g}: the run diverged: {error} (status non-finite); "
            f"{where}; a lower --lr, or --grad-clip / --qk-clip, may keep it finite")

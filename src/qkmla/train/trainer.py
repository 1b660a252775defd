"""The training loop every experiment builds on.

Per step it logs train loss, learning rate, gradient norm, the max pre-softmax attention
logit of every layer (and of every head with ``log_heads``), tokens/s and the seconds spent
measuring the max logits; with QK-Clip also the number of clipped heads and, on a step that
clipped, ``max_logit_after_clip``: the max logit of a no-grad forward of the same batch
through the updated, clipped weights, measured (``max_logit`` is the one the step's forward
saw, before the update). Every ``eval_interval``
steps: validation loss over fixed windows (the same for every seed, so runs compare), and
for QK-normed layers the bound their norm weights put on the logits (``logit_bound``, see
``diagnostics.py``) and the mean learned logit scale. Rows go to
``out/metrics.jsonl`` as they happen. Checkpoints (safetensors) are written every
``ckpt_interval`` steps and at the end, only from finite weights and optimizer state; a run
that reaches a NaN/inf loss, gradient or weight stops, records the step in
``out/status.json`` and keeps its last good checkpoint. The run directory is locked while
training and a run already in it is refused unless resumed or overwritten; a resumed run
must define the same model and data (``rundir.py``, ``config.py``). Ctrl-C (status
``interrupted``) and SIGTERM (``stopped``: what Slurm, Kubernetes and ``docker stop`` send)
checkpoint after the current step and stop; a second one stops at once. Any other exception
leaves status ``failed`` with the error before it propagates.

Under ``torchrun`` (WORLD_SIZE > 1) the model is wrapped in DDP (or sharded with FSDP2 when
``fsdp``): every rank draws the same global batch and trains on its slice, so the losses
equal a single process with the same global batch. A collective that waits longer than
``dist_timeout`` seconds for a rank (one that died or hangs) fails the job with that
message instead of hanging it. The process group this module starts, it also shuts down
(every rank together after a finished run), so no rank fails at exit.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..attention.qk_clip import qk_clip_
from ..dtypes import check_float_state
from ..utils.environment import dist_environment
from ..utils.errors import TERMINATING_SIGNALS, MachineError, notice, one_line
from ..utils.files import append_line, make_directory, same_file, write_text
from ..utils.limits import check_fits
from ..model.gpt import GPT, GPTConfig
from .checkpoint import FILENAME, load_checkpoint, read_metadata, save_checkpoint
from .config import TrainConfig
from .data import Corpus, fixed_starts, get_batch, windows_at
from .diagnostics import forward_max_logits, logit_bound, logit_scale
from .optim import build_optimizer, lr_multiplier, set_lr
from .rendezvous import init_process_group
from .rundir import (RESUMED_DIGEST, RUN_FILES, RunLock, check_run_dir, checkpoint_digest, foreign_checkpoint,
                     fresh_out, gap_line, metrics_line, note_config_written, prepare, read_config_text, record_edits,
                     resume_mismatches, text_digest, truncate_metrics, write_status, written_digests)
from .step_memory import step_saved_bytes

__all__ = ["TrainConfig", "evaluate", "load_model", "train"]


def attention_modules(model: torch.nn.Module) -> list:
    return [block.attn for block in model.blocks]


class NonFiniteError(RuntimeError):
    pass


class CollectiveTimeout(MachineError):
    """Under torchrun: a collective waited ``dist_timeout`` seconds for a rank that died or hangs,
    the rendezvous for a rank that never joined, or the rendezvous could not be served at all
    (MASTER_PORT held by another program)."""


def _dist_info(timeout: float) -> tuple[int, int, bool]:
    """(rank, world size, whether this call started the process group, so must end it)."""
    world = dist_environment()[0]  # junk is refused naming the variable
    started = world > 1 and not dist.is_initialized()
    if started:
        try:
            # in a helper thread, so that SIGTERM or Ctrl-C stops a wait for ranks that never come (rendezvous.py)
            init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=datetime.timedelta(seconds=timeout))
        except dist.DistError as e:  # a rank that never came: torch's DistStoreError was a traceback, "internal error"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            if isinstance(e, dist.DistNetworkError):  # at once, not after the timeout: the port taken, no route
                raise CollectiveTimeout(f"MASTER_PORT: the rendezvous at {where} could not be reached or served "
                                        f"({first}); check MASTER_ADDR and MASTER_PORT (a port another job holds?)"
                                        ) from None
            raise CollectiveTimeout(f"WORLD_SIZE: the rendezvous at {where} did not gather the {world} ranks torchrun "
                                    f"announced within --dist-timeout {timeout:g} s ({first}); start every rank, or "
                                    "raise --dist-timeout") from None
    return ((dist.get_rank(), world) if world > 1 else (0, 1)) + (started,)


class StopSignal(KeyboardInterrupt):
    """A second SIGTERM: stop now (as a second Ctrl-C does), without finishing the step."""


class _StopRequest:
    """The first Ctrl-C (SIGINT) or SIGTERM (what Slurm, Kubernetes and ``docker stop`` send)
    asks the loop to stop after the current step, checkpointed there; a second one stops at
    once. Under torchrun every rank stops at the same step. ``signal`` names the first."""

    SIGNALS = ("SIGINT",) + TERMINATING_SIGNALS  # SIGHUP (a closed terminal) as SIGTERM: it killed the run

    def __init__(self):
        import signal
        import threading

        self.requested, self.signal = False, None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                # SIGTERM or SIGHUP that the process was started ignoring (`trap '' TERM`, `nohup`, a supervisor)
                # stays ignored: it was taken over, and the run stopped by what its starter ignored. (SIGINT is
                # taken whatever its starter did: a shell's `&` ignores it in every background job, and `kill
                # -INT` is a request.)
                if name == "SIGINT" or signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN:
                    self._previous[name] = signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame):
        import signal

        name = signal.Signals(signum).name
        if self.requested:  # the second request
            if name == "SIGINT" and callable(self._previous.get("SIGINT")):
                self._previous["SIGINT"](signum, frame)  # Python's own: KeyboardInterrupt
            raise StopSignal(name)
        self.requested, self.signal = True, name
        again = "Ctrl-C" if name == "SIGINT" else name
        notice(f"\nstopping after this step with a checkpoint ({name}; {again} again to stop now)", sys.stdout)

    def agreed(self, world: int) -> bool:
        if world == 1:
            return self.requested
        flag = torch.tensor(float(self.requested))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag)

    def status(self) -> str:
        """The run's status once stopped: "interrupted" (Ctrl-C) or "stopped" (SIGTERM, SIGHUP)."""
        return "stopped" if self.signal in TERMINATING_SIGNALS else "interrupted"

    def restore(self) -> None:
        import signal

        for name, previous in self._previous.items():
            signal.signal(getattr(signal, name), previous)
        self._previous = {}


def _finite(model: torch.nn.Module, optimizer, world: int) -> bool:
    """Every parameter and optimizer-state tensor this rank holds is finite, on every rank."""
    tensors = list(model.parameters()) + [v for opt in optimizer.optimizers for st in opt.state.values()
                                          for v in st.values() if isinstance(v, torch.Tensor)]
    ok = torch.tensor(float(all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())))
    if world > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)


def _save(out, model, optimizer, step, run_config, generator, fsdp: bool, rank: int) -> None:
    """Every rank takes part in gathering sharded state; rank 0 writes the file."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=opts)
        optim_state = get_optimizer_state_dict(model, optimizer.optimizers, options=opts)
    else:
        model_state, optim_state = model.state_dict(), optimizer.state_dict()
    if rank == 0:
        save_checkpoint(out, model_state, optim_state, step, run_config, generator)


def _load_states(model, optimizer, model_state: dict, optim_state: dict, fsdp: bool) -> None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=opts)
        with optimizer.settings_kept():  # this run's lr and weight decay, not the checkpoint's
            set_optimizer_state_dict(model, optimizer.optimizers, optim_state, options=opts)
    else:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)


@torch.no_grad()
def evaluate(model: GPT, data: torch.Tensor, config: TrainConfig, block_size: int) -> float:
    """Mean loss over ``eval_iters`` batches of windows spread evenly over ``data``: the same
    windows at every evaluation, for every seed and every run of this size."""
    model.eval()
    starts = fixed_starts(data, config.eval_iters * config.batch_size, block_size)
    losses = []
    for i in range(0, len(starts), config.batch_size):  # a batch of windows at a time, not all at once
        xb, yb = windows_at(data, starts[i:i + config.batch_size], block_size)
        losses.append(model(xb, yb)[1].item())
    model.train()
    return sum(losses) / len(losses)


def _weight_diagnostics(attns: list) -> dict:
    """The logit bound of the QK-normed layers and their mean learned logit scale, if any."""
    row = {}
    bounds = [b for b in map(logit_bound, attns) if b is not None]
    if bounds:
        row["logit_bound"] = max(bounds)
    scales = [s for s in map(logit_scale, attns) if s is not None]
    if scales:
        row["logit_scale"] = sum(scales) / len(scales)
    return row


def check_sizes(config: TrainConfig, corpus: Corpus, model_cfg: GPTConfig, world: int = 1) -> None:
    """Before any work, the sizes that drive an allocation against what the data and the memory
    allow: more evaluation windows than the validation split holds distinct ones measure
    nothing more (and were all built at once), and a step's batch must fit in memory."""
    T, V = model_cfg.block_size, model_cfg.vocab_size
    local = config.batch_size // world
    # Every step holds at least its logits and their gradient (float32) and each layer's input.
    check_fits("batch_size", 4 * local * T * (2 * V + model_cfg.n_layer * model_cfg.n_embd),
               f"a training step's logits, their gradient and the layers' inputs for {local} windows of {T} tokens")
    windows, distinct = config.eval_iters * config.batch_size, len(corpus.val) - T
    split = f"the validation split ({len(corpus.val)} tokens) holds {distinct} distinct windows of block_size={T}"
    if config.batch_size > distinct:
        raise ValueError(f"batch_size: an evaluation batch of {config.batch_size} windows is more than {split}; "
                         f"use at most {distinct}, or more validation data")
    if windows > distinct:
        raise ValueError(f"eval_iters: {config.eval_iters} evaluation batches of {config.batch_size} windows are "
                         f"{windows} windows, but {split}; use at most {distinct // config.batch_size}")


def train(config: TrainConfig) -> dict:
    """Run (or resume) a training run; returns a summary dict (also in ``out/status.json``).

    Raises:
        ValueError: before any training, for a run directory that is in use or already holds
            a run (without ``resume``/``overwrite``), a resume whose stored run defines another
            model or data, an unreadable checkpoint, or data too short for one block.
    """
    rank, world, started = _dist_info(config.dist_timeout)
    try:
        status = _train(config, rank, world)
    except BaseException:
        if started:  # other ranks may be gone: no barrier, only this rank's side
            dist.destroy_process_group()
        raise
    if started:  # every rank is here: shut the group down together, so none fails at exit
        dist.barrier()
        dist.destroy_process_group()
    return status


def _train(config: TrainConfig, rank: int, world: int) -> dict:
    if config.batch_size % world:
        raise ValueError(f"batch_size: the global batch {config.batch_size} must split evenly over {world} ranks")
    corpus = Corpus.load(config.data, config.tokenizer, split=config.split)
    model_cfg = config.model_config(corpus.tokenizer.vocab_size)
    corpus.check_block(model_cfg.block_size, "block_size" if config.block_size is not None else "data")
    check_sizes(config, corpus, model_cfg, world)
    if config.out is None:
        if world > 1:
            raise ValueError("out: required under torchrun (every rank must write to the same directory)")
        config = config.replace(out=str(fresh_out(config.preset, config.attn)))
        if rank == 0:
            print(f"writing the run to {config.out} (pass --out to choose)")
        try:
            return _train_in(config, corpus, model_cfg, rank, world)
        finally:  # refused before it wrote a file (a model past memory): no empty directory left behind
            try:
                Path(config.out).rmdir()
            except OSError:  # it holds the run
                pass
    return _train_in(config, corpus, model_cfg, rank, world)


def _train_in(config: TrainConfig, corpus: Corpus, model_cfg: GPTConfig, rank: int, world: int) -> dict:
    """:func:`_train` in the run directory ``config.out``."""
    out = Path(config.out)
    data = Path(config.data)
    if data.is_file() and any(same_file(data, out / name) for name in RUN_FILES):
        raise ValueError(f"data: {data} is a file of the run directory {out}, which training writes; "
                         f"copy it elsewhere first")
    try:
        existing = out.is_dir()
    except OSError:  # a name too long, say: the mkdir below names it
        existing = False
    if rank == 0 and existing:  # a forgotten --resume, or a run in progress there: refused before the model
        with RunLock(out):
            check_run_dir(out, config.resume, config.overwrite)
    if not (world > 1 and config.fsdp):  # a sharded model's forward is a collective: the config's bound stands
        # before the model is made (and the seed set: the models measured draw their weights from torch's RNG)
        check_config_fits(model_cfg, config.batch_size // world, model_cfg.block_size)
    torch.manual_seed(config.seed)
    model = GPT(model_cfg)
    make_directory("out", out, "run directory")
    if rank != 0:
        return _train_locked(config, corpus, model, out, rank, world)
    with RunLock(out):
        note = prepare(out, config.resume, config.overwrite)
        if note:
            print(one_line(f"{out}: {note}"))
        return _train_locked(config, corpus, model, out, rank, world)


def check_config_fits(model_cfg: GPTConfig, batch: int, block_size: int, name: str = "batch_size") -> None:
    """ValueError naming ``name`` if the weights of ``model_cfg``'s model, their gradients and optimizer moments
    and what a step of ``batch`` windows saves for its backward (measured: ``step_memory.py``) exceed the memory
    left, checked before the model is made. Training runs it before the run directory is written, so a refused
    ``--overwrite`` keeps the run it would have replaced.

    From the config, not the model: measured on the whole model, ``qkmla demo --preset paper-400m`` spent 4.5
    minutes on a 2-core machine making the 400M-parameter model and running forwards of 2 and 3 windows through
    its 12 layers before the refusal (probe 18). The weights are counted on the meta device (nothing made), and a
    step's saved bytes measured on models of 1 and 2 layers: the layers are alike (``Block(config)`` each), so the
    bytes grow by the same amount per layer, and 2 layers give any number."""
    # Every trained parameter gets a gradient and at least one optimizer moment (Muon's momentum; AdamW keeps
    # two). Checked first, naming the model's size (--preset): the measurement below runs a forward, which a model
    # whose gradients cannot fit would fail in torch's allocator (paper-400m under `ulimit -v 4000000`). Gradients
    # appear as the backward frees the saved tensors, so the step's floor is the weights and moments plus the
    # larger of the two, not their sum: the sum would refuse a run that fits.
    with torch.device("meta"):
        weights = sum(p.numel() * p.element_size() for p in GPT(model_cfg).parameters() if p.requires_grad)
    params = f"{weights / 4e6:.0f}M" if weights >= 4e6 else f"{weights / 4e3:.0f}K"
    check_fits("preset", 3 * weights, f"the model's {params} parameters (float32), their gradients and optimizer "
                                      "moments")

    def refuse_above(needed: int, measured_on: str) -> None:
        check_fits(name, 2 * weights + max(weights, needed),
                   f"the tensors a training step of {batch} windows of {block_size} tokens of {model_cfg.attn} saves "
                   f"for its backward (measured on {measured_on}), with the weights, their gradients and optimizer "
                   "moments,")

    layers = model_cfg.n_layer
    one = step_saved_bytes(GPT(dataclasses.replace(model_cfg, n_layer=1)), batch, block_size,
                           check=lambda two: refuse_above(two, f"2 windows through 1 of the {layers} layers"))
    refuse_above(one, f"{min(batch, 3)} windows through 1 of the {layers} layers")
    if layers > 1:
        two = step_saved_bytes(GPT(dataclasses.replace(model_cfg, n_layer=2)), batch, block_size)
        refuse_above(one + (layers - 1) * max(two - one, 0), f"{min(batch, 3)} windows through 1 and 2 of the "
                                                             f"{layers} layers")


def _train_locked(config: TrainConfig, corpus: Corpus, model: GPT, out: Path, rank: int, world: int) -> dict:
    model_cfg = model.config
    fsdp = world > 1 and config.fsdp
    if fsdp:  # shard before the optimizer sees the parameters: fully_shard replaces them
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = build_optimizer(model, config.optimizer, config.lr, config.weight_decay,
                                muon_adjust_lr=config.muon_adjust_lr)
    generator = torch.Generator().manual_seed(config.seed)
    run_config = json.loads(json.dumps({"train": dataclasses.asdict(config), "model": dataclasses.asdict(model_cfg),
                                        "tokenizer": corpus.tokenizer.state(), "data": corpus.fingerprint}))
    start = 0
    if config.resume:
        if not (out / FILENAME).is_file():
            # A run stopped before its first checkpoint (a full disk at it, a kill): nothing to continue.
            raise ValueError(f"resume: no checkpoint in {out}, so there is nothing to continue; pass --overwrite "
                             "to start the run over")
        stored = json.loads(read_metadata(out / FILENAME)["config"])
        # config.json and status.json read once for both checks: a file replaced between two reads gave
        # them two different texts to judge (the foreign-checkpoint check one, the hand-edit check another)
        text, written = read_config_text(out / "config.json"), written_digests(out)
        foreign = foreign_checkpoint(out / "config.json", stored, written, text=text)
        if foreign:  # checked first: the settings below were read from that checkpoint, so they agree with it
            # The seed alone may be this run's own resume with another seed, under a qkmla older than
            # RESUMED_DIGEST whose second start shifted its vouch away: nothing left in the directory tells that
            # from another seed's checkpoint copied in, so it stays refused, with the way on for its owner.
            own = ("; if it is this run's own, resumed with another seed by an older qkmla whose status lost that, "
                   f"move {out / 'config.json'} away and resume" if all(d.startswith("seed:") for d in foreign) else "")
            raise ValueError(f"resume: {out / FILENAME} is another run's checkpoint than the one {out / 'config.json'} "
                             f"records ({'; '.join(foreign[:3])}{'; ...' if len(foreign) > 3 else ''}); put the "
                             f"run's own checkpoint back, or pass --overwrite to start over{own}")
        diffs = resume_mismatches(stored, run_config)
        if diffs:
            # One line, as every refusal is (it was a list, one setting a line, under the command's line).
            raise ValueError(f"resume: the run in {out} was trained differently; these must match: "
                             + "; ".join(diffs) + " (steps, the lr schedule, logging and intervals may change; "
                             "see qkmla.train.config.RESUMABLE)")
        edits = record_edits(out / "config.json", stored, run_config, written, text=text)
        if edits:  # the resume rewrites the file: an edit there would vanish without a word
            raise ValueError(f"out: {out / 'config.json'} was changed since the run wrote it ("
                             f"{'; '.join(edits[:3])}{'; ...' if len(edits) > 3 else ''}); a resume takes its "
                             "settings from the checkpoint and the command line, not this file, and would overwrite "
                             "it: undo the change (or remove the file) to resume, give a setting that may change as an "
                             "option (qkmla.train.config.RESUMABLE), or pass --overwrite to start over")
        model_state, optim_state, start = load_checkpoint(out / FILENAME, generator)
        check_float_state(model_state, model, f"resume: checkpoint {out / FILENAME}")
        if start >= config.steps:
            raise ValueError(f"steps: the run in {out} is already at step {start}; pass --steps above it to "
                             "train further")
        _load_states(model, optimizer, model_state, optim_state, fsdp)
    config_text = json.dumps(run_config, indent=1)
    config_digest = text_digest(config_text)
    if rank == 0:
        note_config_written(out, config_digest)  # first: a kill between the two leaves both vouched for
        write_text(out / "config.json", config_text)
        missing = truncate_metrics(out, start)  # a resumed run logs the steps after its checkpoint again
        if missing:  # metrics.jsonl deleted or cut by hand: the resume went on without a word, its log a gap
            notice(one_line(gap_line(out / "metrics.jsonl", missing, start)))

    wrapped = model
    if world > 1 and not fsdp:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    attns = attention_modules(model)
    for a in attns:
        a.track_max_logits = True

    block_size = model_cfg.block_size
    local = config.batch_size // world
    metrics_path = out / "metrics.jsonl"
    status = {"status": "running", "step": start, "out": str(out), "pid": os.getpid(), "checkpoint_step": start,
              "config_sha256": config_digest}  # which config.json is qkmla's own (rundir.record_edits)
    if config.resume:  # until its first checkpoint, the run goes on from the one it resumed (foreign_checkpoint),
        # under a key of its own: note_config_written shifts config_sha256_previous at every start, and a second
        # resume killed between that and this write lost the vouch and was refused as another run's
        status[RESUMED_DIGEST] = checkpoint_digest(stored)
    if rank == 0:
        write_status(out, status)
    bar = None
    if rank == 0 and config.progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start, desc=f"{config.attn}", unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    step = start  # steps finished and logged
    between_steps = True  # the weights are those of `step` (no update half-way through)
    stop = _StopRequest()

    def checkpoint(done_steps: int) -> None:
        if not _finite(model, optimizer, world):
            raise NonFiniteError(f"weights or optimizer state are not finite after step {done_steps}")
        _save(out, model, optimizer, done_steps, run_config, generator, fsdp, rank)
        status["checkpoint_step"] = done_steps
        status.pop(RESUMED_DIGEST, None)  # the checkpoint is this config's now
        if rank == 0:  # so that a killed run's status says how far it got
            write_status(out, status)

    try:
        for i in range(start, config.steps):
            mult = lr_multiplier(i, config.steps, config.schedule, config.warmup_for, config.min_lr_ratio)
            set_lr(optimizer, mult)
            x, y = get_batch(corpus.train, config.batch_size, block_size, generator)
            x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
            t0 = time.perf_counter()
            between_steps = False
            _, loss = wrapped(x, y)
            loss_value = loss.detach()
            if world > 1:
                dist.all_reduce(loss_value)
                loss_value /= world
            if not math.isfinite(loss_value.item()):
                raise NonFiniteError(f"loss is {loss_value.item()} at step {i + 1}")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf"))
            if not math.isfinite(float(grad_norm)):
                raise NonFiniteError(f"gradient norm is {float(grad_norm)} at step {i + 1}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            heads = torch.stack([a.last_max_logits.float() for a in attns])  # [layers, h]
            if world > 1:
                dist.all_reduce(heads, op=dist.ReduceOp.MAX)
            gammas = None
            if config.qk_clip is not None:
                gammas = torch.stack([qk_clip_(a, m, config.qk_clip, config.qk_clip_alpha)
                                      for a, m in zip(attns, heads)])
            dt = time.perf_counter() - t0
            row = {"step": i + 1, "loss": loss_value.item(), "lr": optimizer.param_groups[0]["lr"],
                   "grad_norm": float(grad_norm), "max_logit": float(heads.max()),
                   "max_logit_per_layer": [round(float(v), 4) for v in heads.amax(dim=1)],
                   "tokens_per_s": config.batch_size * block_size / dt,
                   "max_logit_seconds": sum(a.max_logit_seconds for a in attns), "step_seconds": dt}
            if config.log_heads:
                row["max_logit_per_head"] = [[round(float(v), 4) for v in layer] for layer in heads]
            if gammas is not None:
                row["clipped_heads"] = int((gammas < 1).sum())
                if row["clipped_heads"]:
                    # Measured, not min(S_h, tau): the optimizer step moved the weights after
                    # S_h was seen, so the clip's factor need not bring the logits to tau.
                    t1 = time.perf_counter()
                    after = forward_max_logits(model, x)
                    if world > 1:
                        dist.all_reduce(after, op=dist.ReduceOp.MAX)
                    row["max_logit_after_clip"] = float(after.max())
                    row["max_logit_after_clip_per_layer"] = [round(float(v), 4) for v in after.amax(dim=1)]
                    row["after_clip_seconds"] = time.perf_counter() - t1
            if (i + 1) % config.eval_interval == 0 or i + 1 == config.steps:
                row["val_loss"] = evaluate(model, corpus.val, config, block_size)
                row.update(_weight_diagnostics(attns))
            if rank == 0:
                append_line(metrics_path, metrics_line(row))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", max_logit=f"{row['max_logit']:.1f}",
                                    **({"val": f"{row['val_loss']:.3f}"} if "val_loss" in row else {}))
            step, between_steps = i + 1, True
            status.update(step=step, loss=row["loss"], val_loss=row.get("val_loss", status.get("val_loss")))
            if step % config.ckpt_interval == 0 or step == config.steps:
                checkpoint(step)
            out_of_time = config.max_seconds is not None and time.perf_counter() - t_start > config.max_seconds
            stopping = stop.agreed(world)
            if out_of_time or stopping:
                if status["checkpoint_step"] != step:
                    checkpoint(step)
                status["status"] = stop.status() if stopping else "time limit"
                if stopping:  # which one: its exit status is 128 + its number (train.cli.exit_code)
                    status["signal"] = stop.signal
                break
        else:
            status["status"] = "done"
    except NonFiniteError as e:
        status.update(status="non-finite", step=step, error=str(e))
    except KeyboardInterrupt:  # checkpointed where the weights match the log; else the last one stands
        status.update(status=stop.status() if stop.signal else "interrupted", step=step,
                      signal=stop.signal or "SIGINT")
        try:
            if between_steps and status["checkpoint_step"] != step:
                checkpoint(step)
        except NonFiniteError as e:
            status["error"] = str(e)
    except BaseException as e:
        status.update(status="failed", step=step, error=f"{type(e).__name__}: {e}")
        if world > 1 and isinstance(e, RuntimeError) and "timed out" in str(e).lower():
            status["error"] = (f"rank {rank}: a collective waited more than dist_timeout={config.dist_timeout:g} s for "
                               f"another rank (it died or hangs) at step {step + 1}; the last checkpoint (step "
                               f"{status['checkpoint_step']}) is kept in {out}")
            raise CollectiveTimeout(status["error"]) from e
        raise
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
        for a in attns:
            a.track_max_logits = False
        status["seconds"] = time.perf_counter() - t_start
        status["last_checkpoint"] = str(out / FILENAME) if (out / FILENAME).is_file() else None
        status.pop("pid", None)
        if rank == 0:
            try:
                write_status(out, status)
            except OSError:  # a full disk: the error that stopped the run is the one to report
                if status["status"] != "failed":
                    raise
    return status


def load_model(run_dir: str | Path) -> tuple[GPT, "Tokenizer"]:  # noqa: F821
    """The trained model and tokenizer of a run directory."""
    from .checkpoint import read_checkpoint
    from .data import Tokenizer

    state, _, meta = read_checkpoint(run_dir)
    try:
        cfg = json.loads(meta["config"])
        model = GPT(GPTConfig(**cfg["model"]))
        tok = cfg["tokenizer"]
    except (ValueError, TypeError, KeyError) as e:  # another version's config, or not one at all
        raise ValueError(f"run_dir: the checkpoint in {run_dir} describes a model this qkmla cannot build ({e})") from None
    check_float_state(state, model, f"checkpoint {run_dir}")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # missing or misshapen weights: not the model its config describes
        raise ValueError(f"run_dir: the weights in {run_dir} do not fit the model its config describes "
                         f"({str(e).splitlines()[0]} ...)") from None
    return model.eval(), Tokenizer(tok["kind"], tok["chars"])

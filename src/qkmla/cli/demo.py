"""``qkmla demo``: the main job, about 3 minutes on a 2-core CPU.

1. Train QK-normed MLA (blockwise RMS, the paper's method) and plain MLA the same way
   (same preset, data, seed and a fixed number of steps) at a moderate and at a high
   learning rate, the contrast the ``lr-sweep`` experiment found most telling
   (docs/results.md), with progress bars that show the time left.
2. Report validation losses (fixed windows, the same for every run) and the peak max
   attention logits, and draw the curves (``OUT/curves.png``).
3. On the trained QK-normed model, check that the absorbed decode path reproduces the
   explicit path: attention logits of every layer, and LM logits of a prompt decoded token
   by token through the latent cache.
4. Print the cache bytes per token of MHA, MLA and QK-normed MLA at this model's shape.
5. Sample text through the latent cache.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from ..cache.size import CacheShape, cache_rows
from ..utils.errors import Stopped
from ..utils.files import check_own_directory, check_path, make_directory, special_file, write_text
from ..model.generate import generate
from ..model.gpt import GPT
from ..train.data import Corpus, get_batch
from ..train.plot import plot_runs, read_metrics
from ..train.rundir import RunLock, check_run_dir
from ..train.cli import exit_code
from ..train.trainer import TrainConfig, check_config_fits, load_model, train
from ..utils.checked import is_int

STEPS = 750  # per run: fixed, so results reproduce; 4 runs take about 2.5 minutes on 2 cores
LEARNING_RATES = {"moderate": 3e-3, "high": 3e-2}
MODELS = ("mla-qknorm", "mla")


@torch.no_grad()
def check_absorbed(model: GPT, corpus: Corpus, prompt_len: int = 32, decode_len: int = 32) -> dict:
    """Max |explicit - absorbed| of attention logits per layer and of LM logits via the cache."""
    model.eval()
    gen = torch.Generator().manual_seed(0)
    T = min(model.config.block_size, prompt_len + decode_len)
    x, _ = get_batch(corpus.val, 4, T, gen)
    h = model.wte(x)
    per_layer = []
    for block in model.blocks:  # the Appendix E test on each trained layer's real inputs
        a = block.ln_1(h)
        e, b = block.attn.logits(a, "explicit"), block.attn.logits(a, "absorbed")
        finite = torch.isfinite(e)
        per_layer.append(float((e[finite] - b[finite]).abs().max()))
        h = block(h)
    full, _ = model(x)
    caches = model.make_caches(4, T)
    p = T // 2
    pieces = [model(x[:, :p], caches=caches)[0]] + [model(x[:, t:t + 1], caches=caches)[0] for t in range(p, T)]
    lm = float((torch.cat(pieces, 1) - full).abs().max())
    return {"attention_logit_max_abs_diff_per_layer": per_layer, "lm_logit_max_abs_diff": lm,
            "lm_logit_max_abs": float(full.abs().max())}


def cache_report(model: GPT) -> list[dict]:
    """Cache bytes per token (one layer and all layers) at this model's shape, fp32 and bf16."""
    cfg = model.blocks[0].attn.config
    rows = []
    for dtype in ("fp32", "bf16"):
        shape = CacheShape(num_layers=model.config.n_layer, num_heads=cfg.num_heads, head_dim=model.config.head_dim,
                           num_kv_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank,
                           qk_rope_head_dim=cfg.qk_rope_head_dim, num_kv_groups=cfg.num_kv_groups, dtype=dtype)
        for r in cache_rows(shape, 1):
            if r["variant"] in ("mha", "mla", "mla-qknorm"):
                rows.append({"dtype": dtype, "variant": r["variant"], "bytes_per_token_layer": r["bytes_per_token_layer"],
                             "bytes_per_token": r["bytes_per_token"]})
    return rows


def _run_dirs(out: Path) -> list[tuple[str, float, str, Path]]:
    """(lr name, lr, attn, run directory) of every demo run."""
    return [(name, lr, attn, out / f"{attn}_lr{lr:g}") for name, lr in LEARNING_RATES.items() for attn in MODELS]


def _configs(out: Path, preset: str, steps: int, overwrite: bool = False) -> list[TrainConfig]:
    """The TrainConfig of every demo run, in the order of :func:`_run_dirs` (made, so checked, before any work)."""
    return [TrainConfig(preset=preset, attn=attn, lr=lr, steps=steps, batch_size=12, warmup_steps=max(1, steps // 15),
                        eval_interval=max(1, steps // 6), eval_iters=20, ckpt_interval=steps, out=str(run),
                        overwrite=overwrite) for _, lr, attn, run in _run_dirs(out)]


def _train_all(out: Path, configs: list[TrainConfig]) -> list[dict]:
    runs = []
    for (name, lr, attn, run), cfg in zip(_run_dirs(out), configs):
        status = train(cfg)
        rows = read_metrics(run)
        peaks = [r["max_logit"] for r in rows if r.get("max_logit") is not None]  # null: non-finite
        runs.append({"attn": attn, "lr": lr, "lr_name": name, "dir": str(run), "status": status["status"],
                     "step": status["step"], "val_loss": status.get("val_loss") if status["status"] == "done"
                     else None, "peak_max_logit": max(peaks, default=None),
                     "final_max_logit": rows[-1]["max_logit"] if rows else None, "seconds": status["seconds"]})
        if status["status"] in ("stopped", "interrupted"):  # SIGTERM, SIGHUP or Ctrl-C: train checkpointed it
            sig = status.get("signal") or ("SIGTERM" if status["status"] == "stopped" else "SIGINT")
            raise Stopped(f"stopped by {sig}: {attn} at lr {lr:g} was checkpointed at step {status['step']} in {run}; "
                          "the demo does not resume: run it again with --overwrite", exit_code(status))
        if status["status"] not in ("done", "non-finite"):
            raise RuntimeError(f"{attn} at lr {lr:g}: training stopped: {status}")
    return runs


def _check_in_the_way(out: Path) -> None:
    """Before any training: what stands where the demo writes a file or a run (a directory as demo.json or
    curves.png, a file as a run's directory, a directory or FIFO as a run's file) is refused, naming it; it was
    found only by the write, after every run (or the runs before it) had trained."""
    for name, what in (("demo.json", "summary"), ("curves.png", "figure")):
        kind = "a directory" if (out / name).is_dir() else special_file(out / name)
        if kind is not None:
            raise ValueError(f"out: {out / name} is {kind}, not a regular file, where the demo writes its {what}; "
                             "move it away, or choose another --out")
    for *_, run in _run_dirs(out):
        if os.path.lexists(run) and not run.is_dir():
            raise ValueError(f"out: {run} is not a directory, where the demo trains a run; move it away, or choose "
                             "another --out")
        if run.is_dir():
            check_run_dir(run, resume=False, overwrite=True)  # its files: a directory or a FIFO in the way


def run_demo(out: str = "runs/demo", steps: Optional[int] = None, preset: str = "cpu", overwrite: bool = False) -> int:
    """The demo into ``out``; a demo already there is replaced only with ``overwrite`` (refused
    before any training otherwise)."""
    out = check_path("out", out, "demo directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} is a file; it names the demo's directory")
    check_own_directory("out", out, "demo")
    held = [p for p in [run for *_, run in _run_dirs(out)] + [out / "curves.png", out / "demo.json"] if p.exists()]
    if held and not overwrite:
        raise ValueError(f"out: {out} already holds a demo ({', '.join(p.name for p in held[:3])}"
                         f"{', ...' if len(held) > 3 else ''}); pass --overwrite to replace it, or choose another --out")
    _check_in_the_way(out)
    if steps is not None and (not is_int(steps) or steps < 1):
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    configs = _configs(out, preset, steps if steps is not None else STEPS, overwrite)  # --preset checked here
    vocab_size = Corpus.load("tiny_shakespeare").tokenizer.vocab_size
    for cfg in configs[:len(MODELS)]:  # every model the demo trains: a preset too big for this machine is
        model_cfg = cfg.model_config(vocab_size)  # refused before the demo's directory is made, naming --preset
        check_config_fits(model_cfg, cfg.batch_size, model_cfg.block_size, name="preset")  # before making it
    make_directory("out", out, "demo directory")
    with RunLock(out):  # a second demo on the same directory is refused, as a second train is
        return _run_demo_locked(out, steps, preset, configs)


def _run_demo_locked(out: Path, steps: Optional[int], preset: str, configs: list[TrainConfig]) -> int:
    t_start = time.perf_counter()
    corpus = Corpus.load("tiny_shakespeare")
    steps_given = steps is not None
    steps = steps if steps_given else STEPS
    print(f"training {len(MODELS) * len(LEARNING_RATES)} models x {steps} steps ({preset} preset: about 2.5 minutes "
          "on a 2-core CPU at the default steps; each bar shows the time left)")
    try:
        runs = _train_all(out, configs)
    except RuntimeError as e:
        print(e)
        return 1
    png = plot_runs([r["dir"] for r in runs], out / "curves.png",
                    labels=[f"{r['attn']} lr {r['lr']:g}" for r in runs])

    model, tok = load_model(out / f"mla-qknorm_lr{LEARNING_RATES['moderate']:g}")
    check = check_absorbed(model, corpus)
    sizes = cache_report(model)
    sample = generate(model, [tok.encode("ROMEO:\n")], 300, temperature=0.8, top_k=20,
                      generator=torch.Generator().manual_seed(0))[0]

    print()
    print(f"after {steps} steps (tiny Shakespeare, char level, nanoGPT's 90/10 split; loss over fixed windows):")
    print(f"  {'model':<11} {'lr':>6}  {'val loss':>8}  {'peak max logit':>14}")
    for r in runs:
        loss = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else f"diverged at step {r['step']}"
        peak = "-" if r["peak_max_logit"] is None else f"{r['peak_max_logit']:.1f}"
        print(f"  {r['attn']:<11} {r['lr']:>6g}  {loss:>8}  {peak:>14}")
    print(f"curves: {png}")
    print("absorbed decode path vs explicit path on the trained QK-normed model:")
    print("  attention logits, max |diff| per layer: " + ", ".join(f"{d:.2e}" for d in check["attention_logit_max_abs_diff_per_layer"]))
    print(f"  LM logits through the latent cache, max |diff|: {check['lm_logit_max_abs_diff']:.2e} "
          f"(logits up to {check['lm_logit_max_abs']:.1f})")
    print("cache bytes per token at this model's shape (one layer / all layers):")
    for r in sizes:
        print(f"  {r['dtype']:<5}{r['variant']:<12}{r['bytes_per_token_layer']:>7,} / {r['bytes_per_token']:,}")
    print("sample through the latent cache:")
    print("ROMEO:\n" + tok.decode(sample))
    summary = {"command": f"qkmla demo --out {out} --preset {preset}" + (f" --steps {steps}" if steps_given else ""),
               "steps": steps, "runs": runs, "check": check, "cache_bytes": sizes, "sample": tok.decode(sample),
               "seconds": time.perf_counter() - t_start}
    write_text(out / "demo.json", json.dumps(summary, indent=1))
    ok = max(check["attention_logit_max_abs_diff_per_layer"]) < 1e-3 and check["lm_logit_max_abs_diff"] < 1e-3
    print(f"total {summary['seconds']:.0f} s; absorbed == explicit: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1

"""``qkmla demo``: the main job, about 3 minutes on a 2-core CPU.

1. Train QK-normed MLA (blockwise RMS) and plain MLA the same way (same preset, data,
   seed, number of steps) on the embedded tiny Shakespeare, with progress bars.
2. Report both validation losses and draw the curves (``OUT/curves.png``).
3. On the trained QK-normed model, check that the absorbed decode path reproduces the
   explicit path: attention logits of every layer, and LM logits of a prompt decoded token
   by token through the latent cache.
4. Print the cache bytes per token of MHA, MLA and QK-normed MLA at this model's shape.
5. Sample text through the latent cache.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch

from .cache.size import CacheShape, cache_rows
from .model.generate import generate
from .model.gpt import GPT
from .train.data import Corpus, get_batch
from .train.optim import build_optimizer
from .train.plot import plot_runs
from .train.trainer import TrainConfig, load_model, train

BUDGET_SECONDS = 150.0  # both trainings together; checks and sampling take a few seconds more


def _seconds_per_step(cfg: TrainConfig, corpus: Corpus) -> float:
    """Time three optimizer steps of the QK-normed model, to size the runs to the budget."""
    torch.manual_seed(0)
    model = GPT(cfg.model_config(corpus.tokenizer.vocab_size))
    opt = build_optimizer(model, cfg.optimizer, cfg.lr)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(4):
        x, y = get_batch(corpus.train, cfg.batch_size, model.config.block_size, gen)
        t0 = time.perf_counter()
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[1]


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


def run_demo(out: str = "runs/demo", steps: Optional[int] = None, preset: str = "cpu") -> int:
    out = Path(out)
    t_start = time.perf_counter()
    corpus = Corpus.load("tiny_shakespeare")
    base = TrainConfig(preset=preset, attn="mla-qknorm", lr=2e-3, batch_size=12, warmup_steps=50,
                       eval_interval=100, eval_iters=20, ckpt_interval=100)
    steps_given = steps is not None
    if steps is None:
        per_step = _seconds_per_step(base, corpus)
        steps = max(100, min(5000, int(BUDGET_SECONDS / 2 / (per_step * 1.15)) // 50 * 50))
        print(f"{preset}: {per_step * 1000:.0f} ms per step on this machine -> {steps} steps per model")
    results = {}
    for attn in ("mla-qknorm", "mla"):
        cfg = TrainConfig(**{**base.__dict__, "attn": attn, "steps": steps, "out": str(out / attn),
                             "eval_interval": max(1, steps // 8)})
        status = train(cfg)
        if status["status"] != "done":
            print(f"{attn}: training stopped: {status}")
            return 1
        results[attn] = status
    png = plot_runs([out / "mla-qknorm", out / "mla"], out / "curves.png")

    model, tok = load_model(out / "mla-qknorm")
    check = check_absorbed(model, corpus)
    sizes = cache_report(model)
    sample = generate(model, [tok.encode("ROMEO:\n")], 300, temperature=0.8, top_k=20,
                      generator=torch.Generator().manual_seed(0))[0]

    print()
    print(f"validation loss after {steps} steps (tiny Shakespeare, char level, nanoGPT's 90/10 split):")
    for attn, st in results.items():
        print(f"  {attn:<11} {st['val_loss']:.4f}   ({st['seconds']:.0f} s)")
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
               "steps": steps, "val_loss": {a: s["val_loss"] for a, s in results.items()}, "check": check,
               "cache_bytes": sizes, "sample": tok.decode(sample), "seconds": time.perf_counter() - t_start}
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    ok = max(check["attention_logit_max_abs_diff_per_layer"]) < 1e-3 and check["lm_logit_max_abs_diff"] < 1e-3
    print(f"total {summary['seconds']:.0f} s; absorbed == explicit: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1

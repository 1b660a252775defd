"""``compression``: quantized latent caches and eviction policies on models trained here.

Two models, plain and QK-normed MLA (the ``cpu`` preset, 4 layers x 4 heads x 128, AdamW at
3e-3), train for 800 steps at a 1,024-character context on tiny Shakespeare with passkey
records woven in (:mod:`.passkey`). Each trained model is then read through compressed caches:

* every storage format of the latent, all tokens kept: ``kv_format`` dense (float32, the
  reference), fp8, int8, int4, and a dense cache stored in bfloat16;
* every eviction policy (StreamingLLM, H2O, SnapKV) keeping 50 / 25 / 12.5% of the tokens
  seen, over the dense cache and over fp8 latents.

Protocol (:func:`measure`), as a served request: each of ``WINDOWS`` fixed validation windows
of one context ends just after a passkey that closes at least ``LONG_RANGE`` tokens after it
opened. Everything but the last ``DECODE`` tokens is prefilled (the key's opening inside
it); the policy runs after the prefill (SnapKV only then, as the paper; StreamingLLM and H2O
also every ``EVERY`` decode steps); the last ``DECODE`` tokens are fed one at a time
(teacher forcing) and read the compressed cache. Against the uncompressed cache it reports
the relative change of the next-token loss over those positions, the top-1 agreement of
the predictions, the accuracy on the closing passkey's digits, the kept fraction of the
tokens seen at the end, and the bytes per token and layer the format stores (latent, RoPE
key, key scalars), also times the kept fraction.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..cache.eviction import H2O, SnapKV, StreamingLLM
from ..train.data import fixed_windows
from .base import Experiment, Options, Report, train_settings
from .figures import pyplot, save, table
from .grid import Run, trained_run
from .passkey import key_targets, write_passkey_corpus

VARIANTS = ("mla", "mla-qknorm")
CONTEXT = 1024
STEPS = 800
FORMATS = ("dense", "bf16", "fp8", "int8", "int4")  # "bf16": a dense cache stored in bfloat16
POLICIES = {"streaming-llm": lambda f, every: StreamingLLM(sinks=4, kept_fraction=f, interval=every),
            "h2o": lambda f, every: H2O(kept_fraction=f, window=32, interval=every),
            "snapkv": lambda f, every: SnapKV(kept_fraction=f, window=32)}  # prompt compression, as the paper
FRACTIONS = (0.5, 0.25, 0.125)
EVICTED_FORMATS = ("dense", "fp8")
DECODE = 128  # tokens fed one at a time after the prefill of each window
EVERY = 16  # decode steps between evictions (StreamingLLM, H2O)
WINDOWS = 16
LONG_RANGE = 300  # the passkeys scored close at least this many tokens after they open
LR = 3e-3  # both models, AdamW: the demo's rate (not each variant's best; see docs/results.md)
TARGETS = {"fp8": 0.005, "int8": 0.002}  # the bounds on the relative validation-loss change


def corpus_path(options: Options) -> Path:
    return write_passkey_corpus(options.out / "passkey_shakespeare.txt")


def plan(options: Options) -> list[Run]:
    lr = LR
    data = str(corpus_path(options))
    context = 64 if options.quick else CONTEXT
    runs = []
    for seed in options.seed_list(1):
        for v in VARIANTS:
            train = train_settings(options.quick, STEPS, attn=v, lr=lr, seed=seed, data=data, block_size=context,
                                   batch_size=4 if options.quick else 8, eval_iters=2 if options.quick else 10)
            runs.append(Run(f"{v}_s{seed}", v, train, {"lr": lr, "seed": seed,
                                                        "context": context}))
    return runs


def settings(context: int) -> list[dict]:
    """Every compressed cache measured, as {"format", "policy", "fraction"} (policy None: all kept)."""
    out = [{"format": f, "policy": None, "fraction": 1.0} for f in FORMATS]
    out += [{"format": f, "policy": p, "fraction": fr} for f in EVICTED_FORMATS for p in POLICIES for fr in FRACTIONS]
    return out


def passkey_windows(val: torch.Tensor, keys: torch.Tensor, count: int, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` windows of ``context`` tokens, each ending just after a closing passkey, spread
    evenly over the validation split: x [count, T], y [count, T] (x shifted by one) and
    is_key [count, T] (y[t] is a closing-key digit). The last targets are the key's last
    digit, then the newline and the next record's '#'."""
    last = [int(i) for i in keys.nonzero().flatten() if not keys[i + 1:i + 2].any()]  # each key's last digit
    last = [e for e in last if context - 2 <= e <= len(val) - 3]
    if len(last) < count:
        raise ValueError(f"val: {len(last)} scored passkeys fit a {context}-token window, fewer than count={count}")
    starts = [last[round(i * (len(last) - 1) / max(1, count - 1))] + 2 - context for i in range(count)]
    x = torch.stack([val[s:s + context] for s in starts])
    y = torch.stack([val[s + 1:s + 1 + context] for s in starts])
    is_key = torch.stack([keys[s + 1:s + 1 + context] for s in starts])
    return x, y, is_key


@torch.no_grad()
def decode_logits(model, x: torch.Tensor, decode: int, fmt_name: str = "dense", policy=None) -> tuple[torch.Tensor, float, int]:
    """Prefill x[:, :T - decode] into fresh caches, feed the rest one token at a time.

    Returns the logits of the decoded positions [B, decode, V], the kept fraction (the
    tokens each decoded position attended to over the tokens it has seen, mean over
    positions, layers and sequences) and the cache's bytes per token and layer.
    """
    B, T = x.shape
    kw = {"dtype": torch.bfloat16} if fmt_name == "bf16" else {"kv_format": fmt_name}
    caches = model.make_caches(B, T, policy=policy, **kw)
    model(x[:, :T - decode], caches=caches)
    out, kept = [], 0.0
    for t in range(T - decode, T):
        kept += sum(float(c.seqlens.float().mean()) + 1 for c in caches) / len(caches) / (t + 1)
        logits, _ = model(x[:, t:t + 1], caches=caches)
        out.append(logits[:, -1])
    return torch.stack(out, dim=1), kept / decode, caches[0].bytes_per_token


def measure(path: Path) -> dict:
    """The compression grid on one trained model (see the module docstring).

    Loss change and top-1 agreement are measured on validation windows spread evenly over
    the split (``fixed_windows``, as the training's validation loss), passkey accuracy on
    windows that end at a long-range passkey; both kinds go through the same caches."""
    model, corpus = trained_run(path)
    context = model.config.block_size
    quick = context < CONTEXT
    decode = context // 4 if quick else DECODE
    windows = 4 if quick else WINDOWS
    keys = key_targets(corpus.val, corpus.tokenizer, min_distance=context // 4 if quick else LONG_RANGE)
    x_key, y_key, is_key = passkey_windows(corpus.val, keys, windows, context)
    x_val, y_val = fixed_windows(corpus.val, windows, context)
    x = torch.cat((x_val, x_key))
    y_val, y_key, is_key = y_val[:, -decode:], y_key[:, -decode:], is_key[:, -decode:]

    def scored(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(loss on the validation windows, their predictions, passkey accuracy)."""
        val, key = logits[:windows], logits[windows:]
        return (F.cross_entropy(val.flatten(0, 1), y_val.flatten()), val.argmax(-1),
                float((key.argmax(-1) == y_key)[is_key].float().mean()))

    ref_logits, _, ref_bytes = decode_logits(model, x, decode)
    ref_loss, ref_pred, ref_passkey = scored(ref_logits)
    rows = []
    for s in settings(context):
        policy = POLICIES[s["policy"]](s["fraction"], EVERY) if s["policy"] else None
        logits, kept, nbytes = decode_logits(model, x, decode, s["format"], policy)
        loss, pred, passkey = scored(logits)
        rows.append({**s, "loss": float(loss), "loss_delta_rel": float(loss / ref_loss - 1),
                     "top1_agreement": float((pred == ref_pred).float().mean()), "passkey_accuracy": passkey,
                     "kept": kept, "bytes_per_token": nbytes, "effective_bytes_per_token": nbytes * kept})
    return {"reference_loss": float(ref_loss), "reference_bytes_per_token": ref_bytes,
            "reference_passkey_accuracy": ref_passkey, "key_digits": int(is_key.sum()),
            "decoded_positions": int(y_val.numel()), **copy_losses(model, corpus.val, windows, context),
            "settings": rows}


@torch.no_grad()
def copy_losses(model, val: torch.Tensor, count: int, context: int) -> dict:
    """Does the model use far context at all? Loss on a passage and on the same passage
    repeated right after it, in windows of one context (no cache). A model that copies (an
    induction head) predicts the repeat far better; one that does not cannot lose much to an
    evicted cache, whatever the policy."""
    n = context * 7 // 16  # each copy; the window opens with context - 2n tokens of other text
    starts = torch.linspace(0, len(val) - context - n - 1, count).long().tolist()
    x = torch.stack([torch.cat((val[s:s + context - 2 * n], val[s + context:s + context + n].repeat(2)))
                     for s in starts])
    logits, _ = model(x[:, :-1])
    loss = F.cross_entropy(logits.transpose(1, 2).float(), x[:, 1:], reduction="none")
    first, second = context - 2 * n, context - n  # the copies start at these tokens of x
    return {"copy_length": n, "loss_first_copy": float(loss[:, first:second - 1].mean()),
            "loss_second_copy": float(loss[:, second:].mean())}


def _label(s: dict) -> str:
    return s["format"] if s["policy"] is None else f"{s['policy']} {s['fraction']:g} ({s['format']})"


def report(rows: list[dict], options: Options) -> Report:
    """Tables per model, the issue's format targets, and loss change against bytes per token."""
    summary, lines, verdict = {}, [], {}
    for r in rows:
        if "settings" not in r:  # not measured (a failed run): nothing to report
            continue
        model = r["variant"]
        summary[model] = {k: r[k] for k in ("reference_loss", "reference_bytes_per_token",
                                           "reference_passkey_accuracy", "key_digits", "decoded_positions",
                                           "copy_length", "loss_first_copy", "loss_second_copy")}
        summary[model]["settings"] = r["settings"]
        for s in r["settings"]:
            lines.append([model, s["format"], s["policy"] or "–", f"{s['fraction']:g}", f"{s['kept']:.3f}",
                          s["bytes_per_token"], f"{s['effective_bytes_per_token']:.1f}", f"{100 * s['loss_delta_rel']:+.3f}%",
                          f"{s['top1_agreement']:.4f}", f"{s['passkey_accuracy']:.3f}"])
            if s["policy"] is None and s["format"] in TARGETS:
                bound = TARGETS[s["format"]]
                verdict[f"{model} {s['format']}"] = {"loss_delta_rel": s["loss_delta_rel"], "bound": bound,
                                                     "holds": s["loss_delta_rel"] <= bound}
    plt = pyplot()
    import matplotlib.ticker  # after pyplot(), which picks the Agg backend

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, (model, m) in zip(axes, summary.items()):
        for i, (name, group_) in enumerate(_groups(m["settings"]).items()):
            ax.plot([s["effective_bytes_per_token"] for s in group_], [100 * s["loss_delta_rel"] for s in group_],
                    "o-" if len(group_) > 1 else "s", color=f"C{i}", label=name, ms=5)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 20, 50, 100: no 10^x labels
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("bytes per token and layer (format x kept fraction)")
        ax.set_title(f"{model}: validation loss change against the uncompressed cache")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("relative loss change (%)")
    figures = [save(fig, options.out / "compression.png")]
    header = ["model", "format", "policy", "fraction", "kept (mean)", "bytes/token", "effective bytes/token",
              "loss change", "top-1 agreement", "passkey accuracy"]
    text = "Reference (uncompressed cache): " + "; ".join(
        f"{m}: loss {v['reference_loss']:.4f}, passkey accuracy {v['reference_passkey_accuracy']:.3f} over "
        f"{v['key_digits']} digits, {v['reference_bytes_per_token']} B/token; loss on a {v['copy_length']}-token "
        f"passage {v['loss_first_copy']:.4f}, on its verbatim repeat {v['loss_second_copy']:.4f}"
        for m, v in summary.items()) + "\n\n"
    text += table(header, lines) + "\nTargets (relative loss change of a quantized latent, all tokens kept):\n\n"
    text += "".join(f"- {k}: {100 * v['loss_delta_rel']:+.3f}% against <= {100 * v['bound']:g}%: "
                    f"{'holds' if v['holds'] else 'does not hold'}\n" for k, v in verdict.items())
    return Report({"by_model": summary, "targets": verdict}, text, figures)


def _groups(settings_: list[dict]) -> dict[str, list[dict]]:
    """Points of the frontier plot: one line per (policy, format), the formats alone as one line."""
    out: dict[str, list[dict]] = {"formats, all kept": [s for s in settings_ if s["policy"] is None]}
    for s in settings_:
        if s["policy"] is not None:
            out.setdefault(f"{s['policy']} ({s['format']})", []).append(s)
    for name in out:
        out[name] = sorted(out[name], key=lambda s: s["effective_bytes_per_token"])
    return out


EXPERIMENT = Experiment("compression", "quantized latent caches and eviction on models trained at a 1,024 context",
                        plan, report, measure)

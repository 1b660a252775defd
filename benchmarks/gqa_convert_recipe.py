"""A QK-normed GQA model (Qwen3) trained here, converted to MLA five ways, measured at equal cache bytes.

    python -m benchmarks.gqa_convert_recipe [--threads 1] [--work runs/gqa_convert_recipe]
                                            [--out FILE.json] [--plot FILE.png] [--overwrite] [--quick]

For each source (``--kv-heads``: G = 2 and its G = 1 twin by default), a transformers
``Qwen3ForCausalLM`` (H = 4 query heads of head_dim D = 32, per-head QK RMSNorm) is trained from
scratch on byte tokens (``transformers.ByT5Tokenizer``) of the training plays of the embedded
Shakespeare (``split_by_play``: whole plays held out) and saved under ``--work`` (git-ignored; the
weights are not committed). Then, for each cache budget (the source's cache divided by each of
``--compressions``), these variants are built from it:

(a) source      the model as trained (one row per source, not per budget).
(b) keep_norm   ``qkmla.convert.convert_gqa(keep_norm=True)``: DeepSeek-V3 architecture, qkmla's
                content-mode QK RMSNorm, latent rank r and d_r RoPE dims ("uniform" pairs), chosen so
                that (r + 1) + d_r + G = the budget, d_r = each of ``--rope-shares`` of the budget
                (0.25 and 0.5: two (r, d_r) settings per budget).
(c) drop_norm   the same conversion with ``keep_norm=False`` (what TransMLA and CARE do): same r, d_r,
                G fewer cached values.
(d) full_keys   MHA2MLA's choice: the source Qwen3 with k_proj and v_proj replaced by the same rank-r
                factorization of [W_K ; W_V] (one shared down-projection, the latent of (b)), partial RoPE
                on the same kept pairs of every KV head (the others unrotated), the norm exact; it caches
                the full normalized keys (G D) and the latent for the values (r): a larger cache.
(e) svd_cache   the source unchanged, its cached keys (after k_norm, before RoPE) and values projected
                per layer onto their top principal subspaces (r_K = r_V = budget / 2, centered, from
                calibration activations on training plays) by forward hooks on k_norm and v_proj.

(f) keep_norm_principal  (b) with ``rope_key="principal"`` (for G > 1): each kept RoPE pair's shared key
                is the mix of the groups' rows that best fits every group's key on the calibration
                windows (TransMLA's RoRoPE), in place of their mean; the same cache.
(g) keep_norm_calibrated  (b) with both calibration fits: the latent factorization weighted by the
                calibration windows' attention inputs (``latent="activations"``, activation-aware SVD)
                and, for G > 1, (f)'s RoPE key; the same cache.

Every variant is measured before and after the same healing budget: ``--heal-steps`` steps of AdamW
(constant lr after a short warmup, no weight decay, clip 1.0, the same batches of training-play
windows), once at each of ``--heal-lrs``. The converted DeepSeek models train through qkmla's patched
attention, the Qwen3 variants through their own. The source fine-tuned with the same budget is the
control (a, healed).

Measures, on the same fixed windows of the validation plays (evenly spaced): the mean next-token loss
(nats per byte) and its perplexity, and the greedy-token agreement with the source: teacher-forced,
the fraction of positions whose argmax next token equals the (unhealed) source's on the same window
(not free-running generation). Cache bytes per token are computed from the shapes, float32, summed
over layers (formulas in the results file); for (b) and (c) they are also read from the latent cache
that ``generate`` fills.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

from .common import ROOT, byte_plays, check_counts, check_out, start_recipe

# vocab_size 384: ByT5's 256 bytes + 3 specials (pad 0, eos 1, unk 2) + its 125 extra ids.
SHAPE = {"vocab_size": 384, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
         "num_attention_heads": 4, "head_dim": 32, "max_position_embeddings": 256, "tie_word_embeddings": False}
QUICK_SHAPE = SHAPE | {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 16,
                       "max_position_embeddings": 64}
SPECIAL_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}  # ByT5Tokenizer's
VARIANTS = ("source", "keep_norm", "drop_norm", "full_keys", "svd_cache", "keep_norm_principal",
            "keep_norm_calibrated")
LETTERS = dict(zip(VARIANTS, "abcdefg"))
BYTES = 4  # float32
FORMULAS = {
    "source": "2 G D (keys and values of every KV head)",
    "keep_norm": "(kv_lora_rank + 1) + rope_dim + G (latent with its constant channel, RoPE key, one key scalar "
                 "per KV group)",
    "drop_norm": "(kv_lora_rank + 1) + rope_dim (latent with its constant channel, RoPE key)",
    "full_keys": "G D + kv_lora_rank (the full normalized, partially rotated keys; the latent for the values)",
    "svd_cache": "r_K + r_V (the coordinates of k and v in their principal subspaces)",
    "keep_norm_principal": "as keep_norm (only the RoPE key's rows differ)",
    "keep_norm_calibrated": "as keep_norm (only the latent's and the RoPE key's rows differ)",
}


def cache_values(kind: str, G: int, D: int, rank: int = 0, rope_dim: int = 0, r_k: int = 0, r_v: int = 0) -> int:
    """Values one token caches in one layer (:data:`FORMULAS`)."""
    return {"source": 2 * G * D, "keep_norm": rank + 1 + rope_dim + G,
            "keep_norm_principal": rank + 1 + rope_dim + G, "keep_norm_calibrated": rank + 1 + rope_dim + G,
            "drop_norm": rank + 1 + rope_dim,
            "full_keys": G * D + rank, "svd_cache": r_k + r_v}[kind]


def spaced_windows(ids: torch.Tensor, block: int, count: int) -> torch.Tensor:
    """``count`` windows of ``block`` tokens evenly spaced over ``ids``: [count, block]."""
    starts = torch.linspace(0, ids.numel() - block, count).long()
    return torch.stack([ids[s:s + block] for s in starts.tolist()])


def random_windows(ids: torch.Tensor, block: int, count: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, ids.numel() - block, (count,), generator=g).tolist()
    return torch.stack([ids[s:s + block] for s in starts])


def evaluate(model, rows: torch.Tensor, batch: int, reference: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """Mean next-token loss over ``rows`` [N, T] (N (T - 1) predictions), its perplexity, the accuracy
    against the text, and the teacher-forced agreement of the argmax with ``reference`` [N, T - 1] (the
    source's argmax; None: this model is the reference). Returns (measures, argmax [N, T - 1])."""
    was_training = model.training
    model.eval()
    total, preds = 0.0, []
    with torch.no_grad():
        for chunk in rows.split(batch):
            logits = model(input_ids=chunk, use_cache=False).logits[:, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(),
                                                             reduction="sum"))
            preds.append(logits.argmax(-1))
    model.train(was_training)
    pred = torch.cat(preds)
    loss = total / pred.numel()
    agreement = 1.0 if reference is None else float((pred == reference).float().mean())
    return {"loss": round(loss, 6), "ppl": round(math.exp(loss), 4), "agreement": round(agreement, 6),
            "accuracy": round(float((pred == rows[:, 1:]).float().mean()), 6)}, pred


def train(model, ids: torch.Tensor, *, steps: int, batch: int, block: int, lr: float, warmup: int, cosine: bool,
          weight_decay: float, seed: int, log_every: int) -> dict:
    """A plain loop: AdamW (0.9, 0.95), clip 1.0, linear warmup then constant or cosine to 0.1 x lr;
    batches of random windows of ``ids`` drawn from ``seed`` (the same for every model given the seed)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    g = torch.Generator().manual_seed(seed)
    log, t0 = [], time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * rate(step)
        x = random_windows(ids, block, batch, g)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            log.append({"step": step + 1, "loss": round(float(loss.detach()), 4)})
    model.eval()
    return {"train_loss": log, "wall_s": round(time.perf_counter() - t0, 1)}


def rope_dims(D: int, rope_dim: int, theta: float) -> torch.Tensor:
    """The source dims (j and j + D/2 for each kept pair j) that keep RoPE, as ``convert_gqa`` keeps them."""
    from qkmla.convert.gqa import kept_rope_pairs

    pairs, _ = kept_rope_pairs(D, rope_dim, "uniform", theta)
    return torch.tensor(pairs + [j + D // 2 for j in pairs])


def full_keys_variant(source, rank: int, rope_dim: int):
    """(d): a copy of ``source`` whose k_proj and v_proj share one rank-``rank`` down-projection (the SVD
    of [W_K^0 ; W_V^0 ; W_K^1 ; ...], as ``convert_gqa`` factors it), with RoPE only on the kept pairs of
    every head (a hook on the rotary embedding sets cos = 1, sin = 0 elsewhere). The norm is the source's."""
    model = copy.deepcopy(source)
    c = model.config
    G, D, hidden = c.num_key_value_heads, c.head_dim, c.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            w = torch.cat((a.k_proj.weight.double().view(G, D, hidden), a.v_proj.weight.double().view(G, D, hidden)),
                          dim=1).flatten(0, 1)
            U, S, Vh = torch.linalg.svd(w, full_matrices=False)
            up = (U[:, :rank] * S[:rank]).view(G, 2, D, rank)
            down = torch.nn.Linear(hidden, rank, bias=False)
            down.weight.copy_(Vh[:rank])
            up_k, up_v = torch.nn.Linear(rank, G * D, bias=False), torch.nn.Linear(rank, G * D, bias=False)
            up_k.weight.copy_(up[:, 0].flatten(0, 1))
            up_v.weight.copy_(up[:, 1].flatten(0, 1))
            a.k_proj, a.v_proj = torch.nn.Sequential(down, up_k), torch.nn.Sequential(down, up_v)
    from qkmla.convert.gqa import rope_theta_of

    unrotated = torch.ones(D, dtype=torch.bool)
    unrotated[rope_dims(D, rope_dim, rope_theta_of(c))] = False

    def partial_rope(module, inputs, output):
        cos, sin = output
        return cos.masked_fill(unrotated, 1.0), sin.masked_fill(unrotated, 0.0)

    model.model.rotary_emb.register_forward_hook(partial_rope)
    return model.float()


def principal_subspace(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(mean [n], P [n, rank], the fraction of the centered variance kept) of rows x [N, n], in float64."""
    x = x.double()
    mean = x.mean(0)
    evals, evecs = torch.linalg.eigh((x - mean).T @ (x - mean))
    kept = float(evals[-rank:].sum() / evals.sum())
    return mean, evecs[:, -rank:].flip(-1), kept


def svd_cache_variant(source, calibration: torch.Tensor, batch: int, r_k: int, r_v: int):
    """(e): a copy of ``source`` whose keys (k_norm's output, before RoPE) and values (v_proj's output)
    are replaced by mean + P P^T (x - mean), P the top r_K (r_V) principal directions of that layer's
    G D-wide keys (values) on ``calibration`` windows: what caching the r_K + r_V coordinates gives.
    Returns (model, the variance kept per layer)."""
    model = copy.deepcopy(source).eval()
    seen: dict = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for name in ("k_norm", "v_proj"):
            def grab(module, inputs, output, key=(i, name)):
                seen.setdefault(key, []).append(output.detach().flatten(2) if output.dim() == 4 else output.detach())
            handles.append(getattr(layer.self_attn, name).register_forward_hook(grab))
    with torch.no_grad():
        for chunk in calibration.split(batch):
            model(input_ids=chunk, use_cache=False)
    for h in handles:
        h.remove()
    kept = []
    for i, layer in enumerate(model.model.layers):
        row = {}
        for name, rank in (("k_norm", r_k), ("v_proj", r_v)):
            x = torch.cat(seen[(i, name)]).flatten(0, 1)
            mean, P, frac = principal_subspace(x, rank)
            row["keys" if name == "k_norm" else "values"] = round(frac, 6)
            mean, P = mean.float(), P.float()

            def project(module, inputs, output, mean=mean, P=P):
                flat = output.flatten(-2) if output.dim() == 4 else output
                y = mean + ((flat - mean) @ P) @ P.T
                return y.view_as(output)
            getattr(layer.self_attn, name).register_forward_hook(project)
        kept.append(row)
    return model, kept


def latent_cache_bytes(model, prompt: torch.Tensor) -> int:
    """Bytes per token that ``generate``'s latent cache holds, summed over layers."""
    with torch.inference_mode():
        gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    return sum(layer.bytes_per_token for layer in gen.past_key_values.layers)


def budget_settings(G: int, D: int, budget: int, rope_share: float) -> dict:
    """(b)-(e)'s settings for a cache budget of ``budget`` values per token and layer, about
    ``rope_share`` of it (even, at most D) for the RoPE key of (b)-(d)."""
    rope_dim = min(D, max(2, 2 * round(budget * rope_share / 2)))
    while (D // 2) % (rope_dim // 2):  # "uniform" pairs: rope_dim / 2 must divide D / 2
        rope_dim -= 2
    return {"kv_lora_rank": budget - rope_dim - G - 1, "rope_dim": rope_dim, "r_k": budget // 2,
            "r_v": budget - budget // 2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "gqa_convert_recipe",
                   help="where the source checkpoints go (source-G2/, ...; not committed)")
    p.add_argument("--out", type=Path, default=None, help="the results JSON (default: printed)")
    p.add_argument("--plot", type=Path, default=None, help="a PNG of loss against cache bytes per token")
    p.add_argument("--overwrite", action="store_true", help="replace --out, --plot and this script's directories")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's); 1 on a shared machine")
    p.add_argument("--quick", action="store_true", help="a tiny model and a few steps (seconds): a smoke test")
    p.add_argument("--kv-heads", type=int, nargs="+", default=[2, 1], help="G of each source (H = 4 query heads)")
    p.add_argument("--compressions", type=int, nargs="+", default=[2, 4],
                   help="cache budgets: the source's cache bytes divided by each")
    p.add_argument("--rope-shares", type=float, nargs="+", default=[0.25, 0.5],
                   help="the fractions of each budget given to the RoPE key in (b)-(d): one setting each")
    p.add_argument("--block", type=int, default=256, help="tokens per training and validation window")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--source-steps", type=int, default=400)
    p.add_argument("--source-lr", type=float, default=3e-3)
    p.add_argument("--heal-steps", type=int, default=50)
    p.add_argument("--heal-lrs", type=float, nargs="+", default=[3e-4, 1e-3])
    p.add_argument("--val-windows", type=int, default=48)
    p.add_argument("--calibration-windows", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.block, args.batch, args.source_steps, args.heal_steps = 64, 4, 20, 4
        args.val_windows, args.calibration_windows = 4, 2
    check_counts(p, args, ("block", "batch", "source_steps", "heal_steps", "val_windows", "calibration_windows"))
    if min(args.heal_lrs) <= 0:
        p.error(f"--heal-lrs: expected positive learning rates, got {args.heal_lrs}")
    shape = dict(QUICK_SHAPE if args.quick else SHAPE)
    H, D = shape["num_attention_heads"], shape["head_dim"]
    if any(G < 1 or H % G for G in args.kv_heads):
        p.error(f"--kv-heads: each must divide the {H} query heads, got {args.kv_heads}")
    if not all(0 < x < 1 for x in args.rope_shares):
        p.error(f"--rope-shares: expected fractions between 0 and 1, got {args.rope_shares}")
    settings = {}
    for G in args.kv_heads:
        for f in args.compressions:
            for share in args.rope_shares:
                budget = 2 * G * D // f if f >= 2 else 0
                s = budget_settings(G, D, budget, share) if budget else {}
                if not s or not 1 <= s["kv_lora_rank"] <= min(2 * G * D, shape["hidden_size"]) or 2 * G * D % f:
                    p.error(f"--compressions: {f} leaves no valid setting for G = {G}, D = {D}, RoPE share {share} "
                            f"(budget {2 * G * D / max(f, 1):g} values: needs (r + 1) + d_r + G with r >= 1)")
                settings[(G, f, share)] = s | {"budget_values": budget}
    if args.block > shape["max_position_embeddings"]:
        p.error(f"--block: at most max_position_embeddings={shape['max_position_embeddings']}, got {args.block}")
    check_out(p, args.plot, args.overwrite, "--plot")
    dirs = {G: args.work / f"source-G{G}" for G in args.kv_heads}
    result, write = start_recipe(p, args, __spec__.name, argv, dirs.values())

    from transformers import ByT5Tokenizer, Qwen3Config, Qwen3ForCausalLM

    from qkmla.utils.files import write_atomically
    from qkmla.convert import convert_gqa
    from qkmla.train.data import VALIDATION_PLAYS

    tokenizer = ByT5Tokenizer()
    train_ids, val_ids = byte_plays(tokenizer)
    val_rows = spaced_windows(val_ids, args.block, args.val_windows)
    calibration_rows = random_windows(train_ids, args.block, args.calibration_windows,
                                      torch.Generator().manual_seed(args.seed + 1))
    prompt = torch.tensor([tokenizer("ROMEO:", add_special_tokens=False)["input_ids"]])
    eval_batch = min(8, args.val_windows)
    heal_seed = args.seed + 2  # other windows than the sources saw
    heal_warmup = max(1, args.heal_steps // 10)
    result["data"] = {"corpus": "shakespeare (embedded), split by play", "tokenizer": "transformers.ByT5Tokenizer",
                      "train_tokens": train_ids.numel(), "val_plays": list(VALIDATION_PLAYS),
                      "val_play_tokens": val_ids.numel(), "val_windows": list(val_rows.shape),
                      "calibration_windows": list(calibration_rows.shape),
                      "calibration_source": "training plays, random windows (for (e)'s subspaces, (f)'s and (g)'s "
                                            "fits, and (b)'s measured RoPE key energy)"}
    result["measures"] = {
        "loss": "mean next-token cross-entropy, nats per byte, over every position of the validation windows",
        "ppl": "exp(loss)",
        "agreement": "teacher-forced greedy agreement: the fraction of validation positions whose argmax next token "
                     "equals the unhealed source's argmax on the same window (not free-running generation)",
        "accuracy": "the fraction of validation positions whose argmax is the text's next byte",
        "cache_bytes_per_token": f"cache values per token and layer x {BYTES} (float32) x layers",
        "cache_values_per_token_per_layer": FORMULAS}
    result["healing"] = {"steps": args.heal_steps, "batch": args.batch, "block": args.block,
                         "tokens": args.heal_steps * args.batch * args.block, "lrs": args.heal_lrs,
                         "warmup_steps": heal_warmup, "schedule": "linear warmup, then constant",
                         "optimizer": "AdamW (0.9, 0.95), no weight decay, clip 1.0", "seed": heal_seed,
                         "batches": "the same random training-play windows for every variant"}
    result["sources"], result["variants"] = {}, []
    L = shape["num_hidden_layers"]

    def heal_all(make, row: dict, reference: torch.Tensor) -> None:
        row["healed"] = {}
        for lr in args.heal_lrs:
            model = make()
            run = train(model, train_ids, steps=args.heal_steps, batch=args.batch, block=args.block, lr=lr,
                        warmup=heal_warmup, cosine=False, weight_decay=0.0, seed=heal_seed,
                        log_every=max(1, args.heal_steps // 4))
            measured, _ = evaluate(model, val_rows, eval_batch, reference)
            row["healed"][f"{lr:g}"] = measured | run
            del model

    for G in args.kv_heads:
        tag = f"G{G}"
        config = Qwen3Config(**shape, num_key_value_heads=G, **SPECIAL_IDS, attn_implementation="sdpa")
        torch.manual_seed(args.seed)
        source = Qwen3ForCausalLM(config)
        training = train(source, train_ids, steps=args.source_steps, batch=args.batch, block=args.block,
                         lr=args.source_lr, warmup=max(1, args.source_steps // 20), cosine=True, weight_decay=0.1,
                         seed=args.seed, log_every=max(1, args.source_steps // 10))
        source.save_pretrained(dirs[G])
        tokenizer.save_pretrained(dirs[G])
        source_state = {k: v.clone() for k, v in source.state_dict().items()}
        measured, reference = evaluate(source, val_rows, eval_batch, None)
        values = cache_values("source", G, D)
        result["sources"][tag] = {
            "config": shape | {"num_key_value_heads": G}, "params": sum(t.numel() for t in source.parameters()),
            "training": {"steps": args.source_steps, "batch": args.batch, "block": args.block,
                         "tokens": args.source_steps * args.batch * args.block, "lr": args.source_lr,
                         "schedule": "linear warmup (5%), cosine to 0.1 x lr",
                         "optimizer": "AdamW (0.9, 0.95), weight decay 0.1, clip 1.0"} | training}
        row = {"source": tag, "variant": "source", "letter": "a", "G": G, "compression": 1, "rope_share": None, "settings": {},
               "cache_values_per_token_per_layer": values, "cache_bytes_per_token": values * BYTES * L,
               "before": measured}

        def fresh_source():
            source.load_state_dict(source_state)
            return source
        heal_all(fresh_source, row, reference)
        source.load_state_dict(source_state)
        result["variants"].append(row)
        write()

        # The full-rank, every-pair conversion: exact for G = 1, the shared RoPE key's error alone for G > 1
        # (with the mean of the groups' RoPE rows, and with the principal mix for G > 1).
        for rope_key in ("mean", "principal") if G > 1 else ("mean",):
            converted, report = convert_gqa(source, keep_norm=True, rope_key=rope_key, calibration=calibration_rows)
            measured, _ = evaluate(converted, val_rows, eval_batch, reference)
            values = cache_values("keep_norm", G, D, report.rank, report.rope_dim)
            result["sources"][tag]["full_rank_conversion" + ("" if rope_key == "mean" else "_principal")] = {
                "kv_lora_rank": report.rank, "rope_dim": report.rope_dim, "rope_key": rope_key,
                "rope_key_energy_per_layer": report.rope_key_energy, "cache_values_per_token_per_layer": values,
                "cache_bytes_per_token": values * BYTES * L, "latent_cache_bytes_per_token":
                latent_cache_bytes(converted, prompt), "not_healed": measured, "report": report.lines()}
            del converted
            write()

        for f, share, kind in [(f, share, kind) for f in args.compressions for share in args.rope_shares
                               for kind in VARIANTS[1:] if (kind != "svd_cache" or share == args.rope_shares[0])
                               and (kind != "keep_norm_principal" or G > 1)]:
            s = settings[(G, f, share)]
            r, d_r = s["kv_lora_rank"], s["rope_dim"]
            row = {"source": tag, "variant": kind, "letter": LETTERS[kind], "G": G, "compression": f,
                   "rope_share": None if kind == "svd_cache" else share,
                   "budget_values_per_token_per_layer": s["budget_values"]}
            if kind in ("keep_norm", "drop_norm", "keep_norm_principal", "keep_norm_calibrated"):
                principal = kind == "keep_norm_principal" or (kind == "keep_norm_calibrated" and G > 1)
                options = dict(kv_lora_rank=r, rope_dim=d_r, keep_norm=kind != "drop_norm",
                               rope_key="principal" if principal else "mean",
                               latent="activations" if kind == "keep_norm_calibrated" else "weights",
                               calibration=calibration_rows)

                def make(options=options):
                    model, _ = convert_gqa(source, **options)
                    return model
                model, report = convert_gqa(source, **options)
                row["settings"] = {"kv_lora_rank": r, "rope_dim": d_r, "rope_pairs": "uniform",
                                   "cached_latent": report.kv_lora_rank, "rope_key": options["rope_key"],
                                   "latent": options["latent"],
                                   "rope_key_energy_per_layer": report.rope_key_energy}
                row["report"] = report.lines()
                values = cache_values(kind, G, D, r, d_r)
                assert sum(report.cache_values_per_token()) == values, (report.cache_values_per_token(), values)
                row["latent_cache_bytes_per_token"] = latent_cache_bytes(model, prompt)
            elif kind == "full_keys":
                def make():
                    return full_keys_variant(source, r, d_r)
                model = make()
                row["settings"] = {"kv_lora_rank": r, "rope_dim": d_r, "rope_pairs": "uniform"}
                values = cache_values(kind, G, D, r, d_r)
            else:
                def make():
                    return svd_cache_variant(source, calibration_rows, eval_batch, s["r_k"], s["r_v"])[0]
                model, kept = svd_cache_variant(source, calibration_rows, eval_batch, s["r_k"], s["r_v"])
                row["settings"] = {"r_k": s["r_k"], "r_v": s["r_v"], "centered": True,
                                   "variance_kept_per_layer": kept}
                values = cache_values(kind, G, D, r_k=s["r_k"], r_v=s["r_v"])
            row["cache_values_per_token_per_layer"] = values
            row["cache_bytes_per_token"] = values * BYTES * L
            row["before"], _ = evaluate(model, val_rows, eval_batch, reference)
            del model
            heal_all(make, row, reference)
            result["variants"].append(row)
            write()
        del source, source_state

    result["table"] = [
        {"source": v["source"], "variant": f"({v['letter']}) {v['variant']}", "compression": v["compression"],
         "settings": {k: x for k, x in v["settings"].items() if k in ("kv_lora_rank", "rope_dim", "r_k", "r_v")},
         "cache_bytes_per_token": v["cache_bytes_per_token"], "loss_before": v["before"]["loss"],
         "agreement_before": v["before"]["agreement"]}
        | {f"loss_healed_lr{lr}": h["loss"] for lr, h in v["healed"].items()}
        | {f"agreement_healed_lr{lr}": h["agreement"] for lr, h in v["healed"].items()}
        for v in result["variants"]]
    if args.plot is not None:
        plot(result, args.plot, write_atomically)
        result["plot"] = args.plot.name
    result["status"] = "done"
    write()
    if args.out is None:
        print(json.dumps(result, indent=1))
    else:
        for row in result["table"]:
            print(json.dumps(row))
    return 0


def plot(result: dict, path: Path, write_atomically) -> None:
    """Validation loss against cache bytes per token: hollow before healing, filled after (the lower
    loss of the learning rates), one panel per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = list(result["sources"])
    fig, axes = plt.subplots(1, len(tags), figsize=(5.5 * len(tags), 4.2), squeeze=False)
    colors = dict(zip(VARIANTS, ("black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                                 "tab:brown")))
    for ax, tag in zip(axes[0], tags):
        for kind in VARIANTS:
            rows = [v for v in result["variants"] if v["source"] == tag and v["variant"] == kind]
            if not rows:
                continue
            x = [v["cache_bytes_per_token"] for v in rows]
            ax.scatter(x, [v["before"]["loss"] for v in rows], facecolors="none", edgecolors=colors[kind], s=50)
            ax.scatter(x, [min(h["loss"] for h in v["healed"].values()) for v in rows], color=colors[kind], s=50,
                       label=f"({LETTERS[kind]}) {kind}")
        ax.set_xlabel("cache bytes per token (float32, all layers)")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"Qwen3 source {tag}: hollow before, filled after healing")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

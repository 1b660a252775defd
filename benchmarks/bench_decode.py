"""One decode step of one MLA layer at long context: what the QK-norm scalar cache costs.

Variants (all QK-normed ones use blockwise RMS):

    full-key-qknorm      cache of normalized full keys and values, SDPA over them (the naive cache)
    expand-qknorm        latent cache, every key re-expanded with W_UK each step (HF-style)
    absorbed-mla         plain MLA, absorbed (the baseline every ratio is taken against)
    absorbed-mla-qknorm  QK-normed MLA, absorbed, latent cache + one scalar per token and group

A step is ``MLA.forward`` on one new token: projections, cache write, attention over the
context, W_UV and o_proj. The context-dependent part alone is also timed (core-*): for the
absorbed paths ``latent_attention``, for the expand path the re-expansion of every cached
latent plus SDPA over the keys. At short contexts the projections' weights dominate a step
and would hide any overhead in the core.

Timing: every variant runs once per round, rounds interleave the variants (so drift hits all
alike), and the median over rounds is reported. The cache is filled with random rows, and
its lengths are restored after every step so each step sees the same context.

    python benchmarks/bench_decode.py [--quick] [--preset deepseek-v3-tp8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qkmla import MLA, FullKVCache, LatentCache, mla_preset
from qkmla.attention.functional import sdpa
from qkmla.machine import machine
from qkmla.ops.mla_decode.torch_impl import latent_attention

HERE = Path(__file__).resolve().parent
VARIANTS = ("full-key-qknorm", "expand-qknorm", "absorbed-mla", "absorbed-mla-qknorm",
            "core-expand-qknorm", "core-mla", "core-mla-qknorm")


def filled(cache, context: int, rows: dict):
    """Append ``context`` random tokens, as a prefill would, without running the model."""
    cache.write_rows(cache.plan(cache.batch_size, context), rows)
    return cache


def setup(preset: str, context: int, dtype: torch.dtype, device: str, batch: int = 1):
    """Modules and caches for every variant at one context length."""
    torch.manual_seed(0)
    cfg = mla_preset(preset)
    qk = MLA(cfg).to(device=device, dtype=dtype).eval()
    plain = MLA(cfg.replace(qk_norm=None)).to(device=device, dtype=dtype).eval()
    # Plain MLA reads the QK-normed layer's own projection weights (the same tensors), and
    # its cache's latent rows are the same buffer: the step ratio then measures the
    # attention arithmetic, not where the allocator placed 140 MB of weights (two separately
    # allocated pairs differ by up to ±3% on the 2-core CPU VM from placement alone).
    plain.load_state_dict(qk.state_dict(), strict=False, assign=True)
    capacity, B = context + 1, batch
    d_c, d_r, G = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_kv_groups
    latent = torch.randn(B, context, d_c + d_r, dtype=dtype, device=device)
    key_scale = torch.rand(B, context, G, dtype=dtype, device=device) + 0.5
    kw = dict(dtype=dtype, device=device)
    caches = {
        "full-key-qknorm": filled(FullKVCache.from_config(cfg, B, capacity, **kw), context, {
            "k": torch.randn(B, context, G * cfg.qk_head_dim, dtype=dtype, device=device),
            "v": torch.randn(B, context, G * cfg.v_head_dim, dtype=dtype, device=device)}),
        "expand-qknorm": filled(LatentCache.from_config(cfg, B, capacity, **kw), context,
                                {"latent": latent, "key_scale": key_scale}),
        "absorbed-mla": filled(LatentCache.from_config(plain.config, B, capacity, **kw), context, {"latent": latent}),
    }
    caches["absorbed-mla-qknorm"] = caches["expand-qknorm"]  # same cache object, different path
    # The same latent rows for plain MLA. Each step writes its new row at slot `context`
    # before reading it, and the rows before it are never written, so sharing is safe.
    caches["absorbed-mla"].fields["latent"].data = caches["expand-qknorm"].fields["latent"].data
    x = torch.randn(B, 1, cfg.hidden_size, dtype=dtype, device=device)
    q_lat = torch.randn(B, 1, cfg.num_heads, d_c, dtype=dtype, device=device)
    q_rope = torch.randn(B, 1, cfg.num_heads, d_r, dtype=dtype, device=device)
    q_full = torch.randn(B, 1, cfg.num_heads, cfg.qk_head_dim, dtype=dtype, device=device)

    def step(module, cache, path="auto"):
        saved = cache.bookkeeping()

        def run():
            module(x, cache, path=path)
            cache.restore(saved)  # keep the context fixed
        return run

    lat = caches["expand-qknorm"].fields["latent"].read(context)
    scal = caches["expand-qknorm"].fields["key_scale"].read(context)
    fns = {
        "full-key-qknorm": step(qk, caches["full-key-qknorm"]),
        "expand-qknorm": step(qk, caches["expand-qknorm"], "expand"),
        "absorbed-mla": step(plain, caches["absorbed-mla"], "absorbed"),
        "absorbed-mla-qknorm": step(qk, caches["absorbed-mla-qknorm"], "absorbed"),
        "core-expand-qknorm": lambda: sdpa(q_full, *qk.expand_cache(lat, scal), cfg.scale),
        "core-mla": lambda: latent_attention(q_lat, q_rope, lat, None, cfg.scale),
        "core-mla-qknorm": lambda: latent_attention(q_lat, q_rope, lat, scal, cfg.scale),
    }
    assert all(p.data_ptr() == qk.get_parameter(n).data_ptr() for n, p in plain.named_parameters())
    for name in ("full-key-qknorm", "expand-qknorm", "absorbed-mla"):
        c = caches[name]
        assert c.nbytes == c.bytes_per_token * c.capacity * c.batch_size  # measured allocation == formula
    cache_of = {**caches, "core-mla": caches["absorbed-mla"], "core-mla-qknorm": caches["absorbed-mla-qknorm"],
                "core-expand-qknorm": caches["expand-qknorm"]}
    cache_bytes = {name: cache_of[name].bytes_per_token * context * batch for name in VARIANTS}
    return fns, cache_bytes


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_side_by_side(fns: dict, rounds: int, device: str, budget_s: float) -> tuple[dict, dict]:
    """Median seconds per call, variants interleaved round by round, and each round's median.

    In every round each variant gets one untimed call first (a variant that follows one
    that freed hundreds of MB would otherwise pay for page faults and cold caches), then
    a few timed calls: as many as fit in ~100 ms, at least one. A slow variant stops after
    3 rounds once it has spent ``budget_s``. The per-round medians let a ratio be taken
    round by round, between calls made seconds apart, which shows how much of a ratio is
    the machine's drift.
    """
    samples = {name: [] for name in fns}
    per_round = {name: [] for name in fns}
    per_call = {}
    with torch.inference_mode():
        for name, fn in fns.items():  # warm-up, and a first estimate of the cost
            fn()
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            per_call[name] = time.perf_counter() - t0
        for r in range(rounds):
            for name, fn in fns.items():
                if r >= 3 and sum(samples[name]) > budget_s:
                    continue
                fn()
                this_round = []
                for _ in range(max(1, min(50, int(0.1 / per_call[name])))):
                    sync(device)
                    t0 = time.perf_counter()
                    fn()
                    sync(device)
                    this_round.append(time.perf_counter() - t0)
                samples[name] += this_round
                per_round[name].append(statistics.median(this_round))
    return {name: statistics.median(s) for name, s in samples.items()}, per_round


def round_ratios(per_round: dict, a: str, b: str) -> list[float]:
    """[25th, 50th, 75th] percentiles of a's time over b's, round by round."""
    ratios = [x / y for x, y in zip(per_round[a], per_round[b], strict=True)]
    return [float(q) for q in statistics.quantiles(ratios, n=4, method="inclusive")] if len(ratios) > 1 else ratios * 3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="contexts 1k and 4k, few rounds (a smoke run)")
    p.add_argument("--preset", default="deepseek-v3-tp8")
    p.add_argument("--contexts", type=int, nargs="*", help="context lengths (default 1k..32k)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/results/bench_decode_<device>.json)")
    args = p.parse_args(argv)
    contexts = args.contexts or ([1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768])
    rounds = args.rounds or (5 if args.quick else 21)
    dtype = getattr(torch, args.dtype)
    info = machine()
    print(f"# {info['cpu']} ({info['cores']} cores, {info['torch_threads']} torch threads)"
          f"{', ' + info['gpu'] if 'gpu' in info else ''}, torch {info['torch']}, {args.preset}, {args.dtype}, "
          f"batch {args.batch}")
    print(f"{'context':>8} {'variant':<21}{'seconds':>12}{'cache bytes':>14}{'ratio to mla':>14}")
    rows, spread = [], {"step": {}, "core": {}}
    for context in contexts:
        fns, cache_bytes = setup(args.preset, context, dtype, args.device, args.batch)
        seconds, per_round = time_side_by_side(fns, rounds, args.device, budget_s=20.0)
        spread["step"][context] = round_ratios(per_round, "absorbed-mla-qknorm", "absorbed-mla")
        spread["core"][context] = round_ratios(per_round, "core-mla-qknorm", "core-mla")
        for name in VARIANTS:
            base = "core-mla" if name.startswith("core") else "absorbed-mla"  # like against like
            row = {"context": context, "variant": name, "seconds": seconds[name], "cache_bytes": cache_bytes[name],
                   "ratio_to_mla": seconds[name] / seconds[base]}
            rows.append(row)
            print(f"{context:>8} {name:<21}{row['seconds']:>12.6f}{row['cache_bytes']:>14,}{row['ratio_to_mla']:>14.3f}")
        del fns

    def ratio(ctx, a, b):
        by = {(r["context"], r["variant"]): r["seconds"] for r in rows}
        return by[(ctx, a)] / by[(ctx, b)]

    summary = {
        "qknorm_over_mla_step": {c: ratio(c, "absorbed-mla-qknorm", "absorbed-mla") for c in contexts},
        "qknorm_over_mla_core": {c: ratio(c, "core-mla-qknorm", "core-mla") for c in contexts},
        # The same ratios taken round by round: [25th, 50th, 75th] percentiles over rounds.
        "qknorm_over_mla_step_per_round_quartiles": spread["step"],
        "qknorm_over_mla_core_per_round_quartiles": spread["core"],
        "expand_over_absorbed_qknorm_step": {c: ratio(c, "expand-qknorm", "absorbed-mla-qknorm") for c in contexts},
        "expand_over_absorbed_qknorm_core": {c: ratio(c, "core-expand-qknorm", "core-mla-qknorm") for c in contexts},
        "full_key_cache_over_qknorm_latent_cache": rows[0]["cache_bytes"] / next(
            r["cache_bytes"] for r in rows if r["variant"] == "absorbed-mla-qknorm"),
    }
    print("QK-norm / plain MLA, decode step:", {c: round(v, 3) for c, v in summary["qknorm_over_mla_step"].items()})
    print("QK-norm / plain MLA, attention core:", {c: round(v, 3) for c, v in summary["qknorm_over_mla_core"].items()})
    for part in ("step", "core"):
        print(f"  {part}, round by round (25th/50th/75th percentile):",
              {c: "/".join(f"{v:.3f}" for v in q) for c, q in spread[part].items()})
    print("re-expanding keys / absorbed QK-norm, step:",
          {c: round(v, 1) for c, v in summary["expand_over_absorbed_qknorm_step"].items()})
    print("re-expanding keys / absorbed QK-norm, core:",
          {c: round(v, 1) for c, v in summary["expand_over_absorbed_qknorm_core"].items()})
    print(f"full-key cache / QK-normed latent cache bytes: {summary['full_key_cache_over_qknorm_latent_cache']:.2f}x")
    suffix = ("_quick" if args.quick else "") + (f"_batch{args.batch}" if args.batch != 1 else "")
    out = args.out or HERE / "results" / f"bench_decode_{args.device}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/bench_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps({"command": command.strip(), "machine": info, "preset": args.preset,
                               "dtype": args.dtype, "device": args.device, "batch": args.batch, "rounds": rounds,
                               "rows": rows, "summary": summary}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One decode step of one MLA layer at DeepSeek-V3 TP=8 widths, 1k to 32k tokens of context (CPU or GPU).

    python -m benchmarks.bench_decode [--contexts 1024 ... 32768] [--threads N] [--out FILE.json] [--overwrite]

Rows, timed side by side: every round calls each row in turn, ``ms`` is a row's median call, and
a ratio is the median over rounds of that round's ratio, so a burst of other work on the
machine, which hits neighbouring rows alike, moves it little:

    mla                    plain MLA, the absorbed step: MLA.forward on one token over a LatentCache
    mla-qknorm             QK-normed MLA (blockwise RMS), the same step; its cache adds one scalar per token and group
    mla-compiled           mla through torch.compile(mla_decode_step, fullgraph=True) (gpt-fast's decode_one_token)
    mla-qknorm-compiled    mla-qknorm, the same way
    expand-qknorm          the re-expanding baseline: every cached latent through W_UK and W_UV at every step
    transformers           transformers' DeepseekV3Attention over its own DynamicCache (when transformers is
                           installed): the layer the plain MLA rows were copied from (mla_from_hf)

Each row records its cache bytes per token; ``full_key_cache_bytes_per_token`` is what caching
the normalized full keys and values instead would take. Plain and QK-normed MLA hold the same
projection weights, so their ratio is what the key scalars cost. One cache per row is filled
once with random rows to the longest context; a shorter context is the same cache with shorter
lengths, so the compiled step compiles once and every context reads the same rows. The
compiled rows' largest difference to the eager step is recorded (``compile``).

``--batch B --paged BLOCK``: B sequences over a paged cache (blocks of BLOCK tokens, shuffled
block table), the layout a serving engine's cache has; only the two eager rows run (mla and
mla-qknorm: the compiled step and transformers' layer read contiguous caches).

On a machine other jobs share, ``--threads 1``: torch's default of one thread per core stalls
whenever another process holds a core, and the load average is recorded at the start and end.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from qkmla import MLA, FullKVCache, LatentCache, mla_preset
from qkmla.cache.storage import PagedLayout
from qkmla.attention.decode import decode_one_token, mla_decode_step

from .common import start_record, torch_threads

HERE = Path(__file__).resolve().parent
CONTEXTS = (1024, 4096, 16384, 32768)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_attention(cfg, dtype, device):
    """transformers' DeepseekV3Attention at ``cfg``'s widths (random weights), or None without transformers."""
    try:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    except ImportError:
        return None
    hf_cfg = DeepseekV3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                              num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
                              kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                              max_position_embeddings=2 * CONTEXTS[-1], attn_implementation="sdpa")
    layer = DeepseekV3Attention(hf_cfg, layer_idx=0).to(device=device, dtype=dtype).eval()
    return layer, DeepseekV3RotaryEmbedding(hf_cfg).to(device)


def hf_step(layer, rotary, rows: tuple, context: int, device: str):
    """One transformers decode step over a DynamicCache holding ``context`` tokens of ``rows`` (what the
    layer stores per token: the latent and RoPE key from 5.15 on), cropped back after every call."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(rows[0][:, :, :context], rows[1][:, :, :context], 0)
    x = torch.randn(1, 1, layer.hidden_size, device=device, dtype=rows[0].dtype)
    cos_sin = rotary(x, torch.tensor([[context]], device=device))
    name = "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"  # 5.24 renamed it

    def call():
        layer(x, position_embeddings=cos_sin, attention_mask=None, **{name: cache})
        cache.crop(-1)  # n < 0 removes the newest token in every supported transformers version
    return call


def hf_rows(layer, rotary, longest: int, device: str) -> tuple:
    """Random rows shaped as ``layer`` caches them (found by caching one token), ``longest`` tokens."""
    from transformers import DynamicCache

    cache = DynamicCache()
    x = torch.randn(1, 1, layer.hidden_size, device=device, dtype=layer.o_proj.weight.dtype)
    name = "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"
    with torch.inference_mode():
        layer(x, position_embeddings=rotary(x, torch.zeros(1, 1, dtype=torch.long, device=device)),
              attention_mask=None, **{name: cache})
    keys, values = cache.layers[0].keys, cache.layers[0].values
    return tuple(torch.randn(*t.shape[:2], longest, t.shape[3], device=device, dtype=t.dtype) for t in (keys, values))


def time_rows(fns: dict, rounds: int, device: str, budget_s: float = 2.0) -> dict:
    """Each row's calls, round by round: {row: [[seconds, ...] per round]}. Rows take turns, so a
    burst of other work on the machine hits neighbours alike. In each round a row gets an
    untimed call, then as many timed calls as fit in about 30 ms (at least one). A row slower
    than 0.1 s a call skips the untimed call and stops once it has 3 samples and ``budget_s``."""
    samples = {name: [] for name in fns}

    def timed(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    with torch.inference_mode():
        per_call = {}
        for name, fn in fns.items():
            fn()
            per_call[name] = timed(fn)
        for _ in range(rounds):
            for name, fn in fns.items():
                if sum(len(r) for r in samples[name]) >= 3 and sum(map(sum, samples[name])) > budget_s:
                    continue
                if per_call[name] < 0.1:  # the row before may have left the caches cold or freed a lot of memory
                    fn()
                samples[name].append([timed(fn) for _ in range(max(1, min(20, int(0.03 / per_call[name]))))])
    return samples


def ratio(per_round: dict, a: str, b: str) -> float:
    """a's time over b's: the median over rounds of each round's ratio of medians (rounds both ran)."""
    return statistics.median(statistics.median(x) / statistics.median(y) for x, y in zip(per_round[a], per_round[b]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3-tp8", help="MLA widths (qkmla cache-size --help lists presets)")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's, one per core)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--paged", type=int, default=0, metavar="BLOCK",
                   help="a paged cache with blocks of BLOCK tokens (default 0: contiguous)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: a fast smoke run)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default results/bench_decode_<device>.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    if any(c < 1 for c in args.contexts):
        p.error(f"--contexts: expected ints >= 1, got {args.contexts}")
    if args.rounds < 1:
        p.error(f"--rounds: expected an int >= 1, got {args.rounds}")
    if args.batch < 1:
        p.error(f"--batch: expected an int >= 1, got {args.batch}")
    if args.paged < 0:
        p.error(f"--paged: expected a block size >= 1, or 0 for a contiguous cache, got {args.paged}")
    if args.threads < 0:
        p.error(f"--threads: expected an int >= 0 (0: torch's default), got {args.threads}")
    args.out = args.out or HERE / "results" / f"bench_decode_{args.device}.json"
    with torch_threads(args.threads):
        result, write = start_record(p, args, __spec__.name, argv, load_at_start=True)
        run(args, result)
        write()
    return 0


def run(args, result: dict) -> None:
    """Time every row at every context into ``result`` (the results record)."""
    contexts, dtype, device = sorted(set(args.contexts)), getattr(torch, args.dtype), args.device
    load_at_start = os.getloadavg()[0]

    torch.manual_seed(0)
    cfg = mla_preset(args.preset)
    B, paged = args.batch, args.paged
    eager_only = paged > 0 or B > 1
    hf = None if eager_only else hf_attention(cfg, dtype, device)
    if hf is not None:  # plain MLA is transformers' layer, copied
        from qkmla.integrations.hub import mla_from_hf
        plain = mla_from_hf(hf[0]).to(device=device, dtype=dtype).eval()
    else:
        plain = MLA(cfg.replace(qk_norm=None)).to(device=device, dtype=dtype).eval()
    qk = MLA(plain.config.replace(qk_norm="rms")).to(device=device, dtype=dtype).eval()
    qk.load_state_dict(plain.state_dict(), strict=False, assign=True)  # the same projection tensors
    cfg = qk.config
    longest = contexts[-1]
    d_c, d_r, G = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_kv_groups
    rows = {"latent": torch.randn(B, longest, d_c + d_r, device=device, dtype=dtype),
            "key_scale": torch.rand(B, longest, G, device=device, dtype=dtype) + 0.5}

    def layout() -> dict:
        if not paged:
            return {}
        per_seq = -(-(longest + 1) // paged)
        table = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(0)).view(B, per_seq)
        return {"layout": PagedLayout(block_size=paged, block_table=table.to(device))}

    caches = {}
    names = (("mla", plain), ("mla-qknorm", qk)) + (() if eager_only else (("mla-compiled", plain),
                                                                          ("mla-qknorm-compiled", qk)))
    for name, module in names:
        caches[name] = LatentCache.from_config(module.config, B, longest + 1, dtype=dtype, device=device, **layout())
    if not eager_only:
        caches["expand-qknorm"] = caches["mla-qknorm"]  # the same cache, re-expanded
    bytes_per_token = {name: c.bytes_per_token for name, c in caches.items()}
    bytes_per_token["full-key-qknorm"] = FullKVCache.from_config(cfg, 1, 1, dtype=dtype, device=device).bytes_per_token
    compiled = torch.compile(mla_decode_step, fullgraph=True, backend=args.compile_backend)
    x = torch.randn(B, 1, cfg.hidden_size, device=device, dtype=dtype)

    def step(name, module, path="auto"):
        cache, saved = caches[name], caches[name].bookkeeping()
        if name.endswith("-compiled"):
            def call():
                decode_one_token(module, x, cache, step=compiled)
                cache.restore(saved)
        else:
            def call():
                module(x, cache, path=path)
                cache.restore(saved)  # the same context every call
        return call

    info = result["machine"]
    print(f"# {info['cpu']} ({info['cores']} cores, {info['torch_threads']} torch threads), torch {info['torch']}, "
          f"{args.preset}, {args.dtype}, batch {B}, {f'paged ({paged}-token blocks)' if paged else 'contiguous'}, "
          f"load average {load_at_start:.2f}"
          + ("" if hf is None else ", transformers' DeepseekV3Attention"))
    print(f"{'context':>8} {'row':<22}{'ms':>10}{'/ mla':>8}{'bytes/token':>13}")
    results, compile_record, filled, by = [], {}, 0, {}
    hf_cache_rows = hf_rows(*hf, longest, device) if hf is not None else None
    for context in contexts:
        for cache in {id(c): c for c in caches.values()}.values():  # grow every cache to this context
            plan = cache.plan(B, context - filled)
            cache.write_rows(plan, {f: v[:, filled:context] for f, v in rows.items() if f in cache.fields})
        filled = context
        fns = {"mla": step("mla", plain), "mla-qknorm": step("mla-qknorm", qk)}
        if not eager_only:
            fns.update({"mla-compiled": step("mla-compiled", plain),
                        "mla-qknorm-compiled": step("mla-qknorm-compiled", qk),
                        "expand-qknorm": step("expand-qknorm", qk, path="expand")})
        if hf is not None:
            fns["transformers"] = hf_step(*hf, hf_cache_rows, context, device)
            bytes_per_token["transformers"] = sum(t.shape[1] * t.shape[3] * t.element_size() for t in hf_cache_rows)
        with torch.inference_mode():  # the compiled step computes the eager step's output (and compiles here)
            diffs = {}
            for name, module in () if eager_only else (("mla", plain), ("mla-qknorm", qk)):
                t0 = time.perf_counter()
                eager, fast = caches[name], caches[f"{name}-compiled"]
                saved = eager.bookkeeping()  # the two caches hold the same rows and lengths
                got = decode_one_token(module, x, fast, step=compiled)
                fast.restore(saved)
                want = module(x, eager)
                eager.restore(saved)
                diffs[name] = {"max_abs_diff_to_eager": float((got - want).abs().max()),
                               "first_call_s": round(time.perf_counter() - t0, 2)}
        compile_record[context] = diffs
        by[context] = per_round = time_rows(fns, args.rounds, device)
        for name, rounds in per_round.items():
            base = "mla-compiled" if name.endswith("-compiled") else "mla"
            row = {"context": context, "row": name, "ms": round(statistics.median(sum(rounds, [])) * 1e3, 3),
                   "ratio_to_mla": round(ratio(per_round, name, base), 3), "calls": sum(map(len, rounds)),
                   "cache_bytes_per_token": bytes_per_token[name]}
            results.append(row)
            print(f"{context:>8} {name:<22}{row['ms']:>10.2f}{row['ratio_to_mla']:>8.3f}"
                  f"{row['cache_bytes_per_token']:>13,}")

    summary = {  # ratios taken round by round (see ``ratio``)
        "qknorm_over_mla": {c: round(ratio(by[c], "mla-qknorm", "mla"), 3) for c in contexts},
        "qknorm_over_mla_compiled": {c: round(ratio(by[c], "mla-qknorm-compiled", "mla-compiled"), 3)
                                     for c in contexts if "mla-compiled" in by[c]},
        "expand_over_qknorm_compiled": {c: round(ratio(by[c], "expand-qknorm", "mla-qknorm-compiled"), 2)
                                        for c in contexts if "expand-qknorm" in by[c]},
        "transformers_over_qknorm_compiled": {c: round(ratio(by[c], "transformers", "mla-qknorm-compiled"), 2)
                                              for c in contexts if "transformers" in by[c]},
        "full_key_cache_bytes_per_token": bytes_per_token["full-key-qknorm"],
        "full_key_cache_over_qknorm_latent_cache": round(bytes_per_token["full-key-qknorm"]
                                                         / bytes_per_token["mla-qknorm"], 2),
    }
    for key, value in summary.items():
        print(f"{key}: {value}")
    transformers_version = None
    if hf is not None:
        import transformers
        transformers_version = transformers.__version__
    result.update(transformers=transformers_version, preset=args.preset, dtype=args.dtype, device=device, batch=B,
                  cache_layout=f"paged, {paged}-token blocks" if paged else "contiguous", rounds=args.rounds,
                  compile={"backend": args.compile_backend, "per_context": compile_record}, rows=results,
                  summary=summary)


if __name__ == "__main__":
    sys.exit(main())

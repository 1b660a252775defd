"""A whole transformers DeepSeek-V3-architecture model: unpatched against ``apply_latent_attention``.

    python -m benchmarks.bench_hf_generate [--contexts 1024 4096 16384 32768] [--dtypes float32 bfloat16]
                                           [--out FILE.json] [--overwrite] [--quick]

The model: DeepSeek-V3's attention at tensor parallelism 8 (16 heads, q_lora_rank 1536,
kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, hidden 7168), 2 layers, a small dense
MLP, random weights. Variants, side by side in one run:

    transformers   the model as transformers runs it (its DeepSeek attention caches the latent
                   and re-expands every cached latent through kv_b_proj at every step)
    qkmla          apply_latent_attention(model): the absorbed path over qkmla's latent cache
    qkmla-fp8      the same, latents stored as fp8 (FlashMLA's 656-byte row)
    qkmla-snapkv   the same, SnapKV keeping 25% of the prompt

Each (dtype, context, variant) runs in a fresh process, so its peak memory (the process's
max RSS: weights, cache and every temporary) is its own. A cell prefills a random prompt of
``context`` tokens, then times single-token decode steps (median after warm-up). A one-shot
transformers prefill whose score matrix ([heads, T, T] floats: its attention falls back to
storing every score, because query/key and value head sizes differ) would exceed
``--score-budget-gib`` is filled in chunks of ``--chunk`` tokens instead, and the cell says so.
"""

from __future__ import annotations

import argparse
import inspect
import os
import resource
import statistics
import sys
import time

import torch

from .common import add_cell_options, parse_cell_args, run_cell_grid

VARIANTS = ("transformers", "qkmla", "qkmla-fp8", "qkmla-snapkv")
SHAPE = dict(vocab_size=1024, hidden_size=7168, intermediate_size=1024, num_hidden_layers=2, first_k_dense_replace=2,
             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
             qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=65536, n_routed_experts=8,
             num_experts_per_tok=2, n_group=1, topk_group=1)


def build_model(dtype: torch.dtype, variant: str):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**SHAPE, attn_implementation="sdpa")).to(dtype).eval()
    if variant != "transformers":
        from qkmla.cache import SnapKV
        from qkmla.integrations.transformers import apply_latent_attention

        policy = SnapKV(kept_fraction=0.25) if variant == "qkmla-snapkv" else None
        apply_latent_attention(model, kv_format="fp8" if variant == "qkmla-fp8" else "dense", policy=policy)
    return model


def cache_bytes(cache, tokens: int) -> dict:
    """The cache's bytes per cached token (its row, summed over layers) and the bytes it stores
    per token of context (below the row where an eviction policy dropped tokens)."""
    if hasattr(cache, "bytes_per_token"):  # qkmla's
        stored = sum(int(layer.latent.seqlens.sum()) * layer.bytes_per_token for layer in cache.layers)
        return {"cache_bytes_per_token": cache.bytes_per_token, "cache_bytes_per_context_token": stored / tokens}
    stored = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return {"cache_bytes_per_token": stored / tokens, "cache_bytes_per_context_token": stored / tokens}


def run_cell(dtype_name: str, context: int, variant: str, steps: int, warmup: int, chunk: int,
             score_budget_gib: float, threads: int) -> dict:
    from qkmla.integrations.transformers import LatentAttentionCache

    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    model = build_model(dtype, variant)
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, context), generator=torch.Generator().manual_seed(1))
    score_gib = SHAPE["num_attention_heads"] * context * context * 4 / 2**30
    one_shot = variant != "transformers" or score_gib <= score_budget_gib
    if variant == "transformers":
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
    else:
        cache = LatentAttentionCache(model)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.24 renamed it
    with torch.inference_mode():
        t0 = time.perf_counter()
        pieces = [prompt] if one_shot else prompt.split(chunk, dim=1)
        for piece in pieces:
            logits = model(input_ids=piece, use_cache=True, **{name: cache}).logits
        prefill_s = time.perf_counter() - t0
        times = []
        token = logits[:, -1:].argmax(-1)
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            logits = model(input_ids=token, use_cache=True, **{name: cache}).logits
            times.append(time.perf_counter() - t0)
            token = logits[:, -1:].argmax(-1)
    step = statistics.median(times[warmup:])
    return {"dtype": dtype_name, "context": context, "variant": variant, "prefill_s": round(prefill_s, 3),
            "prefill": "one-shot" if one_shot else f"chunks of {chunk} (one-shot scores: {score_gib:.1f} GiB)",
            "decode_step_ms": round(step * 1e3, 3), "decode_tokens_per_s": round(1 / step, 3),
            "decode_steps_timed": steps, **cache_bytes(cache, context + warmup + steps),
            "torch_threads": torch.get_num_threads(), "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "load_average_1min_at_end": round(os.getloadavg()[0], 2)}  # other work on the machine, if any


def summarize(rows: list) -> list:
    """Per (dtype, context): each qkmla variant's decode speed-up over transformers and byte ratio."""
    out = []
    for row in rows:
        base = next((r for r in rows if r["variant"] == "transformers" and r["dtype"] == row["dtype"]
                     and r["context"] == row["context"] and "error" not in r), None)
        if row["variant"] == "transformers" or base is None or "error" in row:
            continue
        out.append({"dtype": row["dtype"], "context": row["context"], "variant": row["variant"],
                    "decode_speedup": round(base["decode_step_ms"] / row["decode_step_ms"], 2),
                    "cache_bytes_ratio": round(row["cache_bytes_per_context_token"]
                                               / base["cache_bytes_per_context_token"], 4)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=5, help="decode steps timed per cell (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk", type=int, default=1024, help="chunk size of a transformers prefill that cannot run at once")
    p.add_argument("--score-budget-gib", type=float, default=4.0)
    add_cell_options(p, threads=0, threads_help="torch threads per cell (default: torch's, one per core); 1 holds up "
                                                "on a shared machine", quick="1k context, float32, 2 steps")
    args = parse_cell_args(p, argv, run_cell, positive_ints=("steps", "chunk"))
    if args is None:
        return 0
    if args.quick:
        args.contexts, args.dtypes, args.steps, args.warmup = [1024], ["float32"], 2, 1
    run_cell_grid(p, args, argv, __spec__.name, SHAPE, summarize, chunk=args.chunk, score_budget_gib=args.score_budget_gib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
